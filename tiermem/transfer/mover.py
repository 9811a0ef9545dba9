"""The mover: asynchronous transfers between any two tiers, with per-link accounting.

A transfer goes from one ``Location`` (tier, extent, bytes) to another and returns a future that
completes when the bytes have arrived. The tiers it is given decide the way by their roles
(``tiermem.tiers.base``): copies between host memory and the device run on one CUDA stream per direction
and are completed in order by a watcher thread that waits on their events (without CUDA the same copies run
on one worker thread per direction); a storage tier reads into memory and writes from it itself; storage <->
device goes straight when the tier can (kvikio), else through a temporary extent of the host tier. Each
link (``a->b``) is accounted on its own.
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
import time
from dataclasses import dataclass

import torch

from tiermem.errors import BudgetError
from tiermem.futures import forward, started, then
from tiermem.tiers import registry
from tiermem.tiers.base import DEVICE, HOST, STORAGE, host_sync
from tiermem.tiers.extents import Extent, OutOfSpace
from tiermem.transfer.links import LinkStats


@dataclass(frozen=True)
class Location:
    tier: str
    extent: Extent
    nbytes: int


class _StreamLane:
    """One direction of GPU copies: a CUDA stream plus a thread that completes futures in order.

    Without CUDA it is a single worker thread that does the copy itself.
    """

    def __init__(self, name: str, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._queue: queue.Queue = queue.Queue()
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"tiermem-{name}", daemon=True)
        self._thread.start()

    def submit(self, dst: torch.Tensor, src: torch.Tensor, link: LinkStats, wait_event=None) -> cf.Future:
        fut: cf.Future = cf.Future()
        nbytes = src.numel() * src.element_size()
        if not self.cuda:
            self._queue.put((None, fut, nbytes, dst, src, time.perf_counter(), link))
            return fut
        with self._lock:  # enqueue order = completion order
            with torch.cuda.stream(self.stream):
                if wait_event is not None:
                    self.stream.wait_event(wait_event)
                dst.copy_(src, non_blocking=True)
                ev = torch.cuda.Event(blocking=True)  # waiters sleep: spinning threads starve CPU AdamW
                ev.record(self.stream)
            self._queue.put((ev, fut, nbytes, dst, src, time.perf_counter(), link))
        return fut

    def _run(self) -> None:
        last_end = 0.0
        while True:
            item = self._queue.get()
            if item is None:
                return
            ev, fut, nbytes, dst, src, t_submit, link = item
            try:
                if ev is None:
                    dst.copy_(src)
                else:
                    ev.synchronize()
            except BaseException as e:  # noqa: BLE001
                fut.set_exception(e)
                continue
            end = time.perf_counter()
            # a lane runs its copies back to back: this one was busy from when it could start
            link.add_busy(end - max(t_submit, last_end), nbytes)
            last_end = end
            fut.set_result(nbytes)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


class Mover:
    def __init__(self, tiers: dict):
        """Copies between ``tiers`` (name -> tier). Its links are every registered tier's (``registry.links``),
        and any other pair's as it is first used."""
        self.tiers = dict(tiers)
        self._roles = {n: t.role for n, t in self.tiers.items() if t is not None}
        self.device_name = next((n for n, r in self._roles.items() if r == DEVICE), None)
        self.host_name = next((n for n, r in self._roles.items() if r == HOST), None)
        self.links = {name: LinkStats(name) for name in registry.links()}
        self._links_lock = threading.Lock()
        # the disks in either direction (the union of the storage links' busy time): what the cost model's disk
        # resource spends, which the run measures its disk's rate against (trainer.planning.plan_watch)
        self.disk = LinkStats("disk both ways")
        gpu = self.tiers.get(self.device_name)
        dev = gpu.device if gpu is not None else torch.device("cpu")
        self.cuda = dev.type == "cuda"
        self._h2d = _StreamLane("h2d", dev)
        self._d2h = _StreamLane("d2h", dev)
        # bulk lanes: long transfers (the optimizer's state) on their own streams, so a layer fetch the
        # GPU is waiting for never queues behind them (they share the link's bandwidth instead)
        self._h2d_bulk = _StreamLane("h2d-bulk", dev)
        self._d2h_bulk = _StreamLane("d2h-bulk", dev)
        self._local = started(cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="tiermem-copy"), 2)

    def link(self, name: str) -> LinkStats:
        """The accounting of link ``name`` (made on first use)."""
        link = self.links.get(name)
        if link is None:
            with self._links_lock:
                link = self.links.setdefault(name, LinkStats(name))
        return link

    # -- endpoints ---------------------------------------------------------------------------
    # An endpoint is a Location in a tier, or a plain tensor (on the GPU, or in host memory).
    def tier_of(self, ep) -> str:
        if isinstance(ep, Location):
            return ep.tier
        gpu = self.tiers.get(self.device_name)
        return self.device_name if ep.device.type == "cuda" or (gpu is not None and _same_buffer(ep, gpu)) \
            else self.host_name

    def view(self, ep) -> torch.Tensor:
        if not isinstance(ep, Location):
            return ep.reshape(-1).view(torch.uint8)
        if self._roles.get(ep.tier) in (DEVICE, HOST):
            return self.tiers[ep.tier].view(ep.extent, ep.nbytes)
        raise ValueError(f"{ep.tier} locations have no memory view")

    @staticmethod
    def nbytes(ep) -> int:
        return ep.nbytes if isinstance(ep, Location) else ep.numel() * ep.element_size()

    # -- transfers ------------------------------------------------------------------------------
    def copy(self, src, dst, wait_event=None, bulk: bool = False) -> cf.Future:
        """Move the bytes of ``src`` to ``dst`` (Locations or tensors of equal size).

        ``wait_event`` (a CUDA event) orders a copy after the compute that produced its source or last
        read its destination. ``bulk`` sends host <-> device copies through the bulk lanes.
        """
        n = self.nbytes(src)
        if n != self.nbytes(dst):
            raise ValueError(f"size mismatch: {n} -> {self.nbytes(dst)}")
        a, b = self.tier_of(src), self.tier_of(dst)
        key = f"{a}->{b}"
        way = (self._roles.get(a), self._roles.get(b))
        if way == (HOST, DEVICE):
            return (self._h2d_bulk if bulk else self._h2d).submit(self.view(dst), self.view(src),
                                                                  self.link(key + " bulk" if bulk else key), wait_event)
        if way == (DEVICE, HOST):
            return (self._d2h_bulk if bulk else self._d2h).submit(self.view(dst), self.view(src),
                                                                  self.link(key + " bulk" if bulk else key), wait_event)
        if way == (STORAGE, HOST):
            return self._io(self.link(key), self.tiers[a].pread, self.view(dst), src.extent)
        if way == (HOST, STORAGE):
            return self._io(self.link(key), self.tiers[b].pwrite, self.view(src), dst.extent)
        if way in ((STORAGE, DEVICE), (DEVICE, STORAGE)):
            disk = self.tiers[a if way[0] == STORAGE else b]
            if disk.direct_to_gpu:
                if wait_event is not None:
                    wait_event.synchronize()
                if way[0] == STORAGE:
                    return self._io(self.link(key), disk.pread, self.view(dst), src.extent)
                return self._io(self.link(key), disk.pwrite, self.view(src), dst.extent)
            return self._staged(src, dst, wait_event, bulk)
        if way in ((HOST, HOST), (DEVICE, DEVICE)):
            link = self.link(key)
            s, d = self.view(src), self.view(dst)

            def local() -> int:
                if wait_event is not None:
                    wait_event.synchronize()
                link.start()
                d.copy_(s)
                if d.is_cuda:
                    host_sync(torch.cuda.current_stream(d.device))
                link.finish(n)
                return n

            return self._local.submit(local)
        raise ValueError(f"no link {key}")

    def after(self, event) -> cf.Future:
        """A future that completes once the work before ``event`` (a CUDA event) has run."""
        return self._local.submit(event.synchronize)

    def _io(self, link: LinkStats, op, buf: torch.Tensor, extent: Extent) -> cf.Future:
        link.start()
        self.disk.start()
        fut = op(buf, extent)
        n = buf.numel()

        def account(f: cf.Future) -> None:
            link.finish(n if f.exception() is None else 0)
            self.disk.finish(n if f.exception() is None else 0)

        fut.add_done_callback(account)
        return fut

    def _staged(self, src, dst, wait_event=None, bulk: bool = False) -> cf.Future:
        """Storage <-> device through host memory (the posix backend): a temporary extent of the host tier when
        this process owns it; else (a trainer attached to the service's arena, whose free space is the
        service's) a pinned buffer of its own. ``bulk``: the PCIe leg goes through a bulk lane."""
        n = self.nbytes(src)
        host = self.tiers.get(self.host_name)
        owned = host is not None and host.owner
        if owned:
            try:
                tmp = Location(self.host_name, host.allocate(n), n)
            except OutOfSpace as e:
                disk = self.tiers[self.tier_of(src if self._roles.get(self.tier_of(src)) == STORAGE else dst)]
                raise BudgetError(f"no DRAM room to stage an {disk.label}<->GPU transfer ({e}); raise "
                                  f"tiers.{self.host_name}.budget") from None
        else:
            tmp = torch.empty(n, dtype=torch.uint8, pin_memory=self.cuda)
        # ``wait_event`` orders the leg that touches the GPU: the read of a GPU source, or the write of a
        # GPU destination (whose memory earlier kernels may still use)
        to_gpu = self._roles.get(self.tier_of(dst)) == DEVICE
        first = self.copy(src, tmp, None if to_gpu else wait_event, bulk=bulk)
        fut = then(first, lambda _: self.copy(tmp, dst, wait_event if to_gpu else None, bulk=bulk))
        out: cf.Future = cf.Future()

        def release(f: cf.Future, tmp=tmp) -> None:  # (holds a pinned buffer until both copies are done)
            if owned:
                host.free(tmp.extent)

        fut.add_done_callback(release)
        forward(fut, out)
        return out

    def stats(self) -> dict:
        return {name: link.snapshot() for name, link in self.links.items()}

    def close(self) -> None:
        for lane in (self._h2d, self._d2h, self._h2d_bulk, self._d2h_bulk):
            lane.close()
        self._local.shutdown(wait=True)


def _same_buffer(t: torch.Tensor, gpu) -> bool:
    """True when ``t`` is a view into the GPU tier's buffer (the CPU stand-in has host tensors there)."""
    buf = gpu.view(Extent(getattr(gpu, "base", 0), gpu.capacity))  # (a rank's part of a service's HBM: at its base)
    return buf.device == t.device and buf.data_ptr() <= t.data_ptr() < buf.data_ptr() + max(gpu.capacity, 1)
