"""The run's ranks, one strategy chosen at its start (``choose``): one process (its own store, or a service's it
attaches to), the ranks of one host sharing its store (``HostRanks``), the ranks of several hosts, a store per
host kept in step (``ManyHosts``), or the ranks of one host attached to its service (``ServiceRanks``).

    ranks = choose(World.from_env(), cfg)
    with ranks.running(cfg):                     # several: the checks, the process group, who says an error
        ...
        session = ranks.open_embedded(job, specs, settings, say)     # or ranks.attach(...) with tiermem_server
        ...

The loop asks its strategy whatever differs between them (which rows a step takes, who fills the store, who
saves, what goes between the hosts); each strategy owns its state: the world, its session once opened, the
hosts' sync.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from rich.console import Console

from tiermem.errors import UserError
from tiermem.plan.placement import make_plan
from tiermem.session import Session, open_session
from tiermem.sizes import format_size
from tiermem.tiers import registry
from tiermem.tiers.base import DEVICE
from trainer.parallel.dist import RankLost, World
from trainer.planning.placing import plan_run
from trainer.state import store_config


def choose(world: World, cfg) -> OneProcess:
    """The strategy of this process among the run's ranks."""
    if not world.several:
        return OneProcess(world)
    if cfg.tiermem_server:
        return ServiceRanks(world)
    return ManyHosts(world) if world.nodes > 1 else HostRanks(world)


class OneProcess:
    """One process (no torchrun): the lead of its run, its store its own (``open_embedded``) or a service's
    (``attach``)."""

    def __init__(self, world: World):
        self.world = world
        self.session: Session | None = None
        self.scratch: Path | None = None  # the output folder of a rank that is not the lead (removed at the end)

    # -- the run ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def running(self, cfg):
        """Around the whole run (several ranks: the checks, the process group, which rank says an error)."""
        yield

    def console(self, console: Console | None) -> Console:
        """Where this process says things (another rank than the lead: nowhere)."""
        return console or Console()

    def enter(self, phase: str) -> None:
        """The run is in ``phase`` (prepare, train): several ranks decide by it which of them says an error."""
        self.world.phase = phase

    @property
    def lead(self) -> bool:
        """This process writes the logs, the checkpoints and the exported model."""
        return self.world.lead

    @property
    def size(self) -> int:
        """The run's ranks: a micro-batch is theirs together (``per_device_train_batch_size`` rows each)."""
        return self.world.size

    @property
    def label(self) -> str:
        """The ranks in the start line's shape of a step ("x2 ranks"), or nothing."""
        return ""

    @property
    def loads_checkpoint(self) -> bool:
        """This process loads the checkpoint the run resumes (its large files' check starts at once)."""
        return True

    def check_model(self, cfg, mcfg) -> None:
        """Refuse what these ranks cannot run with this model (one line, exit code 2)."""

    def store_config(self, cfg):
        """The store config of this process."""
        return store_config(cfg.tiermem)

    def sharing(self, groups: list, specs: list) -> tuple[bool, int, dict | None]:
        """How the ranks share the HBM the plan places in: (state may live in HBM, HBM the ranks' gradient
        reductions take, each group's owner whose HBM holds its state or None)."""
        return True, 0, None

    @contextlib.contextmanager
    def lead_first(self):
        """Around tokenizing: the lead first (into the cache), the others after it."""
        yield

    # -- the store ----------------------------------------------------------------------------------------
    def open_embedded(self, job, specs: list, settings, say) -> Session:
        """The run's own store: planned (``job.store_plan``) and opened in this process."""
        scfg = self.store_config(job.cfg)
        job.store_plan = plan_run(job, scfg, say)
        self.session = open_session(specs, settings, config=scfg, plan=job.store_plan)
        return self.session

    def attach(self, specs: list, settings, server, run_id: str, label: dict, plan_input: dict | None,
               fresh: bool = False) -> Session:
        """The store of the service at ``server``, attached to for run ``run_id`` (``fresh``: a run it holds of
        that id is discarded, the run starts anew)."""
        self.session = open_session(specs, settings, server=server, label=label, run_id=run_id,
                                    plan_input=plan_input, fresh=fresh)
        return self.session

    @property
    def fills_store(self) -> bool:
        """This process loads the weights (or the checkpoint) into the store (several ranks: the host's first)."""
        return True

    def held(self) -> set | None:
        """The store names this process's store holds when some state lives elsewhere (another rank's HBM), for
        the weights' loading to leave the rest out; None: every name."""
        return None

    def own_hbm(self) -> set:
        """Store names of the state this rank keeps in its own HBM (a rank that does not fill the store loads
        them itself)."""
        return set()

    def tell_start(self, start: int) -> None:
        """The step training starts at, from the process that filled the store to the others."""

    def told_start(self) -> int:
        """... on a process that did not fill the store."""
        raise RuntimeError("one process fills its own store")

    def all_loaded(self, start: int, groups: list) -> None:
        """Every rank of the store starts at ``start``."""

    # -- the steps ----------------------------------------------------------------------------------------
    def output_dir(self, out: Path) -> Path:
        """Where this process writes: ``out`` for the lead, a scratch folder for the others."""
        return out

    def remove_scratch(self) -> None:
        """The scratch folder gone (a rank that is not the lead)."""
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def reducer(self):
        """What reduces a step's gradients to their owners (``trainer.parallel.dp.GradReducer``), or None."""
        return None

    def may_resplit(self, plan) -> bool:
        """Whether the updates may be split again by what the first steps measure: one process, its own store,
        on CUDA, and the split the planner's."""
        session = self.session
        return session.store.device.type == "cuda" and session.embedded and plan is not None \
            and plan.gpu_updates is not None

    def my_rows(self, micro_batches: list[list[int]], per_device: int) -> list[list[int]]:
        """This rank's rows of each of the step's micro-batches."""
        return micro_batches

    def after_step(self, version: int) -> None:
        """A step is taken (several hosts: every host's next forward reads update ``version``)."""

    def shard(self, items: list) -> list:
        """This rank's share of ``items`` (every size-th: an evaluation's micro-batches)."""
        return items

    def sum(self, values: list[float]) -> list[float]:
        """Each of ``values`` summed over the ranks."""
        return list(values)

    # -- checkpoints and the end --------------------------------------------------------------------------
    def hook_saver(self, saver, save_only_model: bool) -> None:
        """The lead's saver told what the other ranks hold and do (several ranks of a host)."""

    def part_saver(self, job):
        """This rank's part of each checkpoint (the state its HBM holds: ``PartSaver``), or None."""
        return None

    @property
    def follows_saves(self) -> bool:
        """Another rank saves the checkpoints, and this one's updates wait for its reading (``expect_save``)."""
        return False

    def gather_state(self, version: int) -> None:
        """The state of update ``version`` in the store the lead saves and exports from (several hosts)."""

    def wait_all(self, version: int) -> None:
        """Before the lead exports: every rank's groups hold update ``version``."""

    def rank_done(self) -> None:
        """This rank (not the lead) is done: its going away is no loss."""


class Several(OneProcess):
    """What every run of several ranks (torchrun) does alike."""

    @contextlib.contextmanager
    def running(self, cfg):
        from trainer.parallel.dp_checks import check_supported

        world = self.world
        try:
            check_supported(cfg, world)
            world.start(cfg.tiermem_dist_timeout)
            yield
        except UserError as e:
            if not world.lead and world.phase in ("start", "prepare"):
                e.quiet = True  # (every rank checks the same things there, and waits for the lead: the lead says it)
            elif not world.lead and not isinstance(e, RankLost):
                e.rank_prefix = f"rank {world.rank}: "
            raise
        finally:
            world.stop()

    def console(self, console: Console | None) -> Console:
        if not self.world.lead:  # (the lead tells the run; the others' errors name their rank)
            return Console(file=open(os.devnull, "w"))
        return console or Console()

    @property
    def label(self) -> str:
        return f"x{self.world.size} ranks"

    @property
    def loads_checkpoint(self) -> bool:
        return self.world.local_rank == 0

    def check_model(self, cfg, mcfg) -> None:
        from trainer.parallel.dp_checks import check_supported

        check_supported(cfg, self.world, mcfg)

    def store_config(self, cfg):
        from trainer.parallel.dp_checks import rank_store_config

        return rank_store_config(cfg, self.world)

    def sharing(self, groups: list, specs: list) -> tuple[bool, int, dict | None]:
        from trainer.parallel.dp import owners, reduction_bytes

        return True, reduction_bytes(specs), owners(groups, specs, self.world.size)

    @contextlib.contextmanager
    def lead_first(self):
        if self.world.rank > 0:
            self.world.barrier()  # (rank 0 tokenizes into the cache first, the others read it or make their own)
        yield
        if self.world.rank == 0:
            self.world.barrier()

    @property
    def fills_store(self) -> bool:
        return self.world.local_rank == 0

    def own_hbm(self) -> set:
        return self.session.own_hbm

    def tell_start(self, start: int) -> None:
        self.world.broadcast_json(start)

    def told_start(self) -> int:
        return self.world.broadcast_json(None)

    def output_dir(self, out: Path) -> Path:
        if self.world.lead:
            return out
        self.scratch = Path(tempfile.mkdtemp(prefix=f"tiermem-rank{self.world.rank}-"))
        return self.scratch

    def reducer(self):
        return self.session.reducer

    def may_resplit(self, plan) -> bool:
        return False

    def my_rows(self, micro_batches: list[list[int]], per_device: int) -> list[list[int]]:
        from trainer.parallel.dp import my_rows

        return my_rows(micro_batches, self.world.rank, per_device)

    def shard(self, items: list) -> list:
        return items[self.world.rank::self.world.size]

    def sum(self, values: list[float]) -> list[float]:
        return self.world.sum(values)

    @property
    def follows_saves(self) -> bool:
        return self.world.node == 0 and not self.world.lead

    def wait_all(self, version: int) -> None:
        if self.world.lead:  # (every other rank's last update too, whole: the export reads it)
            self.session.optimizer.wait_all(version)

    def rank_done(self) -> None:
        self.session.rank_done()


class HostRanks(Several):
    """The ranks of one host: the host's first rank plans and opens the store, the others attach to it
    (``trainer.parallel.dp_session``); a group's state may live in its owner's HBM."""

    def open_embedded(self, job, specs: list, settings, say) -> Session:
        from trainer.parallel.dp_session import open_rank_session

        world = self.world
        scfg = self.store_config(job.cfg)
        plan = None
        if world.local_rank == 0:
            hbm_state, taken, own = self.sharing(list(settings.groups), specs)
            plan = job.store_plan = plan_run(job, scfg, say, hbm_state=hbm_state, hbm_taken=taken, owners=own)
            if plan is None:  # (every kind pinned: the fixed rule places)
                plan = make_plan(specs, scfg, streamed_kinds=("param",), owners=own)
        session = self.session = open_rank_session(world, specs, settings, scfg, plan)
        if world.local_rank != 0:
            job.store_plan = session.plan
        self._say_shares(session, settings, say)
        return session

    def _say_shares(self, session, settings, say) -> None:
        from trainer.run.opening import span

        world, plan = self.world, session.plan
        mine = sorted((g for g, r in session.owner.items() if r == world.rank), key=lambda g: settings.groups.index(g))
        say(f"{world.size} ranks share this host's store; rank 0 updates {len(mine)} of {len(settings.groups)} groups "
            f"({span(mine)}) with {session.optimizer.local.threads} CPU AdamW threads, the others the rest")
        in_hbm = plan.need(world.rank)[registry.primary(DEVICE)] - plan.slot_bytes * plan.n_slots
        if plan.owners is not None and in_hbm:
            say(f"each rank keeps the state of its groups that live in HBM in its own GPU's (rank 0: "
                f"{format_size(in_hbm)})")

    def held(self) -> set | None:
        if not self.session.remote:
            return None
        return set(self.session.store.names())

    def all_loaded(self, start: int, groups: list) -> None:
        from trainer.parallel.dp_session import loaded

        loaded(self.session, start, groups)

    def hook_saver(self, saver, save_only_model: bool) -> None:
        session = self.session
        saver.on_released = session.host.publish_saved  # (the owners of the other groups wait for the saver)
        if session.remote and not save_only_model:  # (the other ranks' HBM: their parts)
            saver.remote, saver.wait_part = session.remote, session.host.wait_shard
            saver.parts = session.parts

    def part_saver(self, job):
        from trainer.parallel.checkpoint_part import PartSaver

        session, world = self.session, self.world
        if not session.own_hbm:
            return None
        part = PartSaver(session.store, job.mcfg, job.out, world.rank, session.own_hbm, job.cfg.bf16,
                         lambda n: session.host.publish_shard(world.local_rank, n))
        if not part.holds_state:
            return None
        session.optimizer.set_part_gate(part.gate)
        return part


class ManyHosts(HostRanks):
    """The ranks of several hosts: a store per host, each holding every group, kept in step through the process
    group (``trainer.parallel.dp_hosts``); no state in HBM."""

    sync = None  # (trainer.parallel.dp_hosts.HostSync, once the store is open)

    def sharing(self, groups: list, specs: list) -> tuple[bool, int, dict | None]:
        from trainer.parallel.dp import reduction_bytes

        return False, reduction_bytes(specs), None  # (every host keeps every group's state, none in HBM)

    def open_embedded(self, job, specs: list, settings, say) -> Session:
        from trainer.parallel.dp_hosts import HostSync

        session = super().open_embedded(job, specs, settings, say)
        self.sync = HostSync(self.world, session, job.cfg.bf16)
        return session

    def hook_saver(self, saver, save_only_model: bool) -> None:
        super().hook_saver(saver, save_only_model)
        self.sync.saver_gate = saver.gate  # (the lead's: other hosts' updates wait for its reading)

    def after_step(self, version: int) -> None:
        self.sync.compute_copies(version)  # (every host's next forward reads the new weights)

    def gather_state(self, version: int) -> None:
        self.sync.to_lead(version)  # (the other hosts' groups' state, to the store the lead saves from)


class ServiceRanks(Several):
    """The ranks of one host attached to its service (``trainer.parallel.dp_service``): the service is the host's
    store and CPU worker; a group's state it keeps in HBM lives on its owner's GPU, in the service's block there."""

    @property
    def loads_checkpoint(self) -> bool:
        return self.world.rank == 0

    def attach(self, specs: list, settings, server, run_id: str, label: dict, plan_input: dict | None,
               fresh: bool = False) -> Session:
        from trainer.parallel.dp_service import open_service_rank_session

        self.session = open_service_rank_session(self.world, specs, settings, server, run_id, label, plan_input,
                                                 fresh)
        return self.session

    def all_loaded(self, start: int, groups: list) -> None:
        from trainer.parallel.dp_service import loaded

        loaded(self.session, start, groups)

    def held(self) -> set | None:
        if not self.session.remote:
            return None
        return set(self.session.store.names())

    def hook_saver(self, saver, save_only_model: bool) -> None:
        from trainer.parallel.dp_service import PartMarks

        session = self.session
        if session.remote and not save_only_model:  # (the other ranks' HBM: their parts)
            saver.remote, saver.parts = session.remote, session.parts
            saver.wait_part = PartMarks(saver.out, self.world).wait_part

    def part_saver(self, job):
        from trainer.parallel.checkpoint_part import PartSaver
        from trainer.parallel.dp_service import PartMarks

        session, world = self.session, self.world
        if not session.own_hbm:
            return None
        marks = PartMarks(job.out, world)
        part = PartSaver(session.store, job.mcfg, job.out, world.rank, session.own_hbm, job.cfg.bf16,
                         lambda n: marks.announce(world.rank, n))
        if not part.holds_state:
            return None
        session.optimizer.set_part_gate(part.gate)
        return part
