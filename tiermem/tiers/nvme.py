"""The NVMe tier: one preallocated file in a directory, carved into 4 KiB-aligned extents.

I/O is asynchronous (``pread``/``pwrite`` return futures) through a backend: ``posix`` (runs anywhere)
or ``kvikio`` (GPUDirect Storage where the machine has it, compat mode otherwise; GPU buffers go
straight to and from the file). ``auto`` takes kvikio when it is installed and can do I/O here.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from tiermem.errors import ConfigError, StorageError, shown
from tiermem.sizes import align_up, format_size, parse_size, size_or_auto
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


@dataclass
class NvmeTierConfig:
    """Preallocated files in a directory, read and written through kvikio or POSIX I/O."""

    path: str | None = None
    budget: int | None = field(default=None, metadata={"convert": size_or_auto})
    backend: Literal["auto", "kvikio", "posix"] = "auto"
    threads: int = field(default=8, metadata={"convert": _threads})  # I/O threads (posix) or kvikio's pool size
    io_chunk: int = field(default=16 << 20, metadata={"convert": _io_chunk})  # split large requests
    direct: bool = True  # O_DIRECT where the filesystem allows it


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
        return cls(section.path, at.store_name, capacity, section.backend, section.threads, section.io_chunk,
                   section.direct)

    @classmethod
    def default_budget(cls, section: NvmeTierConfig, device: torch.device, host_memory) -> int:
        """90% of the free space of the disk that holds ``path``."""
        return int(shutil.disk_usage(existing_parent(section.path)).free * 0.9)

    @classmethod
    def check_section(cls, section: NvmeTierConfig, where: str) -> None:
        if not section.path:
            raise ConfigError(f"{where}.path is required: the directory that holds the NVMe tier's files")

    @classmethod
    def rates(cls, machine) -> DiskRates:
        """The machine's disk figures (``nvme_read``, ``nvme_write``, ``nvme_both``: a probe's, measured on this
        tier's disk)."""
        return DiskRates(machine.nvme_read, machine.nvme_write, machine.nvme_both)

    # -- shared with other processes (a service's trainer, the ranks of a host) ----------------------------
    def describe(self, section: NvmeTierConfig, chosen: bool = False) -> dict:
        """What another process needs to map this tier's file (``map_shared``): the backend as configured, or
        (``chosen``) the one this tier chose."""
        return {"dir": str(section.path), "capacity": self.capacity,
                "backend": self.backend_name if chosen else section.backend, "threads": section.threads,
                "io_chunk": section.io_chunk, "direct": section.direct}

    @classmethod
    def map_shared(cls, desc: dict, store_name: str, device: torch.device) -> NvmeTier:
        return cls(desc["dir"], store_name, desc["capacity"], desc["backend"], desc["threads"], desc["io_chunk"],
                   desc["direct"], reopen=True)

    @classmethod
    def reopen_left(cls, section: NvmeTierConfig, store_name: str, capacity: int, device: torch.device) -> NvmeTier:
        return cls(section.path, store_name, capacity, section.backend, section.threads, section.io_chunk,
                   section.direct, reopen=True)

    def __init__(self, directory: str | Path, name: str, capacity: int, backend: str = "auto",
                 threads: int = 8, io_chunk: int = 16 << 20, direct: bool = True, reopen: bool = False):
        """Create the tier's file (``reopen``: open the existing one, keeping its bytes; the caller rebuilds
        the allocator's extents and closes with ``remove=False`` when the file must outlive it)."""
        directory = Path(directory)
        capacity = align_up(max(capacity, 4096), 4096)
        self.path = directory / f"{name}{SUFFIX}"
        self.backend = None
        if reopen:
            if not self.path.is_file() or self.path.stat().st_size < capacity:
                raise StorageError(f"NVMe tier file {self.path} is missing or shorter than {format_size(capacity)}")
            self._open(directory, capacity, backend, threads, io_chunk, direct, remove_on_error=False)
            return
        check_directory(directory, capacity)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise StorageError(f"NVMe tier file {self.path} already exists (another store, or one left "
                               "behind); remove it or give this store another name") from None
        try:
            try:
                os.posix_fallocate(fd, 0, capacity)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise StorageError(f"NVMe tier: no space for {format_size(capacity)} in {directory}; "
                                       "lower tiers.nvme.budget or free disk space") from None
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(fd, capacity)
                log.warning("NVMe tier: %s cannot preallocate; the file is sparse", directory)
        except BaseException:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        os.close(fd)
        self._open(directory, capacity, backend, threads, io_chunk, direct, remove_on_error=True)

    def _open(self, directory: Path, capacity: int, backend: str, threads: int, io_chunk: int, direct: bool,
              remove_on_error: bool) -> None:
        self.capacity = capacity
        self.allocator = ExtentAllocator(capacity, 4096)
        try:
            self.backend_name, why = choose_backend(backend, directory)
            if self.backend_name == "kvikio":
                self.backend = KvikioBackend(self.path, threads, io_chunk, direct)
            else:
                self.backend = PosixBackend(self.path, threads, io_chunk, direct)
        except BaseException:
            if remove_on_error:
                self.path.unlink(missing_ok=True)
            raise
        self.backend_reason = why if backend == "auto" else "configured"
        log.info("NVMe tier %s: %s backend (%s; %s)", self.path, self.backend_name, self.backend.reason,
                 self.backend_reason)

    def allocate(self, nbytes: int) -> Extent:
        return self.allocator.allocate(nbytes)

    def free(self, extent: Extent) -> None:
        self.allocator.free(extent)

    def discard(self, extents: list[Extent]) -> int:
        """Free ``extents`` for good: their bytes go back to the filesystem (holes punched in the file) where
        it can; returns the bytes given back."""
        back = 0
        fd = os.open(self.path, os.O_RDWR)
        try:
            for e in extents:
                self.allocator.free(e)
                if punch_hole(fd, e.offset, e.nbytes):
                    back += e.nbytes
        finally:
            os.close(fd)
        return back

    def pread(self, buf: torch.Tensor, extent: Extent) -> cf.Future:
        """Read the first ``buf.nbytes`` bytes of ``extent`` into ``buf``."""
        self._check(buf, extent)
        return self.backend.pread(buf, extent.offset)

    def pwrite(self, buf: torch.Tensor, extent: Extent) -> cf.Future:
        """Write ``buf`` at the start of ``extent``."""
        self._check(buf, extent)
        return self.backend.pwrite(buf, extent.offset)

    @property
    def direct_to_gpu(self) -> bool:
        return self.backend_name == "kvikio"

    def stats(self) -> dict:
        return {"path": str(self.path), "backend": self.backend_name, "backend_mode": self.backend.reason}

    @staticmethod
    def _check(buf: torch.Tensor, extent: Extent) -> None:
        if buf.numel() * buf.element_size() > extent.nbytes:
            raise ValueError(f"buffer of {buf.numel() * buf.element_size()} bytes overruns {extent}")

    def close(self, remove: bool = True) -> None:
        if self.backend is not None:
            self.backend.close()
            self.backend = None
            if remove:
                self.path.unlink(missing_ok=True)
