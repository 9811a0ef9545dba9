"""AdamW over store-resident groups, run where the state lives.

The optimizer updates one group at a time, in the order it is given (the order the next forward needs
the groups), on one worker thread: torch's fused AdamW on CPU tensors (all cores) for groups whose
state lives in DRAM or on NVMe, on GPU tensors for groups resident in HBM. NVMe-resident state is staged
into the arena one group ahead and written back after. When a group has fp32 ``master`` weights the
update writes the new compute copy (``param``, e.g. bf16) from them; without ``master`` the ``param``
tensors are updated in place. Each finished group's version is bumped to the step number, which is
what the next forward waits for.

Semantics are ``torch.optim.AdamW``'s: decoupled weight decay (only for tensors flagged to decay),
bias correction, fp32 moments; gradients may be scaled by ``1 / grad_scale`` (global-norm clipping).

The update runs on the device that holds the group's weights (``master``, else ``param``); state of the
group held elsewhere is copied there and back. CPU updates use ``threads`` intra-op threads (default: all
cores but two, which the trainer's thread and the copy lanes need; env ``TIERMEM_OPTIM_THREADS``).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
from dataclasses import dataclass

import torch

from tiermem.catalog import Group, state_name
from tiermem.futures import all_of, done_future
from tiermem.mover import host_sync

MOMENTS = ("exp_avg", "exp_avg_sq")


def default_threads() -> int:
    env = os.environ.get("TIERMEM_OPTIM_THREADS")
    if env:
        return max(1, int(env))
    n = os.cpu_count() or 1
    return n - 2 if n > 4 else n


@dataclass
class AdamWConfig:
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0


class StoreAdamW:
    def __init__(self, store, groups: list[Group], decay: dict[str, bool], cfg: AdamWConfig, has_master: bool,
                 threads: int | None = None):
        self.store, self.groups, self.decay, self.cfg = store, list(groups), dict(decay), cfg
        self.has_master = has_master
        self.threads = threads or default_threads()
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiermem-optim",
                                           initializer=torch.set_num_threads, initargs=(self.threads,))
        self._pending: cf.Future | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self.last_step_seconds = 0.0  # the last step's update, from start to the last group's version bump
        self.last_split = {"adamw": 0.0, "compute_copy": 0.0, "staging": 0.0}

    # -- public --------------------------------------------------------------------------------
    def step(self, step: int, lr: float, grad_scale: float | None = None) -> cf.Future:
        """Start update number ``step`` (1-based) of every group; returns a future for all of them.

        Gradients must have been handed to the store (``store_group(g, "grad", ...)``) before; the
        store orders the reads after those writes.
        """
        self.check()
        self._pending = self._pool.submit(self._run, step, lr, grad_scale)
        return self._pending

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
        self.check()

    def check(self) -> None:
        """Raise the optimizer's failure, if it had one."""
        if self._error is not None:
            raise RuntimeError("the optimizer failed") from self._error

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # -- the update ------------------------------------------------------------------------------
    def _run(self, step: int, lr: float, grad_scale: float | None) -> None:
        t0 = time.perf_counter()
        self._split = {"adamw": 0.0, "compute_copy": 0.0, "staging": 0.0}
        try:
            p_kind = "master" if self.has_master else "param"
            kinds = (p_kind, "grad", *MOMENTS) + (("param",) if self.has_master else ())
            staged = {self.groups[0]: self._stage(self.groups[0], kinds)} if self.groups else {}
            prev_writeback = done_future()
            for n, g in enumerate(self.groups):
                prev_writeback.result()  # bounds staging to two groups at once
                if n + 1 < len(self.groups):
                    staged[self.groups[n + 1]] = self._stage(self.groups[n + 1], kinds)
                ts = time.perf_counter()
                views = {k: f.result() for k, f in staged.pop(g).items()}
                self._split["staging"] += time.perf_counter() - ts
                self._update(g, views, p_kind, step, lr, grad_scale)
                prev_writeback = self._finish(g, views, step)
        except BaseException as e:
            self._error = e
            raise
        finally:
            self.last_step_seconds = time.perf_counter() - t0
            self.last_split = self._split

    def _stage(self, g: Group, kinds) -> dict[str, cf.Future]:
        return {k: self.store.stage(g, k) for k in kinds if self.store.catalog.group_entries(g, k)}

    def _update(self, g: Group, views, p_kind: str, step: int, lr: float, grad_scale: float | None) -> None:
        cat = self.store.catalog
        entries = cat.group_entries(g, p_kind)
        dev = views[p_kind].tensors[entries[0].spec.name].device
        back = []  # (home, working copy) for state held on another device than the weights

        def here(t: torch.Tensor) -> torch.Tensor:
            if t.device == dev:
                return t
            w = t.to(dev)
            back.append((t, w))
            return w

        lists = {True: ([], [], [], []), False: ([], [], [], [])}
        for e in entries:
            base = e.spec.name if p_kind == "param" else e.spec.name.split("/", 1)[1]
            row = [here(views[p_kind].tensors[e.spec.name]), here(views["grad"].tensors[state_name(base, "grad")])]
            for k in MOMENTS:
                name = state_name(base, k)
                t = views[k].tensors[name]
                if not cat[name].valid:
                    t.zero_()
                row.append(here(t))
            for lst, t in zip(lists[self.decay.get(base, True)], row):
                lst.append(t)
        t0 = time.perf_counter()
        for decays, (ps, gs, ms, vs) in lists.items():
            if not ps:
                continue
            steps = [torch.tensor(float(step), device=dev) for _ in ps]
            scale = None if grad_scale is None else torch.tensor(grad_scale, dtype=torch.float32, device=dev)
            torch._fused_adamw_(ps, gs, ms, vs, [], steps, lr=lr, beta1=self.cfg.beta1, beta2=self.cfg.beta2,
                                weight_decay=self.cfg.weight_decay if decays else 0.0, eps=self.cfg.eps,
                                amsgrad=False, maximize=False, grad_scale=scale, found_inf=None)
        t1 = time.perf_counter()
        for home, w in back:
            if w is not None:
                home.copy_(w)
        if self.has_master:
            for e in cat.group_entries(g, "param"):
                views["param"].tensors[e.spec.name].copy_(views["master"].tensors[state_name(e.spec.name, "master")])
        if any(t.is_cuda for v in views.values() for t in v.tensors.values()):
            host_sync(torch.cuda.current_stream())
        self._split["adamw"] += t1 - t0
        self._split["compute_copy"] += time.perf_counter() - t1

    def _finish(self, g: Group, views, step: int) -> cf.Future:
        """Declare the updated state valid, write NVMe-staged state back, bump the group's version once
        the new compute copy is in its home; returns a future for the remaining write-backs."""
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
        self.store.catalog.bump(g, to=step)
        return all_of(writebacks)
