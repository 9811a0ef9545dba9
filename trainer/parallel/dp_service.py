"""A data-parallel run's session on one rank when the host's store is a tiermem service's (``tiermem_server``).

The service is the host's one store and its CPU worker, as for one trainer. Every rank attaches to it (rank 0
first: it creates or finds the run; the others join it, saying which groups they own, ``trainer.parallel.dp.owners``),
maps the service's arena and NVMe file with GPU slots of its own, and follows each group's new version from the
service's events. A layer's gradient is reduced to its owner as in an embedded run of several ranks
(``trainer.parallel.dp.GradReducer``); the owner hands the sum to the service's arena. A step's commit is rank 0's, once
every rank has its gradients home (a barrier); then each rank's GPU worker takes the groups of the update the
service leaves to the trainers that it owns (``alloc``, ``flip``), and the service's CPU worker the rest. Rank 0
loads the weights, writes the checkpoints and the export, and finishes the run; another rank says when it is
done (``leave``), so that its going away is no loss, while a rank lost mid-run detaches the whole run from the
service (its update is the service's to finish) and the others stop on the lost collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiermem.futures import done_future
from tiermem.service import protocol
from tiermem.service.client import RemoteOptimizer, attach
from tiermem.session import Session
from trainer.parallel.dp import GradReducer, owners


class RankRemoteOptimizer(RemoteOptimizer):
    """A ``RemoteOptimizer`` of one rank of several: commits are rank 0's, after every rank's gradients are home;
    this rank's GPU worker updates the groups of each update it owns (``mine``)."""

    world = None

    def step(self, step: int, lr: float, grad_scale: float | None = None):
        self.check()
        self.store.flush("grad")  # (this rank's owned groups' sums, home in the service's arena)
        self.world.barrier()  # every owner's
        if self.world.rank == 0:
            fut = super().step(step, lr, grad_scale)
            self.world.broadcast_json(self.moved)  # committed: the others may take their groups
            return fut
        if self.world.broadcast_json(None):  # (re-placement moved optimizer state before this update)
            self.refresh_layout()
        self.check()
        self.committed = step
        if self.mine:
            return self.local.step(step, lr, grad_scale, only=self.mine)
        return done_future()

    def expect_save(self, step: int) -> None:
        """Rank 0 saves checkpoint-``step``: nothing to hold here, since its commit of update ``step + 1`` waits
        until its saver has read every group, and this rank's GPU worker starts on that update after the commit."""

    def wait_all(self, step: int) -> None:
        """Every group (every rank's) holds update ``step``: the versions come from the service to every rank."""
        self.wait()


@dataclass
class ServiceRankSession(Session):
    """A ``Session`` attached to the service as one rank of several."""

    world: object = None
    owner: dict = None
    reducer: GradReducer = None
    host = None  # (no host store of its own: the service's)
    own_hbm: set = field(default_factory=set)  # (a service keeps no state in HBM)

    @property
    def progress_sink(self):
        return self.attached.progress if self.world.rank == 0 else None

    def rank_done(self) -> None:
        """This rank (not 0) is done: its share of the last update is whole."""
        self.attached.leave()


def open_service_rank_session(world, specs, settings, server, run_id: str, label: dict,
                              plan_input: dict | None, fresh: bool = False) -> ServiceRankSession:
    """This rank's session of the service's run: rank 0 attaches first (with the step's workload, for the service
    to plan a new run; ``fresh``: discarding a run of this id it holds), the others after it."""
    path = protocol.server_socket(server)
    owner = owners(list(settings.groups), specs, world.size)
    mine = [g for g in settings.groups if owner[g] == world.rank]
    attached = None
    ours = dict(rank=world.rank, world=world.size, owns=mine, local_rank=world.local_rank,
                optimizer_type=RankRemoteOptimizer)
    if world.rank == 0:
        attached = attach(path, run_id, label, specs, settings, plan_input, fresh=fresh, **ours)
    try:
        world.barrier()  # (the run exists in the service, rank 0 its trainer)
        if world.rank != 0:
            attached = attach(path, run_id, label, specs, settings, **ours)
        opt = attached.optimizer
        opt.world = world
        reducer = GradReducer(world, owner, attached.store)
        return ServiceRankSession(attached.store, opt, attached, world=world, owner=owner, reducer=reducer)
    except BaseException:
        if attached is not None:
            attached.close()
        raise


def loaded(session: ServiceRankSession, start: int, groups) -> None:
    """Every rank starts at ``start``, once rank 0 has told the service the weights are in (``init``): each rank's
    catalog is at ``start`` (the service's events bring the same)."""
    store = session.store
    for g in groups:
        if store.version(g) < start:
            store.set_version(g, start)
    session.optimizer.committed = start
