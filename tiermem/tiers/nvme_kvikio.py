"""kvikio backend of the NVMe tier: ``kvikio.CuFile`` (GPUDirect Storage, or kvikio's compat mode).

Reads and writes go straight to and from GPU memory when the buffer is on the GPU, and to host memory
otherwise. kvikio imports on machines without the NVIDIA driver but cannot do I/O there, so
``kvikio_usable`` tries a real write and read before the backend is chosen.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
from pathlib import Path

import numpy as np
import torch

from tiermem.errors import StorageError
from tiermem.futures import started


def kvikio_usable(directory: Path) -> tuple[bool, str]:
    """(True, mode) when kvikio is installed and can do I/O here, else (False, why not)."""
    try:
        import kvikio  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return False, f"kvikio is not installed ({type(e).__name__}); `pip install tiermem[gds]` adds it"
    probe = directory / f".kvikio-probe-{os.getpid()}"
    try:
        data = np.arange(4096, dtype=np.uint8)
        back = np.zeros_like(data)
        with kvikio.CuFile(probe, "w+") as f:
            f.pwrite(data, data.nbytes, 0).get()
            f.pread(back, back.nbytes, 0).get()
        if not np.array_equal(data, back):
            return False, "kvikio read back different bytes"
    except Exception as e:
        return False, f"kvikio cannot do I/O here ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    finally:
        probe.unlink(missing_ok=True)
    return True, _mode()


def _mode() -> str:
    import kvikio
    import kvikio.defaults

    try:
        compat = kvikio.defaults.is_compat_mode_preferred()
    except AttributeError:
        compat = bool(kvikio.defaults.get("compat_mode"))
    return "compat mode (POSIX inside kvikio, no GPUDirect)" if compat else "GPUDirect Storage"


def _configure(threads: int, direct: bool) -> None:
    """kvikio's thread pool size; in compat mode, O_DIRECT for aligned I/O (else reads hit the page cache)."""
    import kvikio
    import kvikio.defaults

    try:
        kvikio.defaults.set({"num_threads": threads})
        if direct:
            kvikio.defaults.set({"auto_direct_io_read": True, "auto_direct_io_write": True})
    except (AttributeError, TypeError, KeyError):  # older kvikio
        kvikio.defaults.num_threads_reset(threads)


class KvikioBackend:
    name = "kvikio"

    def __init__(self, path: Path, threads: int = 8, io_chunk: int = 16 << 20, direct: bool = True):
        import kvikio

        _configure(threads, direct)
        self.path = path
        self.io_chunk = io_chunk
        self._file = kvikio.CuFile(path, "r+")
        self._waiters = started(cf.ThreadPoolExecutor(max_workers=8, thread_name_prefix="tiermem-kvikio"), 8)
        self.reason = _mode()
        self.direct = direct

    @staticmethod
    def _array(buf: torch.Tensor):
        if not buf.is_contiguous():
            raise ValueError("kvikio NVMe backend takes contiguous buffers")
        flat = buf.reshape(-1).view(torch.uint8)
        return flat if flat.is_cuda else flat.numpy()

    def _wait(self, fut, what: str, offset: int) -> int:
        try:
            return fut.get()
        except Exception as e:
            raise StorageError(f"NVMe tier (kvikio): {what} {self.path} at offset {offset} failed: {e}") from None

    def pread(self, buf: torch.Tensor, file_offset: int) -> cf.Future:
        arr = self._array(buf)
        fut = self._file.pread(arr, buf.numel() * buf.element_size(), file_offset, self.io_chunk)
        return self._waiters.submit(self._wait, fut, "read from", file_offset)

    def pwrite(self, buf: torch.Tensor, file_offset: int) -> cf.Future:
        arr = self._array(buf)
        fut = self._file.pwrite(arr, buf.numel() * buf.element_size(), file_offset, self.io_chunk)
        return self._waiters.submit(self._wait, fut, "write to", file_offset)

    def close(self) -> None:
        self._waiters.shutdown(wait=True)
        self._file.close()
