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

Where the service's plan keeps a group's state in HBM, it lives on its owner's GPU, in the service's block there
(``tiermem.tiers.hbm_parts``): each rank maps its own part only, and its store leaves the others' out (``remote``).
As with an embedded run's ranks, each rank loads the state its HBM holds (rank 0 tells the service the weights
are in once every rank has), and writes its part of each checkpoint (``PartSaver``); the file ``written`` in
the part's folder tells rank 0's saver it is whole (``PartMarks``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from tiermem.config import MOMENTS
from tiermem.futures import done_future
from tiermem.service import protocol
from tiermem.service.client import RemoteOptimizer, attach
from tiermem.session import Session
from trainer.outputs.checkpoint import part_tmp
from trainer.parallel.dp import GradReducer, owners, reduction_bytes

WRITTEN = "written"  # (in a part's folder: the part is whole and synced)


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

    def set_part_gate(self, gate) -> None:
        """This rank writes its part of each checkpoint (its HBM's state): its GPU worker's updates wait for it."""
        if self.local is not None:
            self.local.set_part_gate(gate)

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
    own_hbm: set = field(default_factory=set)  # store names of the state in this rank's part of the service's HBM
    remote: set = field(default_factory=set)  # ... and in the other ranks' parts (not in this rank's store)
    parts: list = field(default_factory=list)  # the other ranks whose HBM holds state a checkpoint keeps
    init_at: int | None = None  # (rank 0) the weights are in this rank's store: told once every rank's are

    @property
    def progress_sink(self):
        return self.attached.progress if self.world.rank == 0 else None

    def loaded(self, step: int) -> None:
        """Rank 0 has loaded what its store holds: the service is told (``init``) once every rank has loaded the
        state its HBM holds (``all_loaded``), so that a crash between never leaves a run half loaded."""
        self.store.flush("param")
        self.store.flush("master")
        self.init_at = step

    def all_loaded(self, step: int) -> None:
        """Every rank's state is in (a barrier); rank 0 tells the service."""
        for kind in ("master", *MOMENTS):  # (this rank's own HBM's writes)
            self.store.flush(kind)
        self.world.barrier()
        if self.world.rank == 0 and self.init_at is not None:
            Session.loaded(self, self.init_at)
            self.init_at = None

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
    if world.rank == 0:  # (with every group's owner: the service keeps a group's HBM state on its owner's GPU)
        if plan_input is not None:  # (the gradients in flight to their owners take HBM beside the plan's)
            plan_input = dict(plan_input, taken=reduction_bytes(specs))
        attached = attach(path, run_id, label, specs, settings, plan_input, fresh=fresh, owners=owner, **ours)
    try:
        world.barrier()  # (the run exists in the service, rank 0 its trainer)
        if world.rank != 0:
            attached = attach(path, run_id, label, specs, settings, **ours)
        opt = attached.optimizer
        opt.world = world
        reducer = GradReducer(world, owner, attached.store)
        return ServiceRankSession(attached.store, opt, attached, world=world, owner=owner, reducer=reducer,
                                  own_hbm=attached.own_hbm, remote=attached.remote,
                                  parts=parts_of(attached.remote, specs, owner, settings.has_master))
    except BaseException:
        if attached is not None:
            attached.close()
        raise


def parts_of(remote: set, specs, owner: dict, has_master: bool) -> list[int]:
    """The other ranks whose part of the service's HBM holds state a checkpoint keeps (the master weights, or
    without them the weights, and the moments): each writes its part of each checkpoint."""
    kept = ("master" if has_master else "param", *MOMENTS)
    return sorted({owner[s.group] for s in specs if s.name in remote and s.kind in kept})


class PartMarks:
    """How a rank tells rank 0's saver its part of a checkpoint is written (``PartSaver``'s announce): a file
    ``written`` in the part's folder, once the part is synced; rank 0 waits for it (``wait_part``) while the rank
    lives."""

    def __init__(self, out_dir: Path, world):
        self.out, self.world = Path(out_dir), world

    def announce(self, rank: int, step: int) -> None:
        mark = part_tmp(self.out, step, rank) / WRITTEN
        tmp = mark.with_name(WRITTEN + ".tmp")
        tmp.write_text(f"{step}\n")
        os.replace(tmp, mark)

    def wait_part(self, rank: int, step: int) -> float:
        """Until rank ``rank`` has written its part of checkpoint-``step``; the seconds waited. Raises when that
        rank is gone."""
        from tiermem.store.shared import alive

        t0, mark = time.perf_counter(), part_tmp(self.out, step, rank) / WRITTEN
        pid = self.world.pids.get(rank - (self.world.rank - self.world.local_rank))  # (one host's ranks)
        while not mark.is_file():
            if pid is not None and not alive(pid):
                raise RuntimeError(f"rank {rank} (pid {pid}) is gone before writing its part of checkpoint-{step}")
            time.sleep(0.02)
        return time.perf_counter() - t0


def loaded(session: ServiceRankSession, start: int, groups) -> None:
    """Every rank starts at ``start``, once rank 0 has told the service every rank's state is in (``init``): each
    rank's catalog is at ``start`` (the service's events bring the same)."""
    session.all_loaded(start)
    store = session.store
    for g in groups:
        if store.version(g) < start:
            store.set_version(g, start)
    session.optimizer.committed = start
