"""An allocator of aligned extents in a linear address space [0, capacity).

Best fit over a sorted free list (the smallest free run that holds the request, the lowest of equals);
freeing coalesces with both neighbours, so freed space is reused. Best fit matters for the out-of-place
updates: each frees its old places as it takes new ones of the same sizes, and best fit hands those
exact holes to the next group of the same shape instead of carving the large free runs the embedding and
LM head need (first fit fragmented a 3 B model's spare room so that the embedding found no room every
step). Used by the DRAM arena, the NVMe files and the GPU tier.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

from tiermem.sizes import align_up


@dataclass(frozen=True)
class Extent:
    offset: int
    nbytes: int  # the rounded-up length actually reserved

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


class OutOfSpace(Exception):
    """No free extent is large enough."""


class ExtentAllocator:
    """Thread-safe best-fit allocator; every extent's offset and length are multiples of ``alignment``."""

    def __init__(self, capacity: int, alignment: int = 4096, base: int = 0):
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError("alignment must be a power of two")
        self.alignment = alignment
        self.base = base
        self.capacity = capacity - capacity % alignment
        self._starts: list[int] = [base] if self.capacity else []
        self._lengths: dict[int, int] = {base: self.capacity} if self.capacity else {}
        self._live: dict[int, int] = {}
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> Extent:
        size = max(align_up(nbytes, self.alignment), self.alignment)
        with self._lock:
            best = None
            for start in self._starts:
                length = self._lengths[start]
                if length >= size and (best is None or length < self._lengths[best]):
                    best = start
                    if length == size:
                        break
            if best is not None:
                length = self._lengths.pop(best)
                idx = bisect.bisect_left(self._starts, best)
                del self._starts[idx]
                if length > size:
                    rest = best + size
                    self._starts.insert(idx, rest)
                    self._lengths[rest] = length - size
                self._live[best] = size
                return Extent(best, size)
        raise OutOfSpace(f"no free extent of {size} bytes (free {self.free_bytes()}, largest {self.largest_free()})")

    def reserve(self, extent: Extent) -> None:
        """Mark ``extent`` (aligned, inside free space) as allocated: rebuilding the allocator of a reopened
        arena or file from a recorded layout."""
        with self._lock:
            idx = bisect.bisect_right(self._starts, extent.offset) - 1
            if idx < 0 or extent.offset % self.alignment or extent.nbytes % self.alignment:
                raise ValueError(f"cannot reserve {extent}: misaligned or before the start")
            start = self._starts[idx]
            length = self._lengths[start]
            if extent.end > start + length:
                raise ValueError(f"cannot reserve {extent}: not inside free space")
            del self._starts[idx]
            del self._lengths[start]
            pieces = [(start, extent.offset - start), (extent.end, start + length - extent.end)]
            for s, n in reversed(pieces):
                if n > 0:
                    self._starts.insert(idx, s)
                    self._lengths[s] = n
            self._live[extent.offset] = extent.nbytes

    def free(self, extent: Extent) -> None:
        with self._lock:
            if self._live.get(extent.offset) != extent.nbytes:
                raise ValueError(f"free of an extent that is not live: {extent}")
            del self._live[extent.offset]
            start, length = extent.offset, extent.nbytes
            idx = bisect.bisect_left(self._starts, start)
            if idx < len(self._starts) and self._starts[idx] == start + length:  # merge right
                nxt = self._starts.pop(idx)
                length += self._lengths.pop(nxt)
            if idx > 0:  # merge left
                prev = self._starts[idx - 1]
                if prev + self._lengths[prev] == start:
                    self._lengths[prev] += length
                    return
            self._starts.insert(idx, start)
            self._lengths[start] = length

    def used_bytes(self) -> int:
        return sum(self._live.values())

    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes()

    def largest_free(self) -> int:
        return max(self._lengths.values(), default=0)

    def fragmentation(self) -> float:
        """0 when the free space is one run, towards 1 when it is scattered in small pieces."""
        free = self.free_bytes()
        return 0.0 if free == 0 else 1.0 - self.largest_free() / free

    def live_extents(self) -> list[Extent]:
        with self._lock:
            return [Extent(o, n) for o, n in sorted(self._live.items())]

    def free_extents(self) -> list[Extent]:
        with self._lock:
            return [Extent(s, self._lengths[s]) for s in self._starts]
