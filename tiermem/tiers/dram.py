"""The DRAM tier: one shared-memory arena, mapped once, carved into 4 KiB-aligned extents.

The arena is a file (``<dir>/<name>.arena``, /dev/shm by default) so that another process can map the
same bytes by name (the service and its trainers do). Its first 4 KiB page is a header that records its run's
identity: the owner's pid and that process's start time (so an arena left behind by a dead process is detectable,
a reused pid included: ``list_arenas``), its size and creation time, and who made it (``owner``: a service's
state directory, where its run record lives, its config and socket), so that ``tiermem arenas`` can tell a run a
service can recover from without any other file. With a GPU
present the whole mapping is registered with CUDA as pinned memory by one ``cudaHostRegister`` call;
tensors handed out are zero-copy views into it.

Registration pins every page, and most of its cost is faulting 4 KiB pages into the page tables one
by one; so before registering, the arena's pages are touched by many threads at once (measured on the
H200 machine: 64 GiB in 17.6-22.6 s this way, against 40 s for fallocate + register). ``directory:
anonymous`` makes a private arena of transparent huge pages instead (no file, nothing to share or
leave behind; 64 GiB in 2.8-3.4 s there), for a single process that needs no sharing.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import mmap
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import psutil
import torch

from tiermem.errors import ConfigError, StorageError
from tiermem.schema import setting
from tiermem.sizes import align_up, format_size, size_or_auto
from tiermem.tiers.arena_files import (  # noqa: F401 (MAGIC, SUFFIX, ArenaInfo, ...: re-exported)
    HEADER,
    MAGIC,
    SUFFIX,
    ArenaInfo,
    _header,
    _read_header,
    header_problem,
    list_arenas,
    owner_alive,
)
from tiermem.tiers.base import HOST, Making
from tiermem.tiers.extents import Extent, ExtentAllocator

log = logging.getLogger(__name__)
ANONYMOUS = "anonymous"
TOUCH_STEP = 256 << 20


@dataclass
class DramTierConfig:
    """The shared-memory arena; registered with CUDA as pinned memory when a GPU is present."""

    budget: int | None = setting(None, convert=size_or_auto, yaml_type="size | auto", help=(
        "hard limit for the arena; one larger than the arena's filesystem (or, anonymous, than the machine's "
        "memory) is refused at start. Unset: 90% of the host's free memory as the cgroup sees it (where a limit "
        "is set) and of what the arena's directory has free"), shown="90% of what /dev/shm and RAM have free")
    path: str = setting("/dev/shm", help=(
        "directory of the arena file <name>.arena (shareable by name), or anonymous: private huge-page memory, "
        "for one process. A training run's own store defaults to anonymous, to /dev/shm with several ranks "
        "(they share it); a tmpfs mounted huge=always pins about 6 times faster than /dev/shm"))
    pin: Literal["auto", "true", "false"] = setting("auto", help=(
        "register the arena with CUDA (auto: when the store computes on a GPU)"))
    preallocate: bool = setting(False, help=(
        "fallocate the arena first, so a /dev/shm that another process fills meanwhile fails at start (about "
        "0.2 s/GiB more)"))


def check_budget(budget: int | None, directory: str | Path) -> None:
    """Refuse (one line) a DRAM budget the arena can never have: more than the size of the filesystem of
    ``directory`` (a tmpfs such as /dev/shm), or, for an anonymous arena, more than the machine's memory."""
    if budget is None:
        return
    if str(directory) == ANONYMOUS:
        total, where = psutil.virtual_memory().total, "this machine's memory"
    elif os.path.isdir(directory):
        st = os.statvfs(directory)
        total, where = st.f_blocks * st.f_frsize, f"the filesystem of {directory}"
    else:
        return  # (creating the arena says the directory is missing)
    if budget > total:
        raise ConfigError(f"tiers.dram.budget {format_size(budget)} is larger than {where} ({format_size(total)}); "
                          "lower tiers.dram.budget" + ("" if str(directory) == ANONYMOUS else
                                                       " or point tiers.dram.path at a larger tmpfs"))


def cuda_register(ptr: int, nbytes: int, path: Path | None = None) -> None:
    """Pin an existing host mapping with one cudaHostRegister call."""
    rc = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(rc) != 0:
        if path is not None and on_disk(path.parent):
            raise StorageError(f"cannot pin the DRAM arena {path} for the GPU: it is a file on a disk filesystem; set "
                               "tiers.dram.path to a tmpfs such as /dev/shm")
        raise RuntimeError(f"cudaHostRegister of {format_size(nbytes)} failed with CUDA error {int(rc)}")


def cuda_unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _mount_of(directory: Path) -> tuple[str, str]:
    """(filesystem type, mount options) of the mount holding ``directory``; ("", "") when unknown."""
    best, found = "", ("", "")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mnt, fstype, options = line.split()[:4]
                if directory.resolve().is_relative_to(mnt) and len(mnt) > len(best):
                    best, found = mnt, (fstype, options)
    except OSError:
        pass
    return found


def on_disk(directory: Path) -> bool:
    """Whether ``directory`` is on a disk filesystem (known, and not memory-backed): CUDA cannot pin a file
    mapping there."""
    return _mount_of(Path(directory))[0] not in ("tmpfs", "ramfs", "hugetlbfs", "")


def huge_pages(directory: Path) -> bool:
    """Whether the tmpfs holding ``directory`` hands out transparent huge pages (mounted huge=always)."""
    fstype, opts = _mount_of(directory)
    return fstype == "tmpfs" and ("huge=always" in opts or "huge=within_size" in opts)


def _touch_parallel(base: torch.Tensor) -> None:
    """Fault every page in, from many threads at once (one torch thread each), so registration only has
    to pin them. (MADV_POPULATE_WRITE from the same threads was no faster on the H200 machine.)"""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with cf.ThreadPoolExecutor(max(os.cpu_count() or 1, 1)) as ex:
            list(ex.map(lambda o: base[o: o + TOUCH_STEP].zero_(), range(0, base.numel(), TOUCH_STEP)))
    finally:
        torch.set_num_threads(prev)


class DramArena:
    """A shared-memory arena with an extent allocator. Create with ``create``, map another's with ``attach``.
    The host tier (``tiermem.tiers.base``): configured under ``tiers.dram``, always there."""

    role = HOST
    optional = False
    Config = DramTierConfig

    @classmethod
    def make(cls, section: DramTierConfig, capacity: int, at: Making) -> DramArena:
        return cls.create(at.store_name, max(capacity, 4096), section.path, pin=at.pin,
                          preallocate=section.preallocate, owner=at.owner)

    @classmethod
    def default_budget(cls, section: DramTierConfig, device: torch.device, host_memory) -> int:
        """90% of the host's memory (``host_memory()``) or of what the arena's directory has free, the less."""
        mem = host_memory()
        if section.path == ANONYMOUS:
            shm = mem
        else:
            shm = shutil.disk_usage(section.path).free if os.path.isdir(section.path) else 0
        return int(min(shm, mem) * 0.9)

    @classmethod
    def check_section(cls, section: DramTierConfig, where: str) -> None:
        pass

    # -- shared with other processes (a service's trainer, the ranks of a host) ----------------------------
    def describe(self, section: DramTierConfig, chosen: bool = False) -> dict:
        """What another process needs to map this arena (``map_shared``)."""
        return {"name": self.name, "dir": str(section.path)}

    @classmethod
    def map_shared(cls, desc: dict, store_name: str, device: torch.device) -> DramArena:
        """Another process's arena (``describe``) mapped here, pinned when ``device`` is CUDA; its allocator
        spans the whole arena, for rebuilding a recorded layout."""
        arena = cls.attach(desc["name"], desc["dir"], pin=device.type == "cuda")
        arena.allocator = ExtentAllocator(arena.size - HEADER, 4096, base=HEADER)
        return arena

    @classmethod
    def reopen_left(cls, section: DramTierConfig, store_name: str, capacity: int, device: torch.device,
                    owner: dict | None = None) -> DramArena:
        """The arena a stopped or killed owner left behind, taken over (``reopen``; its header then names this
        process, and ``owner``)."""
        return cls.reopen(store_name, section.path, pin=device.type == "cuda", owner=owner)

    def __init__(self, path: Path | None, name: str, size: int, mm: mmap.mmap, owner: bool, pin: bool,
                 touch: bool = True):
        self.path, self.name, self.size, self.owner = path, name, size, owner
        self._mm = mm
        self._base = torch.frombuffer(mm, dtype=torch.uint8)
        self.allocator = ExtentAllocator(size - HEADER, 4096, base=HEADER) if owner else None
        self.region: Extent | None = None  # (an attached mapping) the part of the arena it may allocate in
        self.register_seconds = 0.0
        self.pinned = False
        self.touch_seconds = 0.0
        if pin:
            t0 = time.perf_counter()
            if owner and touch:  # a new arena's pages (zeroing them); a reopened one keeps its bytes
                _touch_parallel(self._base[HEADER:] if path is not None else self._base)
            self.touch_seconds = time.perf_counter() - t0
            cuda_register(self._base.data_ptr(), size, path)
            self.register_seconds = time.perf_counter() - t0 - self.touch_seconds
            self.pinned = True

    @classmethod
    def create(cls, name: str, capacity: int, directory: str | Path = "/dev/shm", pin: bool = False,
               preallocate: bool = False, owner: dict | None = None) -> DramArena:
        """Make a new arena of ``capacity`` usable bytes, its header naming this process and ``owner`` (who made it:
        a service's state directory, config and socket); fails with one line if it cannot."""
        if str(directory) == ANONYMOUS:
            return cls._anonymous(name, capacity, pin)
        directory = Path(directory)
        if not directory.is_dir():
            raise StorageError(f"DRAM arena directory {directory} does not exist; set tiers.dram.path "
                               "to an existing directory (a tmpfs such as /dev/shm)")
        size = HEADER + align_up(capacity, 4096)
        path = directory / f"{name}{SUFFIX}"
        st = os.statvfs(directory)
        free = st.f_bavail * st.f_frsize
        if size > free:
            raise StorageError(f"DRAM arena needs {format_size(size)} but {directory} has {format_size(free)} free; "
                               "lower tiers.dram.budget, move state to nvme, or free shared memory")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            info = next((a for a in list_arenas(directory) if a.path == path), None)
            who = (f"owned by running pid {info.pid}" if info and info.alive
                   else f"left behind by pid {info.pid}, which is gone; remove it with `tiermem arenas --clean`"
                   if info else "not a tiermem arena")
            raise StorageError(f"arena {path} already exists ({who})") from None
        except PermissionError:
            raise StorageError(f"cannot create the DRAM arena in {directory}: permission denied") from None
        try:
            os.ftruncate(fd, size)
            if preallocate:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    if e.errno == 28:  # ENOSPC
                        raise StorageError(f"DRAM arena of {format_size(size)} does not fit in {directory}; "
                                           "lower tiers.dram.budget or free shared memory") from None
                    if e.errno not in (95, 22):  # EOPNOTSUPP/EINVAL: filesystem cannot preallocate
                        raise
            os.pwrite(fd, _header(name, size, time.time(), owner), 0)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        if pin and size > (8 << 30) and not huge_pages(directory):
            log.info("pinning a %s arena of 4 KiB pages in %s takes ~0.3 s/GiB; a tmpfs mounted with "
                     "huge=always (or tiers.dram.path: anonymous) sets up ~6x faster", format_size(size), directory)
        try:
            return cls(path, name, size, mm, owner=True, pin=pin)
        except BaseException:
            mm.close()
            path.unlink(missing_ok=True)
            raise

    @classmethod
    def _anonymous(cls, name: str, capacity: int, pin: bool) -> DramArena:
        size = HEADER + align_up(capacity, 4096)
        avail = psutil.virtual_memory().available
        if size > avail:
            raise StorageError(f"DRAM arena needs {format_size(size)} but only {format_size(avail)} of RAM is "
                               "available; lower tiers.dram.budget or move state to nvme")
        mm = mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            mm.madvise(mmap.MADV_HUGEPAGE)
        return cls(None, name, size, mm, owner=True, pin=pin)

    @classmethod
    def attach(cls, name: str, directory: str | Path = "/dev/shm", pin: bool = False) -> DramArena:
        """Map an arena another process created (not the owner: closing does not remove it)."""
        if str(directory) == ANONYMOUS:
            raise StorageError("an anonymous arena cannot be shared; set tiers.dram.path to a tmpfs directory")
        path = Path(directory) / f"{name}{SUFFIX}"
        if not path.exists():
            raise StorageError(f"no arena named {name} in {directory}")
        size = _read_header(path)["size"]
        fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(path, name, size, mm, owner=False, pin=pin)

    @classmethod
    def reopen(cls, name: str, directory: str | Path, pin: bool = False, owner: dict | None = None) -> DramArena:
        """Take ownership of an arena file a previous owner (a killed or stopped service) left behind: its
        bytes are kept, its header names this process (and ``owner``, or the previous one's); the caller rebuilds
        the allocator's extents."""
        path = Path(directory) / f"{name}{SUFFIX}"
        if not path.is_file():
            raise StorageError(f"no arena named {name} in {directory}")
        h = _read_header(path)
        if h["pid"] != os.getpid() and owner_alive(h):  # (a header without the start time: alive, unless the pid
            try:  # was reused by a process that is not tiermem's)
                alive = "pid_start" in h or "tiermem" in " ".join(psutil.Process(h["pid"]).cmdline())
            except psutil.Error:
                alive = False
            if alive:
                raise StorageError(f"arena {path} is owned by running pid {h['pid']}")
        fd = os.open(path, os.O_RDWR)
        try:
            os.pwrite(fd, _header(name, h["size"], h["created"], owner if owner is not None else h.get("owner")), 0)
            mm = mmap.mmap(fd, h["size"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(path, name, h["size"], mm, owner=True, pin=pin, touch=False)

    @property
    def capacity(self) -> int:
        return self.size - HEADER

    def allocate(self, nbytes: int) -> Extent:
        if not self.owner and self.region is None:  # its free space is the owner's: a place taken here may hold
            raise RuntimeError(f"arena {self.name} is mapped from another process, which alone allocates in it")
        return self.allocator.allocate(nbytes)

    def use_region(self, extent: Extent) -> None:
        """An attached mapping allocates from now on only inside ``extent``, a part of the arena its owner
        allocated for this process alone (a data-parallel rank stages NVMe-resident state there)."""
        self.region = extent
        self.allocator = ExtentAllocator(extent.nbytes, 4096, base=extent.offset)

    def free(self, extent: Extent) -> None:
        self.allocator.free(extent)

    def view(self, extent: Extent, nbytes: int | None = None) -> torch.Tensor:
        """A uint8 tensor over the extent's bytes (the first ``nbytes`` of them), sharing the arena's memory."""
        n = extent.nbytes if nbytes is None else nbytes
        return self._base[extent.offset: extent.offset + n]

    def address(self, extent: Extent) -> int:
        return self._base.data_ptr() + extent.offset

    def stats(self) -> dict:
        return {"path": str(self.path or ANONYMOUS), "pinned": self.pinned}

    def close(self, remove: bool = True) -> None:
        """Unpin, unmap, and (for the owner, unless ``remove`` is False) remove the arena file."""
        if self._base is None:
            return
        if self.pinned:
            cuda_unregister(self._base.data_ptr())
            self.pinned = False
        self._base = None
        try:
            self._mm.close()
        except BufferError:
            pass  # views still alive: the mapping goes when the last one does
        if self.owner and remove and self.path is not None:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> DramArena:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
