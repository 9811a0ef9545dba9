"""Who owns a store's files: an exclusive lock (``flock``) on ``<name>.lock`` beside them.

A service takes it before it reads, writes or deletes anything of its run (run record, journal, arena,
NVMe file), in each directory that holds them (the state directory, the arena's), and holds it for its
whole life: a second service on the same store is refused with the owner's pid and touches nothing. The
kernel drops the lock when its process ends, ``kill -9`` included, so a killed service's files are free
for the next one to recover. ``tiermem arenas --clean`` takes it before it removes an arena.

The lock file stays when the lock goes (removing it would race with a process about to take it). It
says, as JSON, the owner's pid and where its run is recorded (``state_dir``, ``config``): ``tiermem
arenas`` reads that beside an arena to tell whether a run can be recovered from it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from pathlib import Path

from tiermem.errors import UserError

SUFFIX = ".lock"


def lock_path(directory: str | Path, name: str) -> Path:
    return Path(directory) / f"{name}{SUFFIX}"


def read_note(path: Path) -> dict:
    """What the lock file at ``path`` says (``{}`` when there is none or it is unreadable)."""
    try:
        note = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return note if isinstance(note, dict) else {}


class Owned(UserError):
    """Another process holds the store's lock."""

    def __init__(self, name: str, pid):
        super().__init__(f"another tiermem service (pid {pid}) owns the store {name}; stop it first or use another "
                         "name")
        self.pid = pid


def try_lock(path: Path) -> int | None:
    """An fd holding ``path``'s exclusive lock, or None when another process holds it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise UserError(f"cannot open the lock file {path}: {os.strerror(e.errno)}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise UserError(f"cannot lock {path}: {os.strerror(e.errno)}") from None
    return fd


class Ownership:
    """The locks of one store, held until ``release`` (or the process's end)."""

    def __init__(self, fds: list[int]):
        self._fds = fds

    @classmethod
    def take(cls, name: str, directories, note: dict | None = None) -> Ownership:
        """Lock ``<dir>/<name>.lock`` in each existing directory of ``directories`` and write ``note`` (with
        this pid) into each; refuse with one line, holding nothing, when another process holds one."""
        paths = sorted({lock_path(Path(d).resolve(), name) for d in directories if Path(d).is_dir()})
        fds: list[int] = []
        try:
            for path in paths:
                fd = try_lock(path)
                if fd is None:
                    raise Owned(name, read_note(path).get("pid", "?"))
                fds.append(fd)
            if note is not None:
                data = json.dumps(dict(note, pid=os.getpid())).encode()
                for fd in fds:
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, data, 0)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return cls(fds)

    def release(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)

    def __enter__(self) -> Ownership:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
