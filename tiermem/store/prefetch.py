"""The prefetcher: fetches groups to the GPU in the order the trainer will use them, as early as the
GPU slots and the groups' versions allow.

The trainer declares its schedule ahead (``request(group, kind, version)`` for every group of a step,
in order); one worker thread serves the requests: the first one as soon as the group's version is
reached (the optimizer has updated it), fetching it into a slot (blocking while all slots are taken,
i.e. while it is as far ahead as GPU memory allows). While the first request waits for its version,
later requests whose versions are already reached are started out of order, as long as a slot stays
free for the first one: a group the optimizer finished early then crosses PCIe while the GPU waits for
an earlier one. The trainer takes each view with ``take`` when it needs it, which also accounts where
its wait went: on the optimizer (the version was not yet reached) or on the transfer.
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from tiermem.futures import forward
from tiermem.specs import Group

LOOKAHEAD = 4  # requests past the first one that may start out of order


@dataclass
class Request:
    group: Group
    kind: str
    version: int
    future: cf.Future = field(default_factory=cf.Future)
    version_at: float | None = None  # when the version was seen reached (perf_counter)


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

    # -- the worker ------------------------------------------------------------------------------
    def _ready(self, req: Request) -> bool:
        cat = self.store.catalog
        have = cat.params_version(req.group) if req.kind == "param" else cat.version(req.group)
        return have >= req.version

    def _resident(self, req: Request) -> bool:
        hbm = self.store.tiers.device_name
        return all(e.tier == hbm for e in self.store.catalog.group_entries(req.group, req.kind))

    def _start(self, req: Request) -> None:
        req.version_at = req.version_at or time.perf_counter()
        try:
            forward(self.store.fetch(req.group, req.kind), req.future)
        except BaseException as e:  # noqa: BLE001 - surfaced to whoever takes the request
            req.future.set_exception(e)

    def _run(self) -> None:
        pending: deque[Request] = deque()
        closing = False
        cat = self.store.catalog
        while True:
            if not pending:
                if closing:
                    return
                item = self._queue.get()
                if item is None:
                    return
                pending.append(item)
            while True:  # take in what has been requested since
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    closing = True
                else:
                    pending.append(item)
            if closing:  # the trainer is done (or gave up): what it did not take is not needed
                for req in pending:
                    req.future.cancel()
                return
            head = pending[0]
            seen = cat.bump_count()
            if self._ready(head):
                pending.popleft()
                self._start(head)
                continue
            blocked = {head.group}
            for req in list(pending)[1: LOOKAHEAD + 1]:
                if req.group in blocked:
                    continue
                if self._ready(req) and (self._resident(req) or self.store.tiers.device.slots_free() > 1):
                    pending.remove(req)
                    self._start(req)
                else:
                    blocked.add(req.group)  # keep each group's requests in order
            cat.wait_any_bump(seen, timeout=0.5)
            if not self._ready(head) and self._health is not None:
                try:
                    self._health()
                except BaseException as e:  # noqa: BLE001 - the optimizer failed: fail what waits on it
                    for req in pending:
                        req.future.set_exception(e)
                    pending.clear()

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
