"""The NVMe tier: one preallocated file in a directory, or one in each of several directories (one per device:
``tiers.nvme.path`` a list), carved into 4 KiB-aligned extents.

I/O is asynchronous (``pread``/``pwrite`` return futures) through a backend: ``posix`` (runs anywhere)
or ``kvikio`` (GPUDirect Storage where the machine has it, compat mode otherwise; GPU buffers go
straight to and from the file). ``auto`` takes kvikio when it is installed and can do I/O here. With several
directories the tier's address space is striped over their files (``tiermem.tiers.stripes``: ``io_chunk`` bytes
to each in turn), each file with its own backend and queue of ``threads``: a group's transfer keeps every device
busy at once, and the disks' rates add up.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import ctypes.util
import errno
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from tiermem.errors import ConfigError, StorageError, shown
from tiermem.futures import all_of
from tiermem.schema import setting
from tiermem.sizes import align_up, format_size, parse_size, size_or_auto
from tiermem.tiers import stripes
from tiermem.tiers.base import STORAGE, DiskRates, Making
from tiermem.tiers.extents import Extent, ExtentAllocator
from tiermem.tiers.nvme_kvikio import KvikioBackend, kvikio_usable
from tiermem.tiers.nvme_posix import PosixBackend

log = logging.getLogger(__name__)
SUFFIX = ".nvme"
_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE (linux/falloc.h)
_libc = None


def _threads(value, where: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 1024:
        return value
    raise ConfigError(f"{where}: expected a number of I/O threads from 1 to 1024, got {shown(value)}")


def _io_chunk(value, where: str) -> int:
    n = parse_size(value, where)
    if not 4096 <= n <= 1 << 30:
        raise ConfigError(f"{where}: expected a size from 4KiB to 1GiB (requests are split into pieces of it), got "
                          f"{shown(value)}")
    return n


def _paths(value, where: str) -> str | list[str]:
    """``path``: a directory, or a list of them (one per device; at least one, no two the same)."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ConfigError(f"{where}: expected a directory, or a list of directories (one per device), got []")
        dirs = [str(v) if isinstance(v, str) else None for v in value]
        if any(d is None for d in dirs):
            raise ConfigError(f"{where}: expected a list of directories, got {shown(value)}")
        return dirs[0] if len(dirs) == 1 else dirs
    if isinstance(value, str):
        return value
    raise ConfigError(f"{where}: expected a directory, or a list of directories (one per device), got {shown(value)}")


def directories(section) -> list[str]:
    """The directories of a ``tiers.nvme`` section, the first holding what lives in one place (a service's run
    record)."""
    p = section.path
    return list(p) if isinstance(p, (list, tuple)) else [p]


@dataclass
class NvmeTierConfig:
    """Preallocated files in a directory (or one per device: a list), read and written through kvikio or POSIX I/O;
    with several directories each group's bytes are striped over their files."""

    path: str | list[str] | None = setting(None, convert=_paths, yaml_type="directory | list of directories",
                                           shown="required when the tier is set", help=(
        "directory of the tier's file <name>.nvme (created if its parent exists); or a list of directories, one "
        "per drive: the tier is striped over a file in each, io_chunk bytes to each in turn, each with its own "
        "queue of threads, so a group's transfer keeps every drive busy and their rates add up (the quick probe "
        "and `tiermem probe --nvme-path A --nvme-path B` measure them together)"))
    budget: int | None = setting(None, convert=size_or_auto, yaml_type="size | auto", help=(
        "hard limit; the file is preallocated to what the placement needs. Unset: 90% of the disk's free space, "
        "less a checkpoint when the run saves them and output_dir is on the same disk (the exported model's room "
        "is kept beside the state that stays on NVMe to the end: gradients and moments there are discarded, their "
        "space given back, before the export; where the filesystem cannot punch holes it is kept from the whole "
        "budget); with several directories, the fullest drive's free share times their number"),
        shown="90% of the disk's free space")
    backend: Literal["auto", "kvikio", "posix"] = setting("auto", help=(
        "auto: kvikio when installed and able to do I/O here, else posix; the choice and the reason are logged"))
    threads: int = setting(8, convert=_threads, yaml_type="integer (1-1024)", help=(
        "I/O threads (posix) or kvikio's thread pool"))
    io_chunk: int = setting(16 << 20, convert=_io_chunk, yaml_type="size (4KiB-1GiB)", shown="16MiB", help=(
        "large requests are split into pieces of this size, in flight at once"))
    direct: bool = setting(True, help="O_DIRECT where the filesystem allows it (buffered I/O with a notice where "
                                      "not)")


def existing_parent(path: str) -> str:
    """``path``, or its nearest ancestor that exists (a directory the NVMe tier is yet to create)."""
    while path and not os.path.isdir(path):
        path = os.path.dirname(path.rstrip("/")) or "/"
    return path or "/"


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Give the file's bytes [offset, offset + length) back to the filesystem (the file keeps its size and
    reads zeros there); False where the filesystem or platform cannot."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        if hasattr(_libc, "fallocate"):
            _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if not hasattr(_libc, "fallocate"):
        return False
    return _libc.fallocate(fd, _PUNCH_HOLE, offset, length) == 0


def can_punch_holes(directory: str | Path) -> bool:
    """Whether files in ``directory`` give freed bytes back (tried on a small file of its own)."""
    try:
        with tempfile.TemporaryFile(dir=directory) as f:
            os.posix_fallocate(f.fileno(), 0, 1 << 16)
            return punch_hole(f.fileno(), 0, 1 << 16)
    except OSError:
        return False


def check_directory(path: Path, need: int) -> Path:
    """Make sure ``path`` is a writable directory with ``need`` bytes free; one-line errors otherwise."""
    if not path.exists():
        if not path.parent.is_dir():
            raise StorageError(f"NVMe tier path {path} does not exist (nor its parent); create it or "
                               "set tiers.nvme.path to an existing directory")
        try:
            path.mkdir(mode=0o700)
        except OSError as e:
            raise StorageError(f"cannot create NVMe tier directory {path}: {os.strerror(e.errno)}") from None
    if not path.is_dir():
        raise StorageError(f"NVMe tier path {path} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise StorageError(f"NVMe tier path {path} is not writable by this user; choose another tiers.nvme.path")
    free = shutil.disk_usage(path).free
    if need > free:
        raise StorageError(f"NVMe tier needs {format_size(need)} but {path} has {format_size(free)} free; "
                           "lower tiers.nvme.budget, free disk space, or choose another tiers.nvme.path")
    return path


def choose_backend(want: str, directory: Path) -> tuple[str, str]:
    """Resolve ``auto``; returns (backend, why)."""
    if want == "posix":
        return "posix", "configured"
    ok, why = kvikio_usable(directory)
    if want == "kvikio":
        if not ok:
            raise StorageError(f"tiers.nvme.backend is kvikio but {why}; use backend: posix or auto")
        return "kvikio", why
    return ("kvikio", why) if ok else ("posix", why)


class NvmeTier:
    """A storage tier (``tiermem.tiers.base``): configured under ``tiers.nvme``, made where state lives there."""

    role = STORAGE
    optional = True
    Config = NvmeTierConfig
    resource = "nvme"
    label = "NVMe"

    @classmethod
    def make(cls, section: NvmeTierConfig, capacity: int, at: Making) -> NvmeTier:
        return cls(directories(section), at.store_name, capacity, section.backend, section.threads, section.io_chunk,
                   section.direct)

    @classmethod
    def default_budget(cls, section: NvmeTierConfig, device: torch.device, host_memory) -> int:
        """90% of what the disks that hold ``path`` have free: striped evenly, each directory takes the same share,
        so the fullest disk (its free space split among the directories on it) bounds them all."""
        dirs = [existing_parent(d) for d in directories(section)]
        on: dict = {}
        for d in dirs:
            on.setdefault(os.stat(d).st_dev, []).append(d)
        share = min(shutil.disk_usage(ds[0]).free // len(ds) for ds in on.values())
        return int(share * len(dirs) * 0.9)

    @classmethod
    def check_section(cls, section: NvmeTierConfig, where: str) -> None:
        dirs = directories(section) if section.path is not None else []
        if not dirs or not all(dirs):
            raise ConfigError(f"{where}.path is required: the directory that holds the NVMe tier's files")
        seen = [os.path.realpath(os.path.expanduser(d)) for d in dirs]
        if len(set(seen)) < len(seen):
            raise ConfigError(f"{where}.path names the same directory twice: one directory a device")

    @classmethod
    def rates(cls, machine) -> DiskRates:
        """The machine's disk figures (``nvme_read``, ``nvme_write``, ``nvme_both``: a probe's, measured on this
        tier's disks together)."""
        return DiskRates(machine.nvme_read, machine.nvme_write, machine.nvme_both)

    # -- shared with other processes (a service's trainer, the ranks of a host) ----------------------------
    def describe(self, section: NvmeTierConfig, chosen: bool = False) -> dict:
        """What another process needs to map this tier's files (``map_shared``): the backend as configured, or
        (``chosen``) the one this tier chose."""
        dirs = directories(section)
        return {"dir": dirs[0] if len(dirs) == 1 else dirs, "capacity": self.capacity,
                "backend": self.backend_name if chosen else section.backend, "threads": section.threads,
                "io_chunk": section.io_chunk, "direct": section.direct}

    @classmethod
    def map_shared(cls, desc: dict, store_name: str, device: torch.device) -> NvmeTier:
        return cls(desc["dir"], store_name, desc["capacity"], desc["backend"], desc["threads"], desc["io_chunk"],
                   desc["direct"], reopen=True)

    @classmethod
    def reopen_left(cls, section: NvmeTierConfig, store_name: str, capacity: int, device: torch.device) -> NvmeTier:
        return cls(directories(section), store_name, capacity, section.backend, section.threads, section.io_chunk,
                   section.direct, reopen=True)

    def __init__(self, directory: str | Path | list, name: str, capacity: int, backend: str = "auto",
                 threads: int = 8, io_chunk: int = 16 << 20, direct: bool = True, reopen: bool = False):
        """Create the tier's file in ``directory`` (or one in each of a list of directories, striped; ``reopen``:
        open the existing ones, keeping their bytes; the caller rebuilds the allocator's extents and closes with
        ``remove=False`` when the files must outlive it)."""
        dirs = [Path(d) for d in (directory if isinstance(directory, (list, tuple)) else [directory])]
        capacity = align_up(max(capacity, 4096), 4096)
        self.unit = max(4096, io_chunk - io_chunk % 4096)  # (a stripe: one request's piece)
        self.paths = [d / f"{name}{SUFFIX}" for d in dirs]
        self.path = self.paths[0]
        self.backends: list = []
        self.backend = None
        each = stripes.file_bytes(capacity, len(dirs), self.unit)
        if reopen:
            for p in self.paths:
                if not p.is_file() or p.stat().st_size < each:
                    raise StorageError(f"NVMe tier file {p} is missing or shorter than {format_size(each)}")
            self._open(dirs, capacity, backend, threads, io_chunk, direct, remove_on_error=False)
            return
        for d in dirs:
            check_directory(d, each)
        made: list[Path] = []
        try:
            for d, p in zip(dirs, self.paths):
                _create_file(p, d, each)
                made.append(p)
        except BaseException:
            for p in made:
                p.unlink(missing_ok=True)
            raise
        self._open(dirs, capacity, backend, threads, io_chunk, direct, remove_on_error=True)

    def _open(self, dirs: list[Path], capacity: int, backend: str, threads: int, io_chunk: int, direct: bool,
              remove_on_error: bool) -> None:
        self.capacity = capacity
        self.allocator = ExtentAllocator(capacity, 4096)
        try:
            self.backend_name, why = choose_backend(backend, dirs[0])
            if self.backend_name == "kvikio" and len(dirs) > 1:  # (every disk the same way)
                for d in dirs[1:]:
                    ok, other = kvikio_usable(d)
                    if not ok:
                        if backend == "kvikio":
                            raise StorageError(f"tiers.nvme.backend is kvikio but {other}; use backend: posix or auto")
                        self.backend_name, why = "posix", other
                        break
            make = KvikioBackend if self.backend_name == "kvikio" else PosixBackend
            for p in self.paths:
                self.backends.append(make(p, threads, io_chunk, direct))
        except BaseException:
            for b in self.backends:
                b.close()
            self.backends = []
            if remove_on_error:
                for p in self.paths:
                    p.unlink(missing_ok=True)
            raise
        self.backend = self.backends[0]
        self.backend_reason = why if backend == "auto" else "configured"
        log.info("NVMe tier %s: %s backend (%s; %s)", ", ".join(map(str, self.paths)), self.backend_name,
                 self.backend.reason, self.backend_reason)

    def allocate(self, nbytes: int) -> Extent:
        return self.allocator.allocate(nbytes)

    def free(self, extent: Extent) -> None:
        self.allocator.free(extent)

    def discard(self, extents: list[Extent]) -> int:
        """Free ``extents`` for good: their bytes go back to the filesystem (holes punched in the files) where
        it can; returns the bytes given back."""
        back = 0
        fds = [os.open(p, os.O_RDWR) for p in self.paths]
        try:
            for e in extents:
                self.allocator.free(e)
                for f, off, start, end in stripes.pieces(e.offset, e.nbytes, len(fds), self.unit):
                    if punch_hole(fds[f], off, end - start):
                        back += end - start
        finally:
            for fd in fds:
                os.close(fd)
        return back

    def pread(self, buf: torch.Tensor, extent: Extent) -> cf.Future:
        """Read the first ``buf.nbytes`` bytes of ``extent`` into ``buf``."""
        self._check(buf, extent)
        return self._io(False, buf, extent.offset)

    def pwrite(self, buf: torch.Tensor, extent: Extent) -> cf.Future:
        """Write ``buf`` at the start of ``extent``."""
        self._check(buf, extent)
        return self._io(True, buf, extent.offset)

    def _io(self, write: bool, buf: torch.Tensor, offset: int) -> cf.Future:
        if len(self.backends) == 1:
            return (self.backend.pwrite if write else self.backend.pread)(buf, offset)
        raw = buf.reshape(-1).view(torch.uint8)
        futs = []
        for f, off, start, end in stripes.pieces(offset, raw.numel(), len(self.backends), self.unit):
            b = self.backends[f]
            futs.append((b.pwrite if write else b.pread)(raw[start:end], off))
        return all_of(futs)

    @property
    def direct_to_gpu(self) -> bool:
        return self.backend_name == "kvikio"

    def stats(self) -> dict:
        out = {"path": str(self.path), "backend": self.backend_name, "backend_mode": self.backend.reason}
        if len(self.paths) > 1:
            out["paths"] = [str(p) for p in self.paths]
        return out

    @staticmethod
    def _check(buf: torch.Tensor, extent: Extent) -> None:
        if buf.numel() * buf.element_size() > extent.nbytes:
            raise ValueError(f"buffer of {buf.numel() * buf.element_size()} bytes overruns {extent}")

    def close(self, remove: bool = True) -> None:
        if self.backends:
            for b in self.backends:
                b.close()
            self.backends, self.backend = [], None
            if remove:
                for p in self.paths:
                    p.unlink(missing_ok=True)


def _create_file(path: Path, directory: Path, size: int) -> None:
    """A new file of ``size`` bytes, preallocated where the filesystem can (sparse where it cannot)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise StorageError(f"NVMe tier file {path} already exists (another store, or one left "
                           "behind); remove it or give this store another name") from None
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise StorageError(f"NVMe tier: no space for {format_size(size)} in {directory}; "
                                   "lower tiers.nvme.budget or free disk space") from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, size)
            log.warning("NVMe tier: %s cannot preallocate; the file is sparse", directory)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
