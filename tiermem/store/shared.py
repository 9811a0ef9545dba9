"""One store shared by the processes of a host (data-parallel ranks): DRAM and NVMe hold each tensor once.

    # the host's first process (local rank 0): the store as usual, with room for the others
    plan.staging_bytes += HostStore.room(plan.staging_bytes, processes, len(groups))
    store = Store.open(cfg, specs, plan=plan)
    host = HostStore.create(store, groups, processes, plan_staging)   # regions of the arena, the counters
    told = host.describe()                                            # JSON, sent to the others
    # every other process of the host
    host = HostStore.attach(cfg, specs, told, local_rank, device, slots, owners=owners)
    host.store                                                        # a Store over the same bytes
    host.plan                                                         # the first one's plan, as told

- Every other process maps the arena and the NVMe file by name, as a service's trainer does
  (``tiermem.store.layout.attach_store``), with GPU slots of its own; it allocates only inside its own region
  of the arena (where it stages the NVMe-resident state of the groups it updates).
- The **counters** are a few int64 in the arena, each written by one process: per group the update whose
  compute copy is home (``params``), the update whose whole state is home (``state``) and the last checkpoint
  step that has read the group (``saved``); per process whether it finished cleanly. The process that updates
  a group publishes its counters; every other process follows them into its own catalog (``follow``), so its
  prefetcher and its checkpoint reader wait exactly as they do for an optimizer of their own. A counter is
  written after the bytes it announces (one aligned 8-byte store, in program order after them).
- The follower also watches the other processes: one that is gone without having finished (killed) is
  reported (``lost``) and every waiter is woken, so nobody waits for an update that will never come.
- **HBM-resident state** is each process's own: a group's state may live in the HBM of the process that updates
  it (its GPU tier, never mapped by the others). The first process's store holds only its own HBM tensors, and
  an attaching one creates its own (``resident``) beside the shared ones; the layout it is told names the first
  process's HBM tensors, which it leaves out. Another process never reads them: a checkpoint's state of them is
  written by their process (its ``shard`` counter: the last checkpoint step whose part it has written).
"""

from __future__ import annotations

import threading
import time

import psutil
import torch

from tiermem.errors import UserError
from tiermem.sizes import align_up
from tiermem.specs import KINDS, Group, TensorSpec
from tiermem.store.layout import attach_store, layout_of, shared_description
from tiermem.store.store import Store
from tiermem.tiers import registry
from tiermem.tiers.base import DEVICE
from tiermem.tiers.extents import Extent

FOLLOW_S = 0.001  # how often a follower reads the counters
WATCH_S = 0.1  # how often it checks that the other processes live


class PeerLost(RuntimeError):
    """Another process of the host is gone without having finished."""

    def __init__(self, local_rank: int, pid: int):
        super().__init__(f"local rank {local_rank} (pid {pid}) is gone")
        self.local_rank, self.pid = local_rank, pid


class HostStore:
    def __init__(self, store: Store, groups: list[Group], processes: int, counters: Extent,
                 regions: list[Extent | None]):
        self.store, self.groups, self.processes = store, list(groups), processes
        self.index = {g: i for i, g in enumerate(self.groups)}
        self.counters, self.regions = counters, regions
        self._c = store.tiers.host.view(counters, 8 * self._n_counters(len(groups), processes)).view(torch.int64)
        self.lost: PeerLost | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _n_counters(groups: int, processes: int) -> int:
        return 3 * groups + 2 * processes

    @classmethod
    def room(cls, staging: int, processes: int, groups: int) -> int:
        """Arena bytes the host's first process adds to its own: a staging region for each other process, and
        the counters."""
        return (processes - 1) * align_up(staging, 4096) + align_up(8 * cls._n_counters(groups, processes), 4096)

    @classmethod
    def create(cls, store: Store, groups: list[Group], processes: int, staging: int) -> HostStore:
        """The first process's side, over its freshly opened ``store`` (sized with ``room``)."""
        shared = {store.tiers.device_name, store.tiers.host_name, *store.tiers.storage()[:1]}
        if set(store.tiers) - shared:
            raise UserError(f"several ranks of a host share the arena and one storage tier only: the tiers "
                            f"{', '.join(sorted(set(store.tiers) - shared))} are not supported with several "
                            "ranks yet")
        host = store.tiers.host
        counters = host.allocate(8 * cls._n_counters(len(groups), processes))
        regions: list[Extent | None] = [None]
        for _ in range(1, processes):
            regions.append(host.allocate(staging) if staging else None)
        host = cls(store, groups, processes, counters, regions)
        host._c.zero_()
        return host

    @property
    def plan(self):
        """The host's plan (``tiermem.plan.placement.Plan``): the first process's own; on another, the one it told
        (``describe``), over the layout this process maps."""
        return self.store.plan

    def files(self) -> list:
        """The files the host's store lives in: its arena's (none when anonymous) and its storage tier's."""
        tiers = self.store.tiers
        shared = [tiers.host, *(tiers[n] for n in tiers.storage()[:1])]
        return [t.path for t in shared if t is not None and t.path is not None]

    def describe(self) -> dict:
        """What another process needs to attach (JSON): the layout, the shared tiers, the counters, and the plan's
        decisions besides the places (``told_plan``)."""
        store, cfg = self.store, self.store.cfg
        tiers = store.tiers
        disk = next(iter(tiers.storage()), None)
        return {"layout": layout_of(store), "host": shared_description(tiers.host, cfg.tiers[tiers.host_name]),
                "disk": shared_description(tiers.get(disk), cfg.tiers.get(disk), chosen=True),
                "groups": self.groups, "processes": self.processes,
                "counters": [self.counters.offset, self.counters.nbytes],
                "regions": [None if r is None else [r.offset, r.nbytes] for r in self.regions],
                "plan": told_plan(store.plan)}

    @classmethod
    def attach(cls, cfg, specs: list[TensorSpec], told: dict, local_rank: int, device: torch.device,
               slots: int, resident: list[TensorSpec] = (), owners: dict | None = None) -> HostStore:
        """Another process's side: the first one's arena and NVMe file mapped here, GPU slots of its own, and
        its own HBM-resident tensors (``resident``; of ``specs`` only those the layout shares are mapped). Its plan
        takes the first one's decisions (``owners``: each group's owner, whose HBM holds the state the first one's
        plan keeps in HBM)."""
        hbm = registry.primary(DEVICE)  # (the first process's HBM: not here)
        layout = {n: p for n, p in told["layout"].items() if p[0] != hbm}
        shared = [s for s in specs if s.name in layout]
        store = attach_store(cfg, shared, layout, told["host"], told["disk"], device, slots, resident)
        try:
            region = told["regions"][local_rank]
            store.tiers.host.use_region(Extent(*region) if region else Extent(0, 0))
            regions = [None if r is None else Extent(*r) for r in told["regions"]]
            if told.get("plan") is not None:
                _take_plan(store.plan, told["plan"], specs, owners)
            return cls(store, told["groups"], int(told["processes"]), Extent(*told["counters"]), regions)
        except BaseException:
            store.close()
            raise

    # -- the counters ----------------------------------------------------------------------------
    def _get(self, i: int) -> int:
        return int(self._c[i])

    def _raise_to(self, i: int, v: int) -> None:
        c = self._c
        if c is not None and v > int(c[i]):  # (None: closed; a write-back finishing late has no reader left)
            c[i] = v

    def params(self, g: Group) -> int:
        return self._get(self.index[g])

    def state(self, g: Group) -> int:
        return self._get(len(self.groups) + self.index[g])

    def saved(self, g: Group) -> int:
        return self._get(2 * len(self.groups) + self.index[g])

    def publish_params(self, g: Group, v: int) -> None:
        self._raise_to(self.index[g], v)

    def publish_state(self, g: Group, v: int) -> None:
        self._raise_to(self.index[g], v)
        self._raise_to(len(self.groups) + self.index[g], v)

    def publish_saved(self, g: Group, step: int) -> None:
        self._raise_to(2 * len(self.groups) + self.index[g], step)

    def publish_all(self, v: int) -> None:
        """Every group's state is update ``v`` (the weights were just loaded)."""
        for g in self.groups:
            self.publish_state(g, v)

    def finished(self, local_rank: int) -> None:
        """This process ends cleanly: its going away is no loss."""
        self._c[3 * len(self.groups) + local_rank] = 1

    def publish_shard(self, local_rank: int, step: int) -> None:
        """This process has written (and synced) its part of checkpoint-``step``."""
        self._raise_to(3 * len(self.groups) + self.processes + local_rank, step)

    def wait_shard(self, local_rank: int, step: int) -> float:
        """Block until process ``local_rank`` has written its part of checkpoint-``step``; returns the seconds
        waited. Raises PeerLost when a process of the host is gone."""
        t0 = time.perf_counter()
        while self._get(3 * len(self.groups) + self.processes + local_rank) < step:
            self.check()
            time.sleep(FOLLOW_S)
        return time.perf_counter() - t0

    def wait_saved(self, g: Group, step: int, timeout: float | None = None) -> float:
        """Block until a checkpoint of ``step`` has read group ``g`` (another process writes it); returns the
        seconds waited. Raises PeerLost when a process of the host is gone, TimeoutError after ``timeout`` (None:
        as long as the others live: a big checkpoint's reader may take minutes to reach a late group)."""
        t0 = time.perf_counter()
        while self.saved(g) < step:
            self.check()
            if timeout is not None and time.perf_counter() - t0 > timeout:
                raise TimeoutError(f"group {g!r} was not read by checkpoint-{step} within {timeout:.0f} s")
            time.sleep(FOLLOW_S)
        return time.perf_counter() - t0

    def check(self) -> None:
        if self.lost is not None:
            raise self.lost

    # -- following the others ----------------------------------------------------------------------
    def follow(self, mine: set, pids: dict[int, int], me: int) -> None:
        """Apply the counters of the groups this process does not update (all but ``mine``) to its catalog, and
        watch the other processes of the host (local rank -> pid), from a daemon thread."""
        others = [g for g in self.groups if g not in mine]
        peers = {r: p for r, p in pids.items() if r != me}
        self._thread = threading.Thread(target=self._follow, args=(others, peers), name="tiermem-host-follow",
                                        daemon=True)
        self._thread.start()

    def _follow(self, others: list[Group], peers: dict[int, int]) -> None:
        cat, n = self.store.catalog, len(self.groups)
        idx = [self.index[g] for g in others]
        last_watch, seen = 0.0, None
        while not self._stop.wait(FOLLOW_S):
            c = self._c
            if c is None:
                return
            now_seen = c[: 2 * n].tolist()  # (one copy of the counters a poll: cheap with hundreds of groups)
            if now_seen != seen:
                seen = now_seen
                for g, i in zip(others, idx):
                    p, s = now_seen[i], now_seen[n + i]
                    if p > cat.params_version(g):
                        cat.params_ready(g, p)
                    if s > cat.version(g):
                        for k in KINDS:  # (its owner wrote every kind: a checkpoint here may read them)
                            self.store.mark_valid(g, k)
                        cat.bump(g, to=s)
            now = time.monotonic()
            if self.lost is None and now - last_watch > WATCH_S:
                last_watch = now
                dead = self.dead_peers(peers)
                if dead:
                    self.lost = PeerLost(dead[0], peers[dead[0]])
                    for g in self.groups:  # wake whoever waits on a version
                        cat.bump(g, to=cat.version(g))

    def dead_peers(self, pids: dict[int, int]) -> list[int]:
        """The local ranks among ``pids`` that are gone without having finished."""
        return [r for r, pid in sorted(pids.items())
                if self._get(3 * len(self.groups) + r) == 0 and not alive(pid)]

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._c = None


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def told_plan(plan) -> dict | None:
    """A plan's decisions besides the places, as another process of the host takes them (JSON): the groups the GPU
    updates, the activation budget, the passes, a micro-batch's rows and a piece's, and the (group, kind)s it keeps
    in HBM (each in its owner's). None without a plan."""
    if plan is None:
        return None
    hbm = registry.primary(DEVICE)
    return {"gpu_updates": None if plan.gpu_updates is None else list(plan.gpu_updates),
            "activation_budget": plan.activation_budget, "passes": plan.passes,
            "hbm": [[g, k] for (g, k), t in plan.where.items() if t == hbm],
            "micro_rows": plan.micro_rows, "piece_rows": plan.piece_rows}


def _take_plan(plan, told: dict, specs: list[TensorSpec], owners: dict | None) -> None:
    """An attached process's plan takes the first one's decisions (``told_plan``); with ``owners``, the state the
    first one keeps in HBM is placed there too (in each group's owner's), and counted."""
    plan.gpu_updates = None if told["gpu_updates"] is None else set(told["gpu_updates"])
    plan.activation_budget, plan.passes = told["activation_budget"], told["passes"]
    plan.micro_rows, plan.piece_rows = told["micro_rows"], told["piece_rows"]
    where = {(g, k): registry.primary(DEVICE) for g, k in told["hbm"]}
    if where and owners is not None:
        plan.where.update(where)
        for s in specs:
            if (s.group, s.kind) in where:
                plan.group_bytes[(s.group, s.kind)] = plan.group_bytes.get((s.group, s.kind), 0) + s.nbytes
        plan.owners = owners
