"""The user's files as tiermem reads them: a regular file, or one line saying what is there instead.

A FIFO or a device given as a config, model or dataset file would block the read (a FIFO waits for a writer)
or never end (``/dev/zero``): each is refused before it is opened, and opened without waiting (``O_NONBLOCK``)
in case it was swapped since. A NUL in a path is refused in one line too (Python raises ValueError there).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from tiermem.errors import ConfigError, shown


def kind_of(mode: int) -> str:
    """What a file of ``mode`` is, in words."""
    for test, what in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
                       (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "not a regular file"


def regular_file(path: str | Path, what: str) -> os.stat_result | None:
    """The status of the regular file ``path`` (symbolic links followed), or None when nothing is there; a
    FIFO, a device, a directory or a socket there is a ConfigError naming ``what`` and the path."""
    p = Path(path)
    try:
        st = p.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise ConfigError(f"{what} {p} cannot be read: {e.strerror}") from None
    except ValueError:  # (a NUL in the path)
        raise ConfigError(f"{what} {shown(str(p))} is not a path: it holds a NUL character") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{what} {p} is {kind_of(st.st_mode)}, not a regular file")
    return st


def is_regular(path: str | Path, what: str) -> bool:
    """Whether a regular file is at ``path``: False when nothing is; a FIFO, a device ... is a ConfigError."""
    return regular_file(path, what) is not None


def read_bytes(path: str | Path, what: str, limit: int | None = None) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit`` of them: a larger file is refused unread), or
    a one-line ConfigError: not found, not a regular file, too large, unreadable."""
    p = Path(path)
    st = regular_file(p, what)
    if st is None:
        raise ConfigError(f"{what} not found: {p}")
    if limit is not None and st.st_size > limit:
        raise ConfigError(f"{p}: {st.st_size:,} bytes is too large for a {what} (at most {limit:,})")
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if not stat.S_ISREG(mode):  # (swapped since the check)
                raise ConfigError(f"{what} {p} is {kind_of(mode)}, not a regular file")
            raw = f.read() if limit is None else f.read(limit + 1)
    except OSError as e:
        raise ConfigError(f"{what} {p} cannot be read: {e.strerror}") from None
    if limit is not None and len(raw) > limit:
        raise ConfigError(f"{p}: too large for a {what} (at most {limit:,} bytes)")
    return raw


def read_text(path: str | Path, what: str, limit: int | None = None) -> str:
    """``read_bytes`` as UTF-8 text."""
    try:
        return read_bytes(path, what, limit).decode()
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (a {what} must be UTF-8 text)") from None


def read_json(path: str | Path, what: str, limit: int | None = None):
    """The JSON value of the file ``path`` (``read_bytes``), or one line saying where it is not JSON."""
    import json

    try:
        return json.loads(read_bytes(path, what, limit))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (a {what} must be UTF-8 JSON)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON: {e}") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid JSON: nested too deep") from None
