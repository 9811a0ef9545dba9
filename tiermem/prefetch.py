"""The prefetcher: fetches groups to the GPU in the order the trainer will use them, as early as the
GPU slots and the groups' versions allow.

The trainer declares its schedule ahead (``request(group, kind, version)`` for every group of a step,
in order); one worker thread serves the requests in that order: it waits until the group's version is
reached (the optimizer has updated it), then fetches it into a slot (blocking while all slots are
taken, i.e. while it is as far ahead as GPU memory allows). The trainer takes each view with
``take`` when it needs it, which also accounts where its wait went: on the optimizer (the version was
not yet reached) or on the transfer.
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
import time
from dataclasses import dataclass, field

from tiermem.catalog import Group
from tiermem.futures import forward


@dataclass
class Request:
    group: Group
    kind: str
    version: int
    future: cf.Future = field(default_factory=cf.Future)
    version_at: float | None = None  # when the version was reached (perf_counter)


class Prefetcher:
    def __init__(self, store, health=None):
        self.store = store
        self._health = health  # raises when the producer of versions (the optimizer) has failed
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="tiermem-prefetch", daemon=True)
        self._thread.start()

    def request(self, group: Group, kind: str = "param", version: int = 0) -> Request:
        req = Request(group, kind, version)
        self._queue.put(req)
        return req

    def _run(self) -> None:
        while True:
            req = self._queue.get()
            if req is None:
                return
            try:
                self._wait_version(req.group, req.version)
                req.version_at = time.perf_counter()
                forward(self.store.fetch(req.group, req.kind), req.future)
            except BaseException as e:  # noqa: BLE001 - surfaced to whoever takes the request
                req.version_at = req.version_at or time.perf_counter()
                req.future.set_exception(e)

    def _wait_version(self, group: Group, version: int) -> None:
        while True:
            try:
                self.store.catalog.wait_version(group, version, timeout=0.5)
                return
            except TimeoutError:
                if self._health is not None:
                    self._health()

    @staticmethod
    def take(req: Request, before_wait=None) -> tuple[object, float, float]:
        """The request's view, and the seconds waited for (the optimizer, the transfer).

        ``before_wait`` runs only when the view is not ready yet (the trainer drains its GPU queue
        there, so that the time measured is time the GPU stood idle).
        """
        if req.future.done():
            return req.future.result(), 0.0, 0.0
        if before_wait is not None:
            before_wait()
        t0 = time.perf_counter()
        view = req.future.result()
        t1 = time.perf_counter()
        on_opt = min(max((req.version_at or t1) - t0, 0.0), t1 - t0)
        return view, on_opt, (t1 - t0) - on_opt

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)
