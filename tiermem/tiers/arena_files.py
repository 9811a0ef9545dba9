"""An arena file's header, read and written without the arena: what ``tiermem arenas`` lists (who made each
arena, whether its owner still runs) needs only this module, not torch (``dram`` has the arena itself and
re-exports these names).

The header is the file's first 4 KiB page: ``MAGIC`` then a JSON object (the owner's pid and that process's start
time, the arena's name, size and creation time, and who made it: ``owner``), padded with zeros.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tiermem.errors import StorageError

HEADER = 4096
MAGIC = b"TIERMEM-ARENA-1\n"
SUFFIX = ".arena"


@dataclass
class ArenaInfo:
    """What the header of an arena file says, and whether its owner still runs."""

    path: Path
    name: str
    pid: int
    size: int
    created: float
    alive: bool
    owner: dict = field(default_factory=dict)  # who made it: {"kind": "service", "state_dir", "config", "socket"}


def process_start(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), or None when there is none (or it cannot be read)."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, ValueError, OverflowError):
        return None


def owner_alive(header: dict) -> bool:
    """Whether the process an arena's header names still runs: its pid exists and, where the header records the
    process's start time, it started then (not another process given the same pid since)."""
    started = process_start(header["pid"])
    if started is None:
        return False
    recorded = header.get("pid_start")
    return not isinstance(recorded, (int, float)) or abs(started - recorded) < 1.0


def _header(name: str, size: int, created: float, owner: dict | None) -> bytes:
    """An arena's header page for this process (see the module docstring)."""
    h = {"name": name, "pid": os.getpid(), "pid_start": process_start(os.getpid()), "size": size, "created": created,
         "owner": dict(owner or {})}
    raw = MAGIC + json.dumps(h).encode()
    if len(raw) > HEADER:
        raise StorageError(f"the arena header of {name} does not fit in {HEADER} bytes (its owner's paths are too "
                           "long)")
    return raw.ljust(HEADER, b"\0")


# the header's fields and their types: a header without them (garbled, written by something else) is not an arena's
HEADER_FIELDS = {"name": str, "pid": int, "size": int, "created": (int, float)}


def _read_header(path: Path) -> dict:
    """The arena's header, checked: a file that is not a regular file (not opened: a FIFO would wait), whose
    header is not JSON or lacks a field of its type is a StorageError, never another exception."""
    try:
        with open(path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NONBLOCK)) as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise StorageError(f"{path} is not a tiermem arena (not a regular file)")
            raw = f.read(HEADER)
    except OSError as e:
        raise StorageError(f"{path} cannot be read: {e.strerror}") from None
    if not raw.startswith(MAGIC):
        raise StorageError(f"{path} is not a tiermem arena (bad header)")
    try:
        h = json.loads(raw[len(MAGIC):].rstrip(b"\0").decode())
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise StorageError(f"{path}: its arena header is not JSON") from None
    if not isinstance(h, dict):
        raise StorageError(f"{path}: its arena header is not a JSON object")
    for key, kind in HEADER_FIELDS.items():
        if not isinstance(h.get(key), kind) or isinstance(h.get(key), bool):
            raise StorageError(f"{path}: its arena header has no well-formed '{key}'")
    if h["pid"] <= 0 or h["size"] < HEADER:
        raise StorageError(f"{path}: its arena header's pid or size is out of range")
    return h


def header_problem(path: Path) -> str | None:
    """Why ``path`` is not listed as an arena (what reading its header says), or None when its header reads."""
    try:
        _read_header(path)
    except StorageError as e:
        return str(e)
    return None


def list_arenas(directory: str | Path = "/dev/shm") -> list[ArenaInfo]:
    """Every tiermem arena file in ``directory``; ``alive`` is False for ones whose owner is gone."""
    out = []
    for path in sorted(Path(directory).glob(f"*{SUFFIX}")):
        try:
            h = _read_header(path)
        except (OSError, StorageError, ValueError):
            continue
        owner = h.get("owner") if isinstance(h.get("owner"), dict) else {}
        out.append(ArenaInfo(path, h["name"], h["pid"], h["size"], h["created"], owner_alive(h), owner))
    return out
