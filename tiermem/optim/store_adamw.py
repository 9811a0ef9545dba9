"""AdamW over store-resident groups, run where it is cheapest.

The optimizer updates the groups in the order it is given (the order the next forward needs them) and
bumps each group's version to the step number when its new compute copy is home; the next forward waits
for exactly that. Two workers run at once:

- the **CPU worker** updates, in place, groups whose state lives in DRAM (NVMe-resident state staged
  into the arena one group ahead and written back after) with torch's fused AdamW over all cores but
  two; groups resident on the GPU tier are updated there, by the same code, with GPU tensors;
- the **GPU worker** updates a share of the DRAM/NVMe-resident groups on the GPU (``optimizer.gpu_share``
  in the tiermem config): it streams the group's weights, gradient and moments to the GPU, runs the same
  fused AdamW there and streams the results back. The GPU idles while the next forward waits for the
  optimizer, so this shortens the step when CPU AdamW is the bottleneck.

When a group has fp32 ``master`` weights the update also writes the new compute copy (``param``, e.g.
bf16) from them; without ``master`` the ``param`` tensors are the weights and are updated in place.

With a ``guard`` (the service, ``tiermem.service.journal``) an update must survive a crash at any point: the GPU
worker writes the new weights and moments out of place and the guard switches to them; the CPU worker too
where they live in DRAM and the arena has room (``tiermem.optim.kernels``), else in place behind the guard's
undo copy, or plainly in place where the service's crash loses the run anyway.

Semantics are ``torch.optim.AdamW``'s: decoupled weight decay (only for tensors flagged to decay), bias
correction, fp32 moments; gradients may be divided by ``grad_scale`` (global-norm clipping).

The GPU worker checks each group's new compute copy finite where it has just written it (one multi-tensor norm on
the GPU, read once the group's update is home): an update that made a weight inf or NaN stops with
``NonFiniteUpdate`` before the group's version moves on, so nothing reads it. The CPU worker does not: a read of
the new compute copy there costs about as much as the update (on the H200 host's 14 threads 3.3 G params/s for the
norm of a bf16 copy, against 3.0 for AdamW and the copy: 1.7 with the check). Its groups' weights are checked where
they are written out (a checkpoint's and the exported model's files: ``trainer.outputs.weights_io``), and, when a step's
loss or gradient norm is not finite, by the trainer before it says which (``trainer.run.executor``).
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import os
import threading
import time
from dataclasses import dataclass

import torch

from tiermem.errors import BudgetError
from tiermem.futures import all_of, done_future
from tiermem.optim.finite import NonFiniteUpdate, all_finite, weights_norm  # noqa: F401 - (the trainer's names)
from tiermem.optim.gpu_worker import GpuWorker
from tiermem.optim.interface import Gate
from tiermem.optim.kernels import adamw_out_of_place, fused_adamw
from tiermem.plan.machine import worker_threads
from tiermem.plan.resolve import resolve_auto
from tiermem.specs import MOMENTS, Group, state_name
from tiermem.tiers.base import DEVICE, HOST, host_sync
from tiermem.tiers.extents import OutOfSpace

default_threads = worker_threads  # CPU AdamW's threads (tiermem.plan.machine: the probe measures on as many)


def worker_nice() -> int:
    """The CPU worker's nice value: env TIERMEM_OPTIM_NICE, else 10 (its threads yield the cores to the trainer's;
    see _cpu_worker_thread)."""
    env = os.environ.get("TIERMEM_OPTIM_NICE", "").strip()
    return int(env) if env.lstrip("-").isdigit() else 10


def _cpu_worker_thread(threads: int) -> None:
    """The CPU worker's thread: ``threads`` intra-op threads (its OpenMP team, made by this thread, inherits its
    priority), at a lower priority than the trainer's threads. On the GPU machine's 16 cores the compute of a
    mixture-of-experts step (20 Qwen3-MoE layers, whose layers launch many small kernels from Python) took
    9.6-10.6 s beside 4 AdamW threads, 10-17 s beside 14 at the same priority, and 10.4-11.1 s beside 14 at
    this one: the thread that launches the kernels, and the copy lanes, must get a core when they wake.
    (Linux: the nice value is per thread; elsewhere nothing changes.)"""
    torch.set_num_threads(threads)
    try:
        nice = worker_nice()
        if nice:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):
        pass


@dataclass
class AdamWConfig:
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0


@dataclass
class OptimSettings:
    """What an optimizer over a store is made of besides the store: AdamW's settings, whether there are fp32
    master weights, which tensors decay (by name), and the groups in update order. It travels as JSON: in a
    trainer's ``hello`` to a service, and in the service's run record."""

    adamw: AdamWConfig
    has_master: bool
    decay: dict[str, bool]
    groups: list[Group]

    def to_json(self) -> dict:
        a = self.adamw
        return {"beta1": a.beta1, "beta2": a.beta2, "eps": a.eps, "weight_decay": a.weight_decay,
                "has_master": self.has_master, "decay": dict(self.decay), "groups": list(self.groups)}

    @classmethod
    def from_json(cls, o) -> OptimSettings:
        """Settings from untrusted JSON; ValueError with a one-line reason when they are malformed."""
        try:
            adamw = AdamWConfig(float(o["beta1"]), float(o["beta2"]), float(o["eps"]), float(o["weight_decay"]))
            decay = {str(k): bool(v) for k, v in dict(o["decay"]).items()}
            settings = cls(adamw, bool(o["has_master"]), decay, list(o["groups"]))
        except (KeyError, TypeError, ValueError):
            raise ValueError("bad optim settings: need beta1, beta2, eps, weight_decay, has_master, decay, "
                             "groups") from None
        a = settings.adamw
        if not (0 <= a.beta1 < 1 and 0 <= a.beta2 < 1 and 0 < a.eps < math.inf and 0 <= a.weight_decay < math.inf):
            raise ValueError("bad optim settings: beta1 and beta2 must be in [0, 1), eps positive, weight_decay not "
                             "negative (an update with others is undefined)")
        return settings

    def optimizer(self, store, **kw) -> StoreAdamW:
        """A ``StoreAdamW`` over ``store`` with these settings (``kw``: its keyword arguments)."""
        return StoreAdamW(store, self.groups, self.decay, self.adamw, self.has_master, **kw)


class StoreAdamW(GpuWorker):
    """AdamW over ``groups`` of ``store`` (the order the next forward needs them).

    ``gpu_share`` and ``cpu_groups`` (optimizer.gpu_share and optimizer.cpu_groups; by default the store
    config's, resolved as an embedded run's by ``tiermem.plan.resolve``) pick the GPU worker's groups, or
    ``on_gpu`` names them. With a ``guard`` (the service's journal and undo copy, or an attached trainer's
    ``RemoteGuard``) every update survives a crash at any point: ``guard.begin(group, update, views)``
    before the CPU worker changes a group in place, ``guard.done(group, update)`` once all of its new state
    is home; ``guard.allocate(group, update, names)`` -> places for the GPU worker's out-of-place write
    (None: no room), ``guard.flip(group, update, extents)`` after it wrote them; ``guard.in_place``: the CPU
    worker updates in place without ``begin`` (its service's crash loses the run anyway). ``offer_params``: hand
    GPU-updated compute copies to the next fetch (an embedded run's, not a service's). ``cpu_takes_over``: a
    group the guard finds no room for is updated by this optimizer's CPU worker (an attached trainer's is not:
    its service takes such a group itself)."""

    def __init__(self, store, groups: list[Group], decay: dict[str, bool], cfg: AdamWConfig, has_master: bool,
                 *, gpu_share: float | None = None, cpu_groups: str | None = None, on_gpu=None,
                 threads: int | None = None, guard=None, offer_params: bool = True, cpu_takes_over: bool = True):
        self.store, self.groups, self.decay, self.cfg = store, list(groups), dict(decay), cfg
        self.hbm = store.tiers.device_name  # the device tier: state there is updated where it is
        self.has_master = has_master
        self.p_kind = "master" if has_master else "param"
        self.threads = threads or default_threads()
        auto = resolve_auto(store.cfg).optimizer
        self.gpu_share = auto.gpu_share if gpu_share is None else gpu_share
        self.cpu_groups = auto.cpu_groups if cpu_groups is None else cpu_groups
        self.on_gpu = set(on_gpu) if on_gpu is not None else self._assign(self.gpu_share)
        if on_gpu is not None and self.groups:
            self.gpu_share = len(self.on_gpu & set(self.groups)) / len(self.groups)
        # groups whose whole state lives in HBM: the GPU worker updates them there, in place
        self.resident = {g for g in self.groups if self._all_on_gpu(g)}
        self._resident_work_of: dict = {}  # group -> (where its tensors are, what its update computes on)
        self._elsewhere_of: dict = {}  # group -> {(where, places): views} (GpuWorker._elsewhere_views)
        self._grad_buffer: torch.Tensor | None = None  # a group's gradient copy (GpuWorker._grad_copies)
        self._grad_views: dict = {}
        self.guard, self.offer_params, self.cpu_takes_over = guard, offer_params, cpu_takes_over
        # the GPU worker checks each group's new compute copy finite before its version moves on (module docstring)
        self.check_finite = True
        self._cpu = cf.ThreadPoolExecutor(1, "tiermem-optim-cpu", initializer=_cpu_worker_thread,
                                          initargs=(self.threads,))
        self._gpu = cf.ThreadPoolExecutor(1, "tiermem-optim-gpu")
        # with a guard, the GPU worker's flips (a group's new state landed -> journaled, made its home) run
        # here, in order, while the worker goes on with the next group
        self._flips = cf.ThreadPoolExecutor(1, "tiermem-optim-flip")
        self._stream = torch.cuda.Stream(store.device) if store.tiers.device.is_cuda else None
        self._flip_stream = torch.cuda.Stream(store.device) if self._stream is not None and guard is not None else None
        self._pending: cf.Future | None = None
        self._ahead: tuple | None = None  # (update, {group: places}) got ahead for the GPU worker (grant_ahead)
        self._error: BaseException | None = None
        self.last_step_seconds = 0.0  # the last finished step's update, from its start to the last bump
        self.last_split: dict[str, float] = {}  # ... and where its time went
        self._busy, self._split, self._t0 = 0.0, {}, 0.0
        self.gate: Gate | None = None
        self.part_gate: Gate | None = None  # (this process's part of a checkpoint: set_part_gate)
        # group updates the CPU worker made in place for want of room out of place (a group the GPU worker
        # found no room for is counted there, if it finds none either)
        self.no_room = 0
        # on_state_home(group, update): called once all of an update's new state of the group is home (its
        # NVMe write-backs too); another process of the host may then read it (tiermem.store.shared)
        self.on_state_home = None

    def set_gate(self, gate: Gate | None) -> None:
        """Make every group's update wait for ``gate`` first (a checkpoint saver's)."""
        self.gate = gate

    def set_part_gate(self, gate: Gate | None) -> None:
        """Every group's update waits for ``gate`` too, before the saver's (this process writes its part of each
        checkpoint)."""
        self.part_gate = gate

    def expect_save(self, step: int) -> None:
        """Nothing to hold: a saver in this process gates the updates (``set_gate``)."""

    def wait_all(self, step: int) -> None:
        """Until every group holds the last update (every group is this optimizer's)."""
        self.wait()

    def resplit(self, on_gpu) -> None:
        """From the next step on, the GPU worker updates the groups in ``on_gpu`` (those whose state lives in
        HBM always), the CPU worker the others. Called between steps: the update just submitted keeps the split
        it started with, and each group's next backward, which decides where its gradient goes (kept on the GPU
        or sent home), runs after that update of the group is done."""
        self.on_gpu = set(on_gpu) | self.resident
        self.gpu_share = len(self.on_gpu & set(self.groups)) / len(self.groups) if self.groups else 0.0

    def update_figures(self) -> tuple[float, dict[str, float]]:
        """The update just finished (the service calls this when its part ends): its seconds from start to
        end and where they went, kept as ``last_step_seconds`` and ``last_split``."""
        self.last_step_seconds, self.last_split = self._busy, dict(self._split)
        return self.last_step_seconds, self.last_split

    def _assign(self, share: float) -> set[Group]:
        """``share`` of the streamed groups for the GPU worker: spread evenly over the order, so both
        workers progress together (cpu_groups spread); or (last) the first ones, the CPU worker taking the
        ones the next forward needs last."""
        streamed = [g for g in self.groups
                    if any(e.tier != self.hbm for e in self.store.catalog.group_entries(g, self.p_kind))]
        if self.cpu_groups == "last":
            return set(streamed[:int(len(streamed) * share)])
        return {g for n, g in enumerate(streamed) if int((n + 1) * share) > int(n * share)}

    def _all_on_gpu(self, g: Group) -> bool:
        kinds = (self.p_kind, "grad", *MOMENTS, "param")
        entries = [e for k in kinds for e in self.store.catalog.group_entries(g, k)]
        return bool(entries) and all(e.tier == self.hbm for e in entries)

    def grads_on_gpu(self, g: Group) -> bool:
        """True when ``g`` is updated by the GPU worker from a gradient that lives elsewhere: the gradient,
        made on the GPU, should be offered there (``store.offer(g, "grad", ...)``) instead of fetched back."""
        return g in self.on_gpu and not self._updated_from_hbm(g)

    def grads_home(self, g: Group) -> bool:
        """True when ``g``'s gradient must go home to the store (the CPU worker reads it there; a group that
        lives in HBM, or whose gradient does, is updated from its home there)."""
        return g not in self.on_gpu or self._updated_from_hbm(g)

    def _updated_from_hbm(self, g: Group) -> bool:
        if self.guard is not None:
            return False
        grads = self.store.catalog.group_entries(g, "grad")
        return g in self.resident or (bool(grads) and all(e.tier == self.hbm for e in grads))

    # -- public --------------------------------------------------------------------------------
    def step(self, step: int, lr: float, grad_scale: float | None = None, only: set | None = None) -> cf.Future:
        """Start update number ``step`` (1-based) of every group (of the groups in ``only``); returns a future
        for all of them.

        Gradients must have been handed to the store (``store_group(g, "grad", ...)``) before; the
        store orders the reads after those writes.
        """
        self.check()
        if self._pending is not None and self._pending.done():
            self.update_figures()
        self._t0, self._busy = time.perf_counter(), 0.0
        self._split = {"cpu_adamw": 0.0, "cpu_compute_copy": 0.0, "cpu_staging": 0.0, "gpu_path": 0.0,
                       "save_wait": 0.0}
        groups = [g for g in self.groups if only is None or g in only]
        cpu = self._cpu.submit(self._catch, self._run_cpu, [g for g in groups if g not in self.on_gpu],
                               step, lr, grad_scale)
        gpu = self._gpu.submit(self._catch, self._run_gpu, [g for g in groups if g in self.on_gpu],
                               step, lr, grad_scale)
        self._pending = all_of([cpu, gpu])
        return self._pending

    def update_on_cpu(self, groups: list[Group], step: int, lr: float, grad_scale: float | None) -> cf.Future:
        """Update ``groups`` on the CPU worker (after what it is doing): groups whose new state found no room
        to be written out of place."""
        return self._cpu.submit(self._catch, self._run_cpu, list(groups), step, lr, grad_scale)

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self.update_figures()
        self.check()

    @property
    def failure(self) -> BaseException | None:
        """What made an update fail, if one did."""
        return self._error

    def check(self) -> None:
        """Raise the optimizer's failure, if it had one."""
        if self._error is not None:
            raise RuntimeError("the optimizer failed") from self._error

    def close(self) -> None:
        self._cpu.shutdown(wait=True)
        self._gpu.shutdown(wait=True)
        self._flips.shutdown(wait=True)

    def _catch(self, fn, *args) -> None:
        try:
            fn(*args)
        except BaseException as e:
            self._error = e
            raise
        finally:
            self._busy = max(self._busy, time.perf_counter() - self._t0)

    def _wait_gate(self, g: Group, step: int) -> None:
        if self.part_gate is not None:
            self._split["save_wait"] += self.part_gate(g, step)
        if self.gate is not None:
            self._split["save_wait"] += self.gate(g, step)

    def _adamw(self, lists, step: int, lr: float, grad_scale: float | None, dev: torch.device) -> None:
        c = self.cfg
        for decays, (ps, gs, ms, vs) in lists.items():
            fused_adamw(ps, gs, ms, vs, step, lr, c.beta1, c.beta2, c.eps, c.weight_decay if decays else 0.0,
                        grad_scale, dev)

    def _base(self, name: str) -> str:
        return name if self.p_kind == "param" else name.split("/", 1)[1]

    def _check(self, tensors) -> tuple | None:
        """The check of a group's new compute copy ``tensors``, started (their ``weights_norm``, the tensors), when
        this optimizer checks them; ``_nonfinite`` tells its outcome."""
        tensors = [t for t in tensors if t.numel()]
        return (weights_norm(tensors), tensors) if self.check_finite and tensors else None

    @staticmethod
    def _nonfinite(check: tuple | None) -> bool:
        """Whether a ``_check`` found a weight inf or NaN (its norm's kernel must have run: a host sync, or the
        update's copies home, came after it)."""
        return check is not None and not math.isfinite(float(check[0])) and not all_finite(check[1])

    # -- the CPU worker (and groups resident on the GPU tier) ----------------------------------------
    def _run_cpu(self, groups: list[Group], step: int, lr: float, grad_scale: float | None) -> None:
        kinds = (self.p_kind, "grad", *MOMENTS) + (("param",) if self.has_master else ())
        staged = {groups[0]: self._stage(groups[0], kinds)} if groups else {}
        prev_writeback = done_future()
        for n, g in enumerate(groups):
            prev_writeback.result()  # bounds staging to two groups at once
            ts = time.perf_counter()
            if g not in staged:  # the arena's free space was too scattered to stage it ahead
                staged[g] = self._stage(g, kinds)
            if n + 1 < len(groups):
                try:
                    staged[groups[n + 1]] = self._stage(groups[n + 1], kinds)
                except BudgetError:
                    pass  # staged after this group's state is home
            views = {k: f.result() for k, f in staged.pop(g).items()}
            self._split["cpu_staging"] += time.perf_counter() - ts
            self._wait_gate(g, step)
            if self.guard is not None and not getattr(self.guard, "in_place", False):
                new = self._places_elsewhere(g)
                if new is not None:
                    self._update_out_of_place(g, views, new, step, lr, grad_scale)
                    prev_writeback = done_future()
                    continue
                t0 = time.perf_counter()
                self.guard.begin(g, step, views)
                self._split["undo_copy"] = self._split.get("undo_copy", 0.0) + time.perf_counter() - t0
            bad = self._update_in_place(g, views, step, lr, grad_scale)
            prev_writeback = self._finish(g, views, step, bad)
        prev_writeback.result()  # (the step's future stands for every write-back, the last group's too)

    def _stage(self, g: Group, kinds) -> dict[str, cf.Future]:
        out: dict[str, cf.Future] = {}
        try:
            for k in kinds:
                if self.store.catalog.group_entries(g, k):
                    out[k] = self.store.stage(g, k)
        except BudgetError:
            for f in out.values():  # give back what was staged of this group
                f.result().release(write_back=False).result()
            raise
        return out

    def _update_in_place(self, g: Group, views, step: int, lr: float, grad_scale: float | None):
        """AdamW in place on the staged views; returns whether the new compute copy, where it lives on the device
        tier, has a weight inf or NaN."""
        cat, pk = self.store.catalog, self.p_kind
        entries = cat.group_entries(g, pk)
        dev = views[pk].tensors[entries[0].spec.name].device
        back = []  # (home, working copy) for state held on another device than the weights

        def here(t: torch.Tensor) -> torch.Tensor:
            if t.device == dev:
                return t
            w = t.to(dev)
            back.append((t, w))
            return w

        lists = {True: ([], [], [], []), False: ([], [], [], [])}
        for e in entries:
            base = self._base(e.spec.name)
            row = [here(views[pk].tensors[e.spec.name]), here(views["grad"].tensors[state_name(base, "grad")])]
            for k in MOMENTS:
                name = state_name(base, k)
                t = views[k].tensors[name]
                if not cat[name].valid:
                    t.zero_()
                row.append(here(t))
            for lst, t in zip(lists[self.decay.get(base, True)], row):
                lst.append(t)
        t0 = time.perf_counter()
        self._adamw(lists, step, lr, grad_scale, dev)
        t1 = time.perf_counter()
        for home, w in back:
            home.copy_(w)
        if self.has_master:
            for e in cat.group_entries(g, "param"):
                views["param"].tensors[e.spec.name].copy_(views["master"].tensors[state_name(e.spec.name, "master")])
        # (a group resident in HBM, updated here by this same code: checked there, where it costs nothing)
        role = self.store.tiers.role
        check = self._check(t for n, t in views["param"].tensors.items() if role(cat[n].tier) == DEVICE)
        if any(t.is_cuda for v in views.values() for t in v.tensors.values()):
            host_sync(torch.cuda.current_stream())
        self._split["cpu_adamw"] += t1 - t0
        self._split["cpu_compute_copy"] += time.perf_counter() - t1
        return self._nonfinite(check)

    def state_names(self, g: Group) -> list[str]:
        """The group's tensors an update replaces: weights (fp32 master or the params) and both moments."""
        return [e.spec.name for k in (self.p_kind, *MOMENTS) for e in self.store.catalog.group_entries(g, k)]

    def _places_elsewhere(self, g: Group) -> dict | None:
        """New DRAM places for the group's weights and moments, for an update out of place; None when some
        of them live elsewhere (NVMe: staged copies, updated with the undo copy) or the arena has no room
        (fragmented): then the update goes in place behind the undo copy."""
        names = self.state_names(g)
        if any(self.store.tiers.role(self.store.catalog[n].tier) != HOST for n in names):
            return None
        try:
            return self.store.allocate_elsewhere(names)
        except OutOfSpace:
            self.no_room += 1
            return None

    def _update_out_of_place(self, g: Group, views, new: dict, step: int, lr: float, grad_scale) -> None:
        """CPU AdamW into ``new`` places (the old state and the gradient keep their bytes), then the guard
        journals and switches to them: crash-safe without an undo copy (see tiermem.optim.kernels)."""
        store, cat, pk = self.store, self.store.catalog, self.p_kind
        rows: dict[bool, list] = {True: [], False: []}
        for e in cat.group_entries(g, pk):
            base = self._base(e.spec.name)
            row = [views[pk].tensors[e.spec.name], views["grad"].tensors[state_name(base, "grad")]]
            for k in MOMENTS:
                name = state_name(base, k)
                row.append(views[k].tensors[name] if cat[name].valid else None)  # None: starts at zero
            row += [store.view_at(n, new[n]) for n in (e.spec.name, *(state_name(base, k) for k in MOMENTS))]
            rows[self.decay.get(base, True)].append(row)
        t0 = time.perf_counter()
        c = self.cfg
        for decays, group_rows in rows.items():
            adamw_out_of_place(group_rows, step, lr, c.beta1, c.beta2, c.eps, c.weight_decay if decays else 0.0,
                               grad_scale)
        t1 = time.perf_counter()
        if self.has_master:
            for e in cat.group_entries(g, "param"):
                master = state_name(e.spec.name, "master")
                views["param"].tensors[e.spec.name].copy_(store.view_at(master, new[master]))
            store.mark_valid(g, "param")
            views.pop("param").release(write_back=True).result()
        self._split["cpu_adamw"] += t1 - t0
        self._split["cpu_compute_copy"] += time.perf_counter() - t1
        self.guard.flip(g, step, new)
        for view in views.values():
            view.release(write_back=False)
        self.store.catalog.bump(g, to=step)

    def _finish(self, g: Group, views, step: int, bad: bool = False) -> cf.Future:
        """Declare the updated state valid, write NVMe-staged state back, bump the group's version once
        the new compute copy is in its home (unless it is ``bad``: a weight inf or NaN); returns a future for the
        remaining write-backs."""
        writebacks = []
        for k, view in views.items():
            if k == "grad":
                view.release(write_back=False)
                continue
            self.store.mark_valid(g, k)
            fut = view.release(write_back=True)
            if k == "param":
                fut.result()
            else:
                writebacks.append(fut)
        if self.guard is not None:  # journaled as done before anyone may use (or overwrite) its inputs
            all_of(writebacks).result()
            self.guard.done(g, step)
            writebacks = []
        if bad:
            raise NonFiniteUpdate(step, g)
        self.store.catalog.bump(g, to=step)
        return self._home(g, step, all_of(writebacks))

    def _home(self, g: Group, step: int, fut: cf.Future) -> cf.Future:
        """``fut`` (the group's last write-backs of update ``step``), telling ``on_state_home`` when it is done."""
        if self.on_state_home is not None:
            hook = self.on_state_home
            fut.add_done_callback(lambda f: f.exception() is None and hook(g, step))
        return fut
