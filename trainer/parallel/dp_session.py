"""A data-parallel run's session on one rank: one store per host, shared by its ranks.

The host's first rank (local rank 0) plans and opens the store (a DRAM arena file, the NVMe file) with room for
the others' staging regions and the host's counters, and tells them where everything is (JSON through the
process group); the other ranks map the same arena and NVMe file by name (``tiermem.store.shared``), with GPU
slots of their own. Where the plan keeps a group's state in HBM (``plan.owners``), it lives in its owner's: each
rank's store creates the HBM-resident tensors of the groups it owns, and only those. Every rank then gets an
``OwnerOptimizer`` over the groups it owns (``trainer.parallel.dp``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tiermem.config import MOMENTS
from tiermem.optim import StoreAdamW
from tiermem.plan.placement import check_budgets
from tiermem.session import Session
from tiermem.store.shared import HostStore
from tiermem.store.store import Store
from tiermem.tiers import registry
from tiermem.tiers.base import DEVICE
from trainer.parallel.dp import GradReducer, OwnerOptimizer, optimizer_threads, owners


@dataclass
class RankSession(Session):
    """A ``Session`` whose store is shared by the ranks of a host."""

    host: HostStore = None
    world: object = None
    owner: dict = None
    reducer: GradReducer = None
    own_hbm: set = None  # store names of the state this rank keeps in its HBM
    remote: set = None  # ... and of the state other ranks keep in theirs (not in this rank's store)
    parts: list = None  # the other ranks whose HBM holds state a checkpoint keeps: each writes its part of them

    @property
    def plan(self):
        """The host's plan: its first rank's own, or the one that rank told (``HostStore.plan``)."""
        return self.host.plan

    def rank_done(self) -> None:
        """This rank (not the host's first) is done: its going away is no loss."""
        self.host.finished(self.world.local_rank)

    def close(self) -> None:
        """Stop the optimizer, close the host's store; the rank that finds the host's first one gone without having
        finished removes the arena and NVMe file it made."""
        dead = self.host.dead_peers(self.world.pids) if self.world.local_rank != 0 else []
        orphaned = 0 in dead and self.world.local_rank == min(r for r in self.world.pids if r not in dead)
        files = self.host.files()
        try:
            self.optimizer.close()
        finally:
            self.host.close()
            self.store.close()
            if orphaned:  # (the host's first rank died with the arena and NVMe file it made: nobody else removes
                for f in files:  # them; the run resumes from its last checkpoint, not from them)
                    f.unlink(missing_ok=True)


def hbm_specs(specs, where: dict, owner: dict, rank: int) -> list:
    """The specs of the HBM-resident tensors of the groups ``rank`` owns (``where``: the plan's tiers)."""
    hbm = registry.primary(DEVICE)
    return [s for s in specs if where.get((s.group, s.kind)) == hbm and owner[s.group] == rank]


def open_rank_session(world, specs, settings, scfg, plan) -> RankSession:
    """This rank's session: ``plan`` (local rank 0's; None elsewhere) opens the host's store there, the others
    attach to it. Returns with the store's plan on every rank (placement, GPU updates, passes)."""
    groups = list(settings.groups)
    device = registry.primary(DEVICE)  # (the device tier: HBM)
    owner = owners(groups, specs, world.size)
    owned = {g for g in groups if owner[g] == world.rank}
    host = None
    told = None
    if world.local_rank == 0:
        staging = plan.staging_bytes
        # (the arena is the host's: the other ranks' staging regions and the counters are in its budget too)
        plan.staging_bytes += HostStore.room(staging, world.local_size, len(groups))
        check_budgets(plan)
        hbm = [[g, k] for (g, k), t in plan.where.items() if t == device]
        # (the planner's owners are these: trainer.parallel.dp.owners of the same specs)
        if hbm and plan.owners != owner:
            raise RuntimeError("the plan keeps state in HBM for other owners than the session's")
        theirs = {(g, k) for g, k in hbm if owner[g] != world.rank}
        mine = [s for s in specs if (s.group, s.kind) not in theirs]
        store = Store.open(scfg, mine, streamed_kinds=("param",), plan=plan, rank=world.rank if hbm else None)
        try:
            host = HostStore.create(store, groups, world.local_size, staging)
        except BaseException:
            store.close()
            raise
        told = host.describe()  # (with the plan's decisions: HostStore.attach takes them)
    try:
        told = world.from_host_lead(told)
        if host is None:
            where = {(g, k): device for g, k in told["plan"]["hbm"]}
            host = HostStore.attach(scfg, specs, told, world.local_rank, world.device(), scfg.tiers.device_tier.slots,
                                    resident=hbm_specs(specs, where, owner, world.rank), owners=owner)
        store, plan = host.store, host.plan
        on_gpu = None if plan.gpu_updates is None else set(plan.gpu_updates) & owned
        local = StoreAdamW(store, [g for g in groups if g in owned], settings.decay, settings.adamw,
                           settings.has_master, on_gpu=on_gpu, threads=optimizer_threads(world.local_size))
        local.on_state_home = host.publish_state
        store.on_new_version(lambda g, v: host.publish_params(g, v) if g in owned else None)
        optimizer = OwnerOptimizer(local, owned, host, world)
    except BaseException:
        if host is not None:
            host.close()
            host.store.close()
        raise
    reducer = GradReducer(world, owner, store)
    hbm = {(g, k) for (g, k), t in plan.where.items() if t == device} if plan.owners is not None else set()
    in_hbm = [s for s in specs if (s.group, s.kind) in hbm]
    return RankSession(store, optimizer, None, host=host, world=world, owner=owner, reducer=reducer,
                       own_hbm={s.name for s in in_hbm if owner[s.group] == world.rank},
                       remote={s.name for s in in_hbm if owner[s.group] != world.rank},
                       parts=sorted({owner[s.group] for s in in_hbm if owner[s.group] != world.rank
                                     and s.kind in ("master" if settings.has_master else "param", *MOMENTS)}))


def loaded(session: RankSession, start: int, groups) -> None:
    """The weights (and the optimizer's state, resuming) are in the host's store at ``start``, and every rank of
    the world knows it: each rank's catalog is at ``start``; the others' updates are followed from now on."""
    world, host, store = session.world, session.host, session.store
    for kind in ("param", "master", "exp_avg", "exp_avg_sq"):  # (the lead's writes; the others': their HBM's)
        store.flush(kind)
    if world.local_rank == 0:
        host.publish_all(start)
    world.barrier()
    for g in groups:
        if store.version(g) < start:
            store.set_version(g, start)
    host.follow(session.optimizer.owned, world.pids, world.local_rank)
