"""POSIX backend of the NVMe tier: ``os.preadv``/``os.pwritev`` on a thread pool, O_DIRECT where allowed.

Runs anywhere. Large requests are split into ``io_chunk`` pieces so several are in flight at once.
A piece whose buffer address, file offset and length are all 4 KiB-aligned goes through the O_DIRECT
descriptor (no page cache); others, and every piece on filesystems that refuse O_DIRECT (tmpfs), go
through a buffered descriptor. Host buffers only: the mover stages GPU data through the DRAM arena.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import logging
import os
from pathlib import Path

import torch

from tiermem.errors import StorageError
from tiermem.futures import all_of, started

log = logging.getLogger(__name__)
ALIGN = 4096


def open_direct(path: Path) -> int | None:
    """An O_DIRECT read-write descriptor, or None where the filesystem refuses O_DIRECT."""
    try:
        return os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise


class PosixBackend:
    name = "posix"

    def __init__(self, path: Path, threads: int = 8, io_chunk: int = 16 << 20, direct: bool = True):
        self.path = path
        self.io_chunk = max(ALIGN, io_chunk - io_chunk % ALIGN)
        self._fd = os.open(path, os.O_RDWR)
        self._dfd = open_direct(path) if direct else None
        self.direct = self._dfd is not None
        if direct and not self.direct:
            log.warning("NVMe tier: %s does not allow O_DIRECT; using buffered I/O", path.parent)
        self._pool = started(cf.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tiermem-nvme"), threads)
        self.reason = "O_DIRECT" if self.direct else "buffered I/O (no O_DIRECT on this filesystem)"

    def _fd_for(self, addr: int, offset: int, length: int) -> int:
        if self._dfd is not None and addr % ALIGN == 0 and offset % ALIGN == 0 and length % ALIGN == 0:
            return self._dfd
        return self._fd

    def _io(self, write: bool, mv: memoryview, addr: int, offset: int) -> int:
        fd = self._fd_for(addr, offset, len(mv))
        done = 0
        while done < len(mv):
            try:
                n = (os.pwritev if write else os.preadv)(fd, [mv[done:]], offset + done)
            except OSError as e:
                what = "write to" if write else "read from"
                hint = "; the NVMe tier's disk is full" if e.errno == errno.ENOSPC else ""
                raise StorageError(f"NVMe tier: {what} {self.path} at offset {offset + done} failed: "
                                   f"{os.strerror(e.errno)}{hint}") from None
            if n == 0:
                raise StorageError(f"NVMe tier: short {'write' if write else 'read'} at offset {offset + done} "
                                   f"of {self.path} (file truncated?)")
            done += n
        return done

    def _submit(self, write: bool, buf: torch.Tensor, file_offset: int) -> cf.Future:
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError("posix NVMe backend takes contiguous host buffers")
        flat = buf.reshape(-1).view(torch.uint8)
        mv = memoryview(flat.numpy())
        base = flat.data_ptr()
        futures = [self._pool.submit(self._io, write, mv[o: o + self.io_chunk], base + o, file_offset + o)
                   for o in range(0, len(mv), self.io_chunk)]
        return all_of(futures, len(mv))

    def pread(self, buf: torch.Tensor, file_offset: int) -> cf.Future:
        return self._submit(False, buf, file_offset)

    def pwrite(self, buf: torch.Tensor, file_offset: int) -> cf.Future:
        return self._submit(True, buf, file_offset)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for fd in (self._fd, self._dfd):
            if fd is not None:
                os.close(fd)
