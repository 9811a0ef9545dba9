"""Checksums of large in-memory buffers taken on several threads at once: the service's undo copy.

The undo copy (16 B a parameter, copied before each in-place update) is checked before it is ever put back.
One thread's CRC32C takes it at ~6-9 GB/s, slower than the update it guards (~19 GB/s of state a second on
the GPU machine's 16 cores). The ``crc32c`` package (hardware CRC32C, ~8 GB/s a thread here) releases the GIL,
so the buffer is cut into fixed pieces whose CRC32Cs are taken on a pool of threads; the list of the pieces'
CRCs is the checksum (no combining: a restore recomputes the same pieces). zlib's CRC-32 also releases the
GIL but runs at ~2 GB/s a thread. (Copying and checksumming each megabyte in one pass on these threads was
tried: slower on the GPU machine than torch's copy and then the pieces' CRCs, 0.64 of the copy alone against
0.75.)
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import crc32c
import numpy as np

PIECE = 32 << 20  # bytes a piece: small enough to spread a group over the pool, large enough to amortize a call
_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def _threads() -> int:
    return max(1, min(16, os.cpu_count() or 1))


def pool() -> ThreadPoolExecutor:
    """The process's checksum threads (created on first use)."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_threads(), thread_name_prefix="tiermem-crc")
        return _pool


def piece_crcs(data, piece: int = PIECE) -> list[str]:
    """The CRC32C of each ``piece`` bytes of a contiguous buffer's bytes, in order, as 8 hex digits
    each, taken on the checksum threads."""
    b = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if b.size <= piece:  # (one piece, or none: the CRC32C of no bytes)
        return [f"{crc32c.crc32c(b):08x}"]
    futs = [pool().submit(crc32c.crc32c, b[i: i + piece]) for i in range(0, b.size, piece)]
    return [f"{f.result():08x}" for f in futs]
