"""Per-link accounting: bytes moved, busy time, achieved GB/s (now and average), queue depth.

Busy time is the union of the intervals in which at least one transfer was in flight on the link, so
overlapping requests are not double counted.
"""

from __future__ import annotations

import threading
import time
from collections import deque

WINDOW = 1.0  # seconds over which "GB/s now" is taken


class LinkStats:
    def __init__(self, name: str):
        self.name = name
        self.bytes = 0
        self.ops = 0
        self.busy_seconds = 0.0
        self.active = 0
        self._since = 0.0
        self._recent: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def start(self) -> float:
        now = time.perf_counter()
        with self._lock:
            if self.active == 0:
                self._since = now
            self.active += 1
        return now

    def finish(self, nbytes: int) -> None:
        now = time.perf_counter()
        with self._lock:
            self.active -= 1
            self.bytes += nbytes
            self.ops += 1
            self._recent.append((now, nbytes))
            if self.active == 0:
                self.busy_seconds += now - self._since

    def add_busy(self, seconds: float, nbytes: int) -> None:
        """Account one transfer whose busy interval was measured elsewhere (a CUDA stream)."""
        now = time.perf_counter()
        with self._lock:
            self.bytes += nbytes
            self.ops += 1
            self.busy_seconds += seconds
            self._recent.append((now, nbytes))

    def snapshot(self) -> dict:
        now = time.perf_counter()
        with self._lock:
            while self._recent and self._recent[0][0] < now - WINDOW:
                self._recent.popleft()
            recent = sum(n for _, n in self._recent)
            busy = self.busy_seconds + (now - self._since if self.active else 0.0)
            return {
                "bytes": self.bytes,
                "ops": self.ops,
                "busy_s": round(busy, 6),
                "gbps_avg": round(self.bytes / busy / 1e9, 3) if busy > 0 else 0.0,
                "gbps_now": round(recent / WINDOW / 1e9, 3),
                "queue": self.active,
            }
