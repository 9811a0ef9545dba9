"""A data-parallel run's session on one rank: one store per host, shared by its ranks.

The host's first rank (local rank 0) plans and opens the store (a DRAM arena file, the NVMe file) with room for
the others' staging regions and the host's counters, and tells them where everything is (JSON through the
process group); the other ranks map the same arena and NVMe file by name (``tiermem.store.shared``), with GPU
slots of their own. Every rank then gets an ``OwnerOptimizer`` over the groups it owns (``trainer.dp``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tiermem.optim import StoreAdamW
from tiermem.plan.placement import check_budgets
from tiermem.session import Session
from tiermem.store.shared import HostStore
from tiermem.store.store import Store
from trainer.dp import GradReducer, OwnerOptimizer, optimizer_threads, owners


@dataclass
class RankSession(Session):
    """A ``Session`` whose store is shared by the ranks of a host."""

    host: HostStore = None
    world: object = None
    owner: dict = None
    reducer: GradReducer = None

    def close(self) -> None:
        dead = self.host.dead_peers(self.world.pids) if self.world.local_rank != 0 else []
        orphaned = 0 in dead and self.world.local_rank == min(r for r in self.world.pids if r not in dead)
        files = [t.path for t in (self.store.dram, self.store.nvme) if t is not None and t.path is not None]
        try:
            self.optimizer.close()
        finally:
            self.host.close()
            self.store.close()
            if orphaned:  # (the host's first rank died with the arena and NVMe file it made: nobody else removes
                for f in files:  # them; the run resumes from its last checkpoint, not from them)
                    f.unlink(missing_ok=True)


def open_rank_session(world, specs, settings, scfg, plan) -> RankSession:
    """This rank's session: ``plan`` (local rank 0's; None elsewhere) opens the host's store there, the others
    attach to it. Returns with the store's plan on every rank (placement, GPU updates, passes)."""
    groups = list(settings.groups)
    owner = owners(groups, specs, world.size)
    owned = {g for g in groups if owner[g] == world.rank}
    host = None
    told = None
    if world.local_rank == 0:
        staging = plan.staging_bytes
        # (the arena is the host's: the other ranks' staging regions and the counters are in its budget too)
        plan.staging_bytes += HostStore.room(staging, world.local_size, len(groups))
        check_budgets(plan)
        store = Store.open(scfg, specs, streamed_kinds=("param",), plan=plan)
        try:
            host = HostStore.create(store, groups, world.local_size, staging)
        except BaseException:
            store.close()
            raise
        told = dict(host.describe(), gpu_updates=None if plan.gpu_updates is None else list(plan.gpu_updates),
                    activation_budget=plan.activation_budget, passes=plan.passes)
    try:
        told = world.from_host_lead(told)
        if host is None:
            host = HostStore.attach(scfg, specs, told, world.local_rank, world.device(), scfg.tiers.gpu.slots)
            p = host.store.plan
            p.gpu_updates = None if told["gpu_updates"] is None else set(told["gpu_updates"])
            p.activation_budget, p.passes = told["activation_budget"], told["passes"]
        store = host.store
        on_gpu = None if store.plan.gpu_updates is None else set(store.plan.gpu_updates) & owned
        local = StoreAdamW(store, [g for g in groups if g in owned], settings.decay, settings.adamw,
                           settings.has_master, on_gpu=on_gpu, threads=optimizer_threads(world.local_size))
        local.on_state_home = host.publish_state
        store.catalog.on_bump = lambda g, v: host.publish_params(g, v) if g in owned else None
        optimizer = OwnerOptimizer(local, owned, host, world)
    except BaseException:
        if host is not None:
            host.close()
            host.store.close()
        raise
    reducer = GradReducer(world, owner, store.catalog, store.gpu.device)
    return RankSession(store, optimizer, None, host=host, world=world, owner=owner, reducer=reducer)


def loaded(session: RankSession, start: int, groups) -> None:
    """The weights (and the optimizer's state, resuming) are in the host's store at ``start``, and every rank of
    the world knows it: each rank's catalog is at ``start``; the others' updates are followed from now on."""
    world, host, cat = session.world, session.host, session.store.catalog
    if world.local_rank == 0:
        session.store.flush("param")
        session.store.flush("master")
        for kind in ("exp_avg", "exp_avg_sq"):
            session.store.flush(kind)
        host.publish_all(start)
    world.barrier()
    for g in groups:
        if cat.version(g) < start:
            cat.bump(g, to=start)
    host.follow(session.optimizer.owned, world.pids, world.local_rank)
