"""The GPU worker of ``StoreAdamW`` (``tiermem.optim.store_adamw``): it updates the groups the optimizer gives
it on the GPU, three groups in flight (the next one's state arriving, one updating, the last one's going home),
in place for a group whose state lives in the device tier (HBM), else by streaming the state to the GPU and
back; with a guard (the service's) the new state is written out of place and flipped to once it has landed.

A mixin: ``StoreAdamW`` holds the state it works on (the store, the groups, the guard, the streams)."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import itertools
import math
import time

import torch

from tiermem.futures import all_of, done_future
from tiermem.optim.finite import NonFiniteUpdate
from tiermem.specs import MOMENTS, Group, state_name
from tiermem.tiers.base import host_sync


class GpuWorker:
    def _run_gpu(self, groups: list[Group], step: int, lr: float, grad_scale: float | None) -> None:
        """Three groups in flight: the next one's state arriving, this one updating, the last one's going home."""
        ctx = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        with ctx:
            incoming = self._fetch_state(groups[0]) if groups and not self._in_hbm(groups[0]) else None
            leaving, handed = done_future(), []
            # groups updated in HBM out of place: each one's places are asked for by the flip two before it (two
            # groups' new places at most: the room the service keeps), on the flip thread; {group: future places}
            elsewhere = [g for g in groups if self._in_hbm(g) and not self._in_place(g)]
            ahead_of = dict(zip(elsewhere, elsewhere[2:]))
            ahead, self._ahead = self._ahead, None
            granted = {g: done_future(p) for g, p in (ahead[1] if ahead and ahead[0] == step else {}).items()}
            for n, g in enumerate(groups):
                t0 = time.perf_counter()
                if self._in_hbm(g):
                    if n + 1 < len(groups) and incoming is None and not self._in_hbm(groups[n + 1]):
                        incoming = self._fetch_state(groups[n + 1])
                    self._wait_gate(g, step)
                    if self._in_place(g):
                        self._update_resident(g, step, lr, grad_scale)
                    else:
                        flip = self._update_hbm_elsewhere(g, step, lr, grad_scale, granted.pop(g, None),
                                                          ahead_of.get(g))
                        if flip is not None:
                            leaving = flip
                            if g in ahead_of:
                                granted[ahead_of[g]] = flip
                        elif self.cpu_takes_over:  # (no room in HBM for the new state)
                            handed.append(self.update_on_cpu([g], step, lr, grad_scale))
                    self._split["gpu_in_place"] = self._split.get("gpu_in_place", 0.0) + time.perf_counter() - t0
                    continue
                if incoming is None:
                    incoming = self._fetch_state(g)
                work, reads = incoming
                self.store.wait(reads, "optimizer_fetch")
                incoming = None
                if n + 1 < len(groups) and not self._in_hbm(groups[n + 1]):
                    leaving.result()  # bounds the GPU memory in use to three groups
                    incoming = self._fetch_state(groups[n + 1])
                self._wait_gate(g, step)
                places = self.guard.allocate(g, step, self.state_names(g)) if self.guard is not None else None
                if self.guard is not None and places is None:  # no room to write it out of place
                    if self.cpu_takes_over:
                        handed.append(self.update_on_cpu([g], step, lr, grad_scale))
                    continue  # (``leaving`` stays the last group's flip: flips finish in order)
                leaving = self._update_streamed(g, work, step, lr, grad_scale, places)
                self._split["gpu_path"] += time.perf_counter() - t0
            leaving.result()
            for f in handed:
                f.result()

    def first_out_of_place(self, only, k: int = 2) -> list[Group]:
        """The first ``k`` groups of an update of ``only`` that this worker writes out of place in HBM: those whose
        places it asks for itself (the flips ask for the later ones' places)."""
        return list(itertools.islice((g for g in self.groups if g in only and g in self.on_gpu and self._in_hbm(g)
                                      and not self._in_place(g)), k))

    def grant_ahead(self, step: int, places: dict) -> None:
        """Places for some groups' new state in update ``step`` (the first ones ``first_out_of_place`` named), got
        ahead: the worker does not ask for them."""
        self._ahead = (step, dict(places))

    def _in_place(self, g: Group) -> bool:
        return g in self.resident and self.guard is None

    def _in_hbm(self, g: Group) -> bool:
        """The group is updated where its state lives in HBM: in place, or (with a guard) into new places there;
        nothing is fetched for it."""
        if self._in_place(g):
            return True
        if self.guard is None:
            return False
        entries = [e for k in (self.p_kind, *MOMENTS, "param") for e in self.store.catalog.group_entries(g, k)]
        return bool(entries) and all(e.tier == self.hbm for e in entries)

    def _update_hbm_elsewhere(self, g: Group, step: int, lr: float, grad_scale: float | None,
                              granted: cf.Future | None = None, ahead: Group | None = None) -> cf.Future | None:
        """AdamW of a group whose state lives in HBM, with a guard (a service's run): the weights and moments are
        copied to new places in HBM the guard allocates and updated there (a crash before the flip leaves the old
        ones whole), the compute copy is rewritten in place from the new master (a redo rewrites it); then the new
        places are flipped to, as a streamed group's are. ``granted``: a future for the group's places (the flip
        of the group two before it asked for them), else they are asked for here; ``ahead``: the group whose places
        this group's flip asks for. Returns the flip's future (its result: ``ahead``'s places), or None when the
        guard found no room."""
        store, cat, pk, dev = self.store, self.store.catalog, self.p_kind, self.store.device
        t0 = time.perf_counter()
        places = granted.result() if granted is not None else self.guard.allocate(g, step, self.state_names(g))
        self._split["gpu_wait_places"] = self._split.get("gpu_wait_places", 0.0) + time.perf_counter() - t0
        if places is None:
            return None
        t1 = time.perf_counter()
        grads = self._grads_of(g, grad_scale is not None)
        entries = [e for k in (pk, *MOMENTS) for e in cat.group_entries(g, k)]
        olds, news, new = self._elsewhere_views(g, entries, places)
        srcs, dsts = [], []
        for e, o, t in zip(entries, olds, news):
            if e.spec.kind in MOMENTS and not e.valid:  # (the first update: the moments start at zero)
                t.zero_()
            else:
                srcs.append(o)
                dsts.append(t)
        torch._foreach_copy_(dsts, srcs)
        lists = {True: ([], [], [], []), False: ([], [], [], [])}
        for e in cat.group_entries(g, pk):
            base = self._base(e.spec.name)
            row = [new[e.spec.name], grads[state_name(base, "grad")], *(new[state_name(base, k)] for k in MOMENTS)]
            for lst, t in zip(lists[self.decay.get(base, True)], row):
                lst.append(t)
        self._adamw(lists, step, lr, grad_scale, dev)
        if self.has_master:
            params = store.gpu_views(g, "param")
            torch._foreach_copy_([params[e.spec.name] for e in cat.group_entries(g, "param")],
                                 [new[state_name(e.spec.name, "master")] for e in cat.group_entries(g, "param")])
        check = self._check(params.values() if self.has_master else lists[True][0] + lists[False][0])
        computed = None
        if check is not None and check[0].is_cuda:
            computed = torch.cuda.Event()
            computed.record()
        t2 = time.perf_counter()
        if self._stream is not None:  # (written before the flip says so: nothing is copied after it)
            host_sync(self._stream)
        t3 = time.perf_counter()
        self._split["gpu_hbm_launch"] = self._split.get("gpu_hbm_launch", 0.0) + t2 - t1
        self._split["gpu_hbm_sync"] = self._split.get("gpu_hbm_sync", 0.0) + t3 - t2
        if self.has_master:
            store.mark_valid(g, "param")
            cat.params_ready(g, step)

        def flip():
            t1 = time.perf_counter()
            got = self.guard.flip(g, step, places, (ahead, self.state_names(ahead)) if ahead is not None else None)
            self._split["flips"] = self._split.get("flips", 0.0) + time.perf_counter() - t1
            if self._found_nonfinite(check, computed):
                raise NonFiniteUpdate(step, g)
            cat.bump(g, to=step)
            return got

        return self._flips.submit(flip)

    def _found_nonfinite(self, check: tuple | None, computed) -> bool:
        """Whether a group's ``check`` found a weight inf or NaN, read on the flip thread once ``computed`` (the
        check's kernel on the optimizer's stream, or None) has run: on CUDA on a stream of the flips' own. On the
        thread's default stream the read queued behind every kernel the trainer's forward had queued there (the
        executor computes on that stream): each flip waited for the forward's queue, the worker waits for the flip
        of the group before last, and the forward for the worker's next group, the GPU idle in between."""
        if computed is not None:
            computed.synchronize()
        if self._flip_stream is None:
            return self._nonfinite(check)
        with torch.cuda.stream(self._flip_stream):
            return self._nonfinite(check)

    def _elsewhere_views(self, g: Group, entries: list, places: dict) -> tuple:
        """What an out-of-place update of a group living in HBM copies and computes on: its weights' and moments'
        (``entries``) views where they are and at ``places`` (in the same order), and {name: view at places}.
        Kept for the last two (where they are, places) pairs of the group: its updates go back and forth between
        two places, and building a layer's views each update, tensor by tensor, held the worker in the
        interpreter beside the trainer's forward (issue 43: 29 ms a group of the 3B shape, against 2 in place)."""
        store, pk = self.store, self.p_kind
        key = tuple((e.extent.offset, places[e.spec.name].offset) for e in entries)
        kept = self._elsewhere_of.setdefault(g, {})
        got = kept.get(key)
        if got is not None:
            for k in (pk, *MOMENTS):
                store.settle(g, k)
            return got
        old = {n: t for k in (pk, *MOMENTS) for n, t in store.gpu_views(g, k).items()}
        new = {e.spec.name: store.view_at(e.spec.name, places[e.spec.name]) for e in entries}
        got = ([old[e.spec.name] for e in entries], [new[e.spec.name] for e in entries], new)
        if len(kept) >= 2:
            del kept[next(iter(kept))]
        kept[key] = got
        return got

    def _grads_of(self, g: Group, unscaled: bool = True) -> dict:
        """The group's gradient on the GPU to update from: the one offered there, else its home's in HBM, else a
        copy of its home's; ``unscaled``: the fused AdamW unscales the gradient in place, so a home's is copied
        (to a buffer the worker keeps, in one call: the home stays for a redo)."""
        store, dev = self.store, self.store.device
        offered = store.take_offer(g, "grad")
        if offered is not None:
            grads, ready = offered
            if ready is not None:
                torch.cuda.current_stream(dev).wait_event(ready)
            return dict(grads)
        entries = store.catalog.group_entries(g, "grad")
        if entries and all(e.tier == self.hbm for e in entries):
            home = store.gpu_views(g, "grad")
            if not unscaled:
                return home
            copies = self._grad_copies(g, entries)
            torch._foreach_copy_([copies[e.spec.name] for e in entries], [home[e.spec.name] for e in entries])
            return copies
        grads, reads = {}, []
        for e in store.catalog.group_entries(g, "grad"):
            grads[e.spec.name] = torch.empty(e.spec.shape, dtype=e.spec.dtype, device=dev)
            reads.append(store.read(e.spec.name, out=grads[e.spec.name], bulk=True))
        store.wait(all_of(reads), "optimizer_fetch")
        return grads

    def _grad_copies(self, g: Group, entries) -> dict[str, torch.Tensor]:
        """Views of one buffer the worker keeps (on its stream, one group's update after another's) for group g's
        gradient: {name: view}, made once a group (and again when the buffer grows)."""
        dtype, dev = entries[0].spec.dtype, self.store.device
        if any(e.spec.dtype != dtype for e in entries):  # (mixed dtypes: a buffer a tensor)
            return {e.spec.name: torch.empty(e.spec.shape, dtype=e.spec.dtype, device=dev) for e in entries}
        sizes = [math.prod(e.spec.shape) for e in entries]
        buf = self._grad_buffer
        if buf is None or buf.numel() < sum(sizes) or buf.dtype != dtype:
            self._grad_buffer = buf = torch.empty(sum(sizes), dtype=dtype, device=dev)
            self._grad_views = {}
        views = self._grad_views.get(g)
        if views is None:
            views, off = {}, 0
            for e, n in zip(entries, sizes):
                views[e.spec.name] = buf[off: off + n].view(e.spec.shape)
                off += n
            self._grad_views[g] = views
        return views

    def _update_resident(self, g: Group, step: int, lr: float, grad_scale: float | None) -> None:
        """AdamW of a group whose whole state lives in HBM, in place on the optimizer's stream; its version
        moves on once the kernels have run."""
        store, cat, pk = self.store, self.store.catalog, self.p_kind
        lists, params, masters, moments, kinds = self._resident_work(g)
        for e, t in moments:
            if not e.valid:
                t.zero_()
        self._adamw(lists, step, lr, grad_scale, store.device)
        if self.has_master:
            torch._foreach_copy_(params, masters)
        check = self._check(params if self.has_master else lists[True][0] + lists[False][0])
        if self._stream is not None:
            host_sync(self._stream)
        for k in (pk, *MOMENTS, "param"):
            if k in kinds:
                store.mark_valid(g, k)
        if self._nonfinite(check):
            raise NonFiniteUpdate(step, g)
        cat.bump(g, to=step)
        self._home(g, step, done_future())

    def _resident_work(self, g: Group):
        """What an update of a group living in HBM computes on: the fused AdamW's lists by weight decay, the
        compute copy's params and masters, each moment's (entry, view), and the kinds. Built from the store's
        views once and kept while the tensors stay where they are: a mixture-of-experts layer has hundreds of
        tensors, and building their views each step held the interpreter for tens of milliseconds a group
        beside the next forward's kernel launches."""
        store, cat, pk = self.store, self.store.catalog, self.p_kind
        kinds = [k for k in (pk, "grad", *MOMENTS, "param") if cat.group_entries(g, k)]
        where = tuple((e.tier, e.extent.offset) for k in kinds for e in cat.group_entries(g, k))
        kept = self._resident_work_of.get(g)
        if kept is not None and kept[0] == where:
            for k in kinds:
                store.settle(g, k)
            return kept[1]
        views = {k: store.gpu_views(g, k) for k in kinds}
        lists = {True: ([], [], [], []), False: ([], [], [], [])}
        moments = []
        for e in cat.group_entries(g, pk):
            base = self._base(e.spec.name)
            row = [views[pk][e.spec.name], views["grad"][state_name(base, "grad")]]
            for k in MOMENTS:
                name = state_name(base, k)
                moments.append((cat[name], views[k][name]))
                row.append(views[k][name])
            for lst, t in zip(lists[self.decay.get(base, True)], row):
                lst.append(t)
        params, masters = [], []
        if self.has_master:
            for e in cat.group_entries(g, "param"):
                params.append(views["param"][e.spec.name])
                masters.append(views["master"][state_name(e.spec.name, "master")])
        work = (lists, params, masters, moments, set(kinds))
        self._resident_work_of[g] = (where, work)
        return work

    def _fetch_state(self, g: Group):
        store, dev = self.store, self.store.device
        work, reads = {}, []
        offered = store.take_offer(g, "grad")
        if offered is not None:
            grads, ready = offered
            if ready is not None:
                torch.cuda.current_stream(dev).wait_event(ready)
            work.update(grads)
        for k in (self.p_kind, "grad", *MOMENTS):
            if k == "grad" and offered is not None:
                continue
            entries = store.catalog.group_entries(g, k)
            if self.guard is None and entries and all(e.tier == self.hbm for e in entries):
                views = store.gpu_views(g, k)  # (it lives in HBM: updated where it is, nothing copied)
                for e in entries:
                    if k in MOMENTS and not e.valid:
                        views[e.spec.name].zero_()
                    work[e.spec.name] = views[e.spec.name]
                continue
            for e in entries:
                t = torch.empty(e.spec.shape, dtype=e.spec.dtype, device=dev)
                if k in MOMENTS and not e.valid:
                    t.zero_()
                else:
                    reads.append(store.read(e.spec.name, out=t, bulk=True))
                work[e.spec.name] = t
        return work, all_of(reads)

    def _update_streamed(self, g: Group, work, step: int, lr: float, grad_scale: float | None,
                         places: dict | None) -> cf.Future:
        store, cat, pk, dev = self.store, self.store.catalog, self.p_kind, self.store.device
        lists = {True: ([], [], [], []), False: ([], [], [], [])}
        for e in cat.group_entries(g, pk):
            base = self._base(e.spec.name)
            row = [work[state_name(base, k)] for k in (pk, "grad", *MOMENTS)]
            for lst, t in zip(lists[self.decay.get(base, True)], row):
                lst.append(t)
        self._adamw(lists, step, lr, grad_scale, dev)
        if self.has_master:
            params = {e.spec.name: work[state_name(e.spec.name, "master")].to(e.spec.dtype)
                      for e in cat.group_entries(g, "param")}
        check = self._check(params.values() if self.has_master else lists[True][0] + lists[False][0])
        computed = None
        if check is not None and check[0].is_cuda:  # (read once the event says the kernel ran: no wait here)
            computed = torch.cuda.Event()
            computed.record()
        if self._stream is not None and any(cat[n].tier == self.hbm for n in work):  # (updated in HBM, in place: done
            host_sync(self._stream)  # before the version says so, as nothing is copied home after it)
        if self.has_master:
            home = store.store_group(g, "param", params)
            if self.offer_params:
                store.offer(g, "param", params)  # the next forward copies them on the GPU, not over PCIe
        if self.guard is not None:  # out of place: a crash leaves the old state whole; redo recomputes param
            if self.has_master:  # the next forward may use the new weights once home, before the flip
                home.add_done_callback(lambda f: f.exception() is None and cat.params_ready(g, step))
            landed = store.write_elsewhere({n: work[n] for n in places}, places, bulk=True)

            def flip(home=home if self.has_master else None):
                landed.result()
                if home is not None:
                    home.result()
                self.guard.flip(g, step, places)
                if self._found_nonfinite(check, computed):  # (journaled whole: a recovery does not redo it)
                    raise NonFiniteUpdate(step, g)
                cat.bump(g, to=step)

            return self._flips.submit(flip)  # the loop waits on it before fetching the group after next
        back = [store.store_group(g, k, {e.spec.name: work[e.spec.name] for e in cat.group_entries(g, k)},
                                  bulk=True) for k in (pk, *MOMENTS)]
        (home if self.has_master else back[0]).result()
        if computed is not None:
            computed.synchronize()
        if self._nonfinite(check):
            raise NonFiniteUpdate(step, g)
        cat.bump(g, to=step)
        return self._home(g, step, all_of(back))
