"""The store: tiers + catalog + mover + placement behind one API, used embedded or by the service.

It reaches its tiers by their roles (``tiermem.tiers.base``): groups are fetched into the device tier's slots,
storage-resident state is staged through the host tier, and any tier the config names is made for the plan.

    store = Store.open(cfg, specs)                  # plan under the budgets, make the tiers, allocate
    store.write(name, tensor).result()              # load a tensor into its home tier
    view = store.fetch(group, "param").result()     # the group's tensors on the GPU (resident or a slot)
    ... compute with view.tensors ...; view.release()
    store.store_group(group, "grad", grads)         # hand tensors back to their home
    store.move(name, tier)                          # re-place one tensor
    store.stats()                                   # JSON-serialisable snapshot

Operations on the same (group, kind) run in the order they were submitted. What a user asks of a store besides
moving bytes (which tensors it holds, versions, traffic, its config as it runs) is ``tiermem.store.queries``'s.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections import defaultdict

import torch

from tiermem.config import StoreConfig
from tiermem.errors import BudgetError
from tiermem.futures import all_of, done_future, forward, then
from tiermem.plan.placement import Plan, make_plan
from tiermem.plan.resolve import arena_pinned, compute_device
from tiermem.sizes import align_up, format_size
from tiermem.specs import Group, TensorSpec
from tiermem.store.catalog import Catalog, Entry
from tiermem.store.queries import StoreQueries
from tiermem.store.scratch import Scratch
from tiermem.store.tierset import Tiers, make_tiers
from tiermem.store.views import GroupView, event_now, span_of, typed
from tiermem.store.views import mark_valid as mark_entry_valid
from tiermem.tiers import registry
from tiermem.tiers.base import DEVICE, Making
from tiermem.tiers.extents import Extent, OutOfSpace
from tiermem.transfer.mover import Location, Mover


class Store(StoreQueries, Scratch):
    def __init__(self, cfg: StoreConfig, capacity: dict[str, int], slot_bytes: int = 0, n_slots: int = 0,
                 pin: bool | None = None, plan: Plan | None = None, tiers: dict | None = None,
                 owner: dict | None = None, block=None):
        """Make the tiers for ``capacity`` (tier name -> bytes), or take ready ones (``tiers``: name -> tier, as
        the service's and an attached trainer's stores do over an existing arena and files). ``owner``: who makes the
        store, recorded in its arena's header (a service's state directory, config and socket); ``block``: the block its
        device tier is laid on, one another process maps (a service's HBM, ``tiermem.tiers.hbm_share``)."""
        self.cfg, self.plan = cfg, plan
        self.name = cfg.store_name()
        self.catalog = Catalog()
        device = compute_device(cfg)
        if pin is None:
            pin = arena_pinned(cfg)
        if tiers is not None:
            self.tiers = Tiers(tiers)
        else:
            self.tiers = make_tiers(cfg, capacity, Making(self.name, device, pin, slot_bytes, n_slots, owner, block))
        self.mover = Mover(self.tiers)
        self._tails: dict[tuple[Group, str], cf.Future] = {}
        self._views: dict[tuple[Group, str], tuple] = {}  # (group, kind) -> (offsets, views) of HBM tensors
        self._tail_lock = threading.Lock()
        self.waits: dict[str, float] = defaultdict(float)
        self._offered: dict[tuple[Group, str], tuple[dict[str, torch.Tensor], object]] = {}
        self._closed = False
        self._reserved, self._reserved_lock = {}, threading.Lock()  # (scratch room by tier: tiermem.store.scratch)
        self.keep_files = False  # close() leaves the arena and NVMe files in place (the service's state)

    def __getattr__(self, name: str):
        """A tier of the store by its name (``store.<name>``); None for a registered tier the store did not make."""
        tiers = self.__dict__.get("tiers")
        if tiers is not None and (name in tiers or name in registry.names()):
            return tiers.get(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def open(cls, cfg: StoreConfig, specs: list[TensorSpec], streamed_kinds: tuple[str, ...] = ("param",),
             budgets: dict[str, int | None] | None = None, pin: bool | None = None, plan: Plan | None = None,
             rank: int | None = None) -> Store:
        """Plan ``specs`` under the budgets (refusing before anything is allocated), or take the ``plan``
        the cost model's planner made, then allocate them (``rank``: several ranks, ``plan.owners``: the GPU
        tier is that rank's, ``specs`` leave out the other ranks' HBM-resident tensors)."""
        plan = plan or make_plan(specs, cfg, streamed_kinds, budgets)
        cap = plan.need(rank)
        device = registry.primary(DEVICE)
        align = registry.tier_type(device).alignment * len(specs)  # (each tensor's start aligned)
        cap[device] += align - plan.slot_bytes * plan.n_slots
        store = cls(cfg, cap, plan.slot_bytes + align, plan.n_slots, pin=pin, plan=plan)
        return store.create_all(specs, plan.where)

    def create_all(self, specs: list[TensorSpec], where: dict) -> Store:
        """``create`` every spec on ``where[(group, kind)]``; on failure close the store and re-raise."""
        try:
            for s in specs:
                self.create(s, where[(s.group, s.kind)])
        except BaseException:
            self.close()
            raise
        return self

    # -- tensors ------------------------------------------------------------------------------
    def create(self, spec: TensorSpec, tier: str) -> Entry:
        """Reserve room for ``spec`` on ``tier``; its bytes are invalid until written."""
        if self.tier(tier) is None:
            raise BudgetError(f"cannot place {spec.name} on {tier}: that tier is not configured")
        try:
            extent = self._room(tier, spec.nbytes, spec.group)
        except OutOfSpace:
            raise BudgetError(f"{tier} tier is full: no room for {spec.name} ({format_size(spec.nbytes)}); "
                              f"raise tiers.{tier}.budget") from None
        return self.catalog.add(spec, tier, extent)

    def _room(self, tier: str, nbytes: int, group: Group) -> Extent:
        """A place on ``tier`` for a tensor of ``group`` (a parted device tier's in its owner's part: hbm_parts)."""
        return getattr(self.tier(tier), "allocate_for", lambda _, n: self.tier(tier).allocate(n))(group, nbytes)

    def delete(self, name: str) -> cf.Future:
        """Remove tensor ``name`` and free its place, after every earlier operation on its group and kind."""
        entry = self.catalog[name]

        def run(_):
            self.catalog.remove(name)
            self.tier(entry.tier).free(entry.extent)
            return done_future()

        return self._ordered(entry, run)

    def discard_stored(self, kinds: tuple[str, ...]) -> int:
        """The state of ``kinds`` on the storage tiers will not be read again (the run's last step and checkpoint
        are done): remove it, giving its disk space back for what the run writes next (the exported model).
        Returns the bytes given back."""
        stores = self.tiers.storage()
        if not stores:
            return 0
        for k in kinds:
            self.flush(k)
        back = 0
        for name in stores:
            gone = [e for e in self.catalog.entries() if e.spec.kind in kinds and e.tier == name]
            for e in gone:
                self.catalog.remove(e.spec.name)
            back += self.tiers[name].discard([e.extent for e in gone])
        return back

    def location(self, entry: Entry) -> Location:
        """Where a catalog entry's bytes are, for the mover."""
        return Location(entry.tier, entry.extent, entry.spec.nbytes)

    def _ordered(self, key_or_entry, fn) -> cf.Future:
        """Run ``fn`` (returning a future) after every earlier operation on the same (group, kind)."""
        key = key_or_entry if isinstance(key_or_entry, tuple) else (key_or_entry.spec.group, key_or_entry.spec.kind)
        with self._tail_lock:
            prev = self._tails.get(key) or done_future()
            fut = then(prev, fn, run_on_error=True)
            # (the tail orders and reports; it must not hold the result: a read's tensor would stay alive
            # until the next operation on its group and kind — the 14B export, reading each group once,
            # kept one tensor of every group it had read, until the host ran out of memory)
            tail: cf.Future = cf.Future()
            forward(fut, tail, None, use_value=True)
            self._tails[key] = tail
        return fut

    def write(self, name: str, tensor: torch.Tensor) -> cf.Future:
        """Copy ``tensor`` (any device; same shape and dtype as declared) into the tensor's home."""
        entry = self.catalog[name]
        spec = entry.spec
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise ValueError(f"{name}: expected {spec.dtype} {list(spec.shape)}, got {tensor.dtype} "
                             f"{list(tensor.shape)}")
        self._offered.pop((spec.group, spec.kind), None)
        src = tensor.contiguous()
        wait = event_now(src)

        def run(_):
            entry.valid = False
            fut = self.mover.copy(src, self.location(entry), wait)
            return then(fut, lambda _: mark_entry_valid(entry, src))

        return self._ordered(entry, run)

    def read(self, name: str, out: torch.Tensor | None = None, bulk: bool = False) -> cf.Future:
        """A future for the tensor's bytes, copied into ``out`` or a new host tensor (``bulk``: through the
        mover's bulk lanes)."""
        entry = self.catalog[name]
        spec = entry.spec
        if out is None:
            out = torch.empty(spec.shape, dtype=spec.dtype)
        # ``out`` on the GPU came from the caching allocator on the caller's stream, which hands a block out
        # again as soon as the caller's last use of it is *queued*: the copy (on a lane's stream) must wait
        # until those kernels have run, or they and the copy write the same memory
        wait = event_now(out)

        def run(_):
            if not entry.valid:
                raise ValueError(f"tensor {name!r} has no valid data (never written, or its last write failed)")
            return then(self.mover.copy(self.location(entry), out, wait, bulk=bulk), lambda _: done_future(out))

        return self._ordered(entry, run)

    def move(self, name: str, tier: str) -> cf.Future:
        """Re-place one tensor on ``tier``: copy, then switch its home, then free the old extent."""
        entry = self.catalog[name]

        def run(_):
            if tier == entry.tier:
                return done_future(entry)
            def home(place: Location) -> cf.Future:
                self.rehome(name, place)
                return done_future(entry)

            return then(self.copy_to(name, tier), home)

        return self._ordered(entry, run)

    def copy_to(self, name: str, tier: str) -> cf.Future:
        """Copy the tensor's bytes to a new place on ``tier``, its home unchanged: a future for the new
        ``Location`` (given back if the copy fails). ``rehome`` then makes it the home. Not ordered with the
        tensor's other operations: for state nothing else touches meanwhile (``move`` orders it)."""
        entry = self.catalog[name]
        try:
            extent = self._room(tier, entry.spec.nbytes, entry.spec.group)
        except (OutOfSpace, BudgetError, AttributeError):
            raise BudgetError(f"cannot move {name} to {tier}: no room there") from None
        new = Location(tier, extent, entry.spec.nbytes)
        try:
            copied = self.mover.copy(self.location(entry), new) if entry.valid else done_future()
        except BaseException:  # (no room to stage it, say): the tensor stays where it is
            self.tier(tier).free(extent)
            raise

        def failed(f: cf.Future) -> None:
            if f.exception() is not None:
                self.tier(tier).free(extent)

        copied.add_done_callback(failed)
        return then(copied, lambda _: done_future(new))

    def rehome(self, name: str, place: Location, free: bool = True) -> Location:
        """Make ``place`` (from ``copy_to``) the tensor's home; the old home is freed, or (``free`` False)
        returned for the caller to free once nothing refers to it any more."""
        e = self.catalog[name]
        old = Location(e.tier, e.extent, e.spec.nbytes)
        e.tier, e.extent = place.tier, place.extent
        self._offered.pop((e.spec.group, e.spec.kind), None)
        if free:
            self.tier(old.tier).free(old.extent)
        return old

    # -- groups ---------------------------------------------------------------------------------
    def fetch(self, group: Group, kind: str = "param") -> cf.Future:
        """The group's tensors of ``kind`` on the GPU: views of resident ones, else copies into a slot.

        Blocks while every slot is taken (the trainer is then ahead of the store's memory).
        """
        entries = self.catalog.group_entries(group, kind)
        if not entries:
            raise KeyError(f"no {kind} tensors in group {group!r}")
        hbm = self.tiers.device
        if all(e.tier == self.tiers.device_name for e in entries):
            return done_future(GroupView(group, kind, self._hbm_views(group, kind, entries)))
        t0 = time.perf_counter()
        slot = hbm.acquire_slot()
        self.waits["gpu_slot"] += time.perf_counter() - t0
        views, copies, off = {}, [], 0
        span = span_of(entries, self.tiers.device_name)
        whole = span is not None and span.nbytes <= slot.extent.nbytes
        base = hbm.view(slot.extent)
        for e in entries:
            at = e.extent.offset - span.extent.offset if whole else off
            raw = base[at: at + e.spec.nbytes]
            off += align_up(e.spec.nbytes, hbm.alignment)
            views[e.spec.name] = typed(raw, e.spec)
            copies.append((e, raw))

        def run(_):
            offered, ready = self._offered.pop((group, kind), (None, None))
            if offered is not None and all(e.spec.name in offered for e, _ in copies):
                return all_of([self.mover.copy(offered[e.spec.name], raw, ready) for e, raw in copies])
            if whole:  # (one copy of the span: a mixture-of-experts layer has hundreds of tensors)
                return self.mover.copy(span, base[: span.nbytes], slot.free_event)
            return all_of([self.mover.copy(self.location(e), raw, slot.free_event) for e, raw in copies])

        def release(write_back: bool) -> cf.Future:
            fut = self.store_group(group, kind, views) if write_back else done_future()
            hbm.release_slot(slot)
            return fut

        view = GroupView(group, kind, views, release)
        return then(self._ordered((group, kind), run), lambda _: done_future(view))

    def settle(self, group: Group, kind: str) -> None:
        """Wait until every earlier operation on the group's ``kind`` tensors (a gradient being copied home) is
        done: views of them taken before (``gpu_views``) may then be computed on."""
        with self._tail_lock:
            tail = self._tails.get((group, kind))
        if tail is not None:
            tail.result()

    def gpu_views(self, group: Group, kind: str) -> dict[str, torch.Tensor]:
        """The group's ``kind`` tensors that live in HBM, as views to compute on in place, once every earlier
        operation on them (a gradient being copied home) is done."""
        self.settle(group, kind)
        entries = self.catalog.group_entries(group, kind)
        if any(e.tier != self.tiers.device_name for e in entries):
            raise ValueError(f"group {group!r} {kind} does not live in HBM")
        return self._hbm_views(group, kind, entries)

    def _hbm_views(self, group: Group, kind: str, entries: list[Entry]) -> dict[str, torch.Tensor]:
        """Typed views of tensors that live in HBM, made once and kept while they stay where they are (a
        mixture-of-experts layer has hundreds of tensors, and the trainer takes each group's weights several
        times a step)."""
        where = tuple(e.extent.offset for e in entries)
        kept = self._views.get((group, kind))
        if kept is None or kept[0] != where:
            hbm = self.tiers.device
            kept = (where, {e.spec.name: typed(hbm.view(e.extent), e.spec) for e in entries})
            self._views[(group, kind)] = kept
        return dict(kept[1])

    def offer(self, group: Group, kind: str, tensors: dict[str, torch.Tensor]) -> None:
        """Say that ``tensors`` (GPU memory) hold the group's ``kind`` tensors' current bytes: the next ``fetch`` copies
        them on the GPU, not over PCIe (the GPU worker's new compute copy); a later write withdraws the offer."""
        self._offered[(group, kind)] = (dict(tensors), event_now(*tensors.values()))

    def take_offer(self, group: Group, kind: str):
        """The tensors offered for the group's ``kind`` and an event marking them ready (or None), removed."""
        return self._offered.pop((group, kind), None)

    def stage(self, group: Group, kind: str) -> cf.Future:
        """The group's tensors of ``kind`` in memory the CPU (DRAM) or GPU can compute on: views of those on a memory
        tier; those on a storage tier (NVMe) read into temporary extents of the host tier (the arena) that stages
        them, which ``release(write_back=True)`` writes back and frees."""
        entries = self.catalog.group_entries(group, kind)
        views, temps = {}, []
        host = self.tiers.host
        for e in entries:
            if self.tiers.is_memory(e.tier):
                views[e.spec.name] = typed(self.mover.view(self.location(e)), e.spec)
            else:  # (a storage tier's: staged in the host tier)
                try:
                    tmp = Location(self.tiers.host_name, host.allocate(e.spec.nbytes), e.spec.nbytes)
                except OutOfSpace:
                    for _, t in temps:
                        host.free(t.extent)
                    raise BudgetError(f"no DRAM room to stage {self.tiers[e.tier].label}-resident state; raise "
                                      f"tiers.{self.tiers.host_name}.budget") from None
                temps.append((e, tmp))
                views[e.spec.name] = typed(self.mover.view(tmp), e.spec)

        def run(_):
            return all_of([self.mover.copy(self.location(e), tmp) for e, tmp in temps if e.valid])

        def release(write_back: bool) -> cf.Future:
            if write_back:
                fut = self.store_group(group, kind, {e.spec.name: views[e.spec.name] for e, _ in temps})
            else:
                fut = done_future()
            return then(fut, lambda _: _freeall_of(host, [t for _, t in temps]), run_on_error=True)

        view = GroupView(group, kind, views, release)
        return then(self._ordered((group, kind), run), lambda _: done_future(view))

    def store_group(self, group: Group, kind: str, tensors: dict[str, torch.Tensor], bulk: bool = False) -> cf.Future:
        """Copy ``tensors`` (name -> tensor, any device) into their homes; completes when all have landed
        (``bulk``: through the mover's bulk lanes)."""
        self._offered.pop((group, kind), None)
        entries = {e.spec.name: e for e in self.catalog.group_entries(group, kind)}
        work = []
        for name, t in tensors.items():
            e = entries.get(name)
            if e is None:
                raise KeyError(f"{name!r} is not a {kind} tensor of group {group!r}")
            work.append((e, t.contiguous()))
        wait = event_now(*[t for _, t in work])

        def run(_):
            futs = []
            for e, t in work:
                same = (self.tiers.is_memory(e.tier)
                        and self.mover.view(self.location(e)).data_ptr() == t.data_ptr())
                if same:  # a view of its own home: nothing to copy, but the kernels that wrote it must have run
                    futs.append(self.mover.after(wait) if wait is not None else done_future())
                    e.valid = True
                    continue
                e.valid = False
                futs.append(then(self.mover.copy(t, self.location(e), wait, bulk=bulk),
                                 lambda _, e=e, t=t: mark_entry_valid(e, t)))
            return all_of(futs)

        return self._ordered((group, kind), run)

    def allocate_elsewhere(self, names: list[str]) -> dict[str, Extent]:
        """New places for ``names`` on their home tiers, their bytes left alone (an out-of-place update's), the largest
        first (the small then fill what the large left of holes, not holes a large needed: docs/service.md); raises
        OutOfSpace, having freed what it took, when a tier has no room (the update then goes in place)."""
        new: dict[str, Extent] = {}
        try:
            for name in sorted(names, key=lambda n: -self.catalog[n].spec.nbytes):
                e = self.catalog[name]
                new[name] = self._room(e.tier, e.spec.nbytes, e.spec.group)
        except OutOfSpace:
            for name, ext in new.items():
                self.tier(self.catalog[name].tier).free(ext)
            raise
        return new

    def write_elsewhere(self, tensors: dict[str, torch.Tensor], extents: dict[str, Extent],
                        bulk: bool = False) -> cf.Future:
        """Write each tensor to its new place (``allocate_elsewhere``, here or in the service that owns the
        tiers), leaving its current bytes untouched; the future is done once every write has landed.
        ``switch`` then makes them the tensors' homes (an out-of-place update: a crash before the switch
        leaves the old state whole)."""
        wait = event_now(*tensors.values())
        futs = []
        try:
            for name, t in tensors.items():
                e, ext = self.catalog[name], extents[name]
                if ext.nbytes < e.spec.nbytes:
                    raise ValueError(f"{name}: a place of {ext.nbytes} bytes cannot hold {e.spec.nbytes}")
                futs.append(self.mover.copy(t.contiguous(), Location(e.tier, ext, e.spec.nbytes), wait, bulk=bulk))
        except BaseException:
            for f in futs:
                f.exception()
            raise
        return all_of(futs)

    def view_at(self, name: str, extent: Extent) -> torch.Tensor:
        """The tensor ``name`` as if it lived at ``extent`` of its (DRAM or GPU) tier: a typed view to write
        its new value into before ``switch``."""
        e = self.catalog[name]
        return typed(self.mover.view(Location(e.tier, extent, e.spec.nbytes)), e.spec)

    def switch(self, name: str, extent: Extent, free: bool = True) -> None:
        """Make ``extent`` (written by ``write_elsewhere``) the tensor's home and free the old one (``free``
        False: the old place is the tiers' owner's to free)."""
        e = self.catalog[name]
        self.rehome(name, Location(e.tier, extent, e.spec.nbytes), free)
        e.valid = True

    def mark_valid(self, group: Group, kind: str) -> None:
        """Declare the bytes of a group's resident tensors valid after writing them through views in place."""
        for e in self.catalog.group_entries(group, kind):
            e.valid = True

    def wait(self, fut: cf.Future, what: str):
        """``fut.result()``, accounting the time blocked under ``what`` in the stats' waits."""
        t0 = time.perf_counter()
        try:
            return fut.result()
        finally:
            self.waits[what] += time.perf_counter() - t0

    # -- stats and lifetime ---------------------------------------------------------------------
    def stats(self) -> dict:
        """A JSON-serialisable snapshot: each tier's use by kind, the links, the waits, the groups' versions."""
        from tiermem.store.stats import snapshot

        return snapshot(self)

    def flush(self, kind: str) -> None:
        """Wait until every operation submitted so far on tensors of ``kind`` has completed (raising the
        first failure): an attached trainer's gradients must be home before it commits a step."""
        with self._tail_lock:
            tails = [f for (_, k), f in self._tails.items() if k == kind]
        for f in tails:
            f.result()

    def close(self) -> None:
        """Wait for what is in flight, stop the mover, close the tiers (their files removed unless ``keep_files``)."""
        if self._closed:
            return
        self._closed = True
        with self._tail_lock:
            tails = list(self._tails.values())
        for f in tails:
            try:
                f.result()
            except Exception:  # noqa: BLE001 - failures were reported to whoever waited on them
                pass
        if hasattr(self, "mover"):
            self.mover.close()
        self.tiers.close(keep=self.keep_files)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _freeall_of(host, temps: list[Location]) -> cf.Future:
    for t in temps:
        host.free(t.extent)
    return done_future()

