"""A training run from a resolved config: check everything, open the store, load the model into it,
train for the planned steps, export the model.

Every check that can fail on user input (model directory, data, placement budgets) runs before anything
is written to ``output_dir``.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.text import Text

from tiermem.errors import BudgetError, ConfigError, UserError, printable
from tiermem.optim import AdamWConfig, OptimSettings
from tiermem.plan.machine import Machine
from tiermem.plan.placement import make_plan
from tiermem.plan.planner import DISCARDED_AT_END
from tiermem.plan.resolve import compute_device
from tiermem.schema import to_plain
from tiermem.session import Session, open_session
from tiermem.sizes import format_size
from tiermem.store.stats import StatsFile
from tiermem.store.store import Store
from trainer.config import TrainConfig, resolved
from trainer.data.batches import StepPlan, collate
from trainer.data.prepare import Rows, load_rows, split_eval
from trainer.data.registry import resolve
from trainer.model.config import ModelConfigError, load_balancing_coef
from trainer.model.select import load_model
from trainer.model.weights import all_weights, group_order
from trainer.outputs import checkpoint as ckpt
from trainer.outputs import config_changes
from trainer.outputs import hf_outputs as hf
from trainer.outputs.output_dir import OutputLock, check_free, interrupted_run
from trainer.outputs.report import Reporter, plot_loss
from trainer.outputs.tensorboard import check_logging_dir, open_writer
from trainer.outputs.weights_io import check_weight_files, export_model, import_weights, init_weights
from trainer.parallel.dist import World
from trainer.planning import run_plan
from trainer.planning.plan_watch import PlanWatch
from trainer.run import pieces
from trainer.run.executor import Executor, NonFiniteStep
from trainer.run.gc_pauses import GcPauses
from trainer.run.schedule import lr_factor, warmup_steps
from trainer.run.when import eval_due, save_due, saves
from trainer.state import explicit_gpu_share, state_specs, store_config, wants_cuda


@dataclass
class Job:
    """A run's inputs, checked and prepared before any store is opened."""

    cfg: TrainConfig
    mcfg: object
    model_dir: Path
    out: Path
    rows: Rows
    eval_rows: Rows | None
    plan: StepPlan
    total: int
    warmup: int
    dtype: torch.dtype
    resume: Path | None  # the checkpoint an embedded run resumes from
    store_plan: object = None  # the planner's plan of an embedded run (tiermem.plan.placement.Plan)
    world: World = None  # this process among the run's ranks (one rank: World())

    @property
    def n_params(self) -> int:
        return self.mcfg.num_params()


def run(cfg: TrainConfig, console: Console | None = None) -> dict:
    """The whole run: prepare (check, tokenize), open the store (embedded or the service's), load the
    weights, train, export."""
    world = World.from_env()
    if not world.several:
        return _run(cfg, console or Console(), world)
    from trainer.parallel.dist import RankLost
    from trainer.parallel.dp_checks import check_supported

    try:
        check_supported(cfg, world)
        world.start(cfg.tiermem_dist_timeout)
        if not world.lead:  # (the lead tells the run; the others' errors name their rank)
            console = Console(file=open(os.devnull, "w"))
        return _run(cfg, console or Console(), world)
    except UserError as e:
        if not world.lead and world.phase in ("start", "prepare"):
            e.quiet = True  # (every rank checks the same things there, and waits for the lead: the lead says it)
        elif not world.lead and not isinstance(e, RankLost):
            e.rank_prefix = f"rank {world.rank}: "
        raise
    finally:
        world.stop()


def _run(cfg: TrainConfig, console: Console, world: World) -> dict:
    say = lambda text: console.print(text, soft_wrap=True, highlight=False)
    world.phase = "prepare"
    job = prepare(cfg, console, say, world)
    session = open_training_session(job, say)
    world.phase = "train"
    try:
        _describe_store(session.store, say)
        start = load_weights(job, session, console, say)
        return train(job, session, start, console, say)
    except BaseException as e:
        session.stopping(e)
        raise
    finally:
        session.close()


def prepare(cfg: TrainConfig, console: Console, say, world: World | None = None) -> Job:
    """Check the model and the config, pick the checkpoint to resume from, tokenize the data, plan the steps;
    nothing is written to output_dir. With several ranks, rank 0 tokenizes first (into the cache), the
    others after it."""
    world = world or World()
    model_dir = Path(cfg.model_name_or_path)
    mcfg = model_config(model_dir, cfg)
    if world.several:
        from trainer.parallel.dp_checks import check_supported

        check_supported(cfg, world, mcfg)
    if mcfg.sliding_window is not None and cfg.cutoff_len > mcfg.sliding_window:
        raise ConfigError(f"cutoff_len {cfg.cutoff_len} exceeds the model's sliding_window {mcfg.sliding_window}; "
                          "sliding-window attention is not supported yet: lower cutoff_len")
    out = Path(cfg.output_dir)
    if world.lead and out.is_dir():  # one run per output_dir: another's holds its lock (trainer.outputs.output_dir)
        check_free(out)
    # an attached run picks its checkpoint once the service has said whether it holds the run
    resume = None if cfg.tiermem_server else _checked_resume(cfg, out, mcfg, model_dir, say=say,
                                                             loads=not (world.several and world.local_rank))
    check_logging_dir(cfg)
    if cfg.plot_loss:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError("plot_loss: true needs matplotlib (pip install matplotlib)") from None
    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    if not cfg.tiermem_server:  # the placement under the budgets, before any data is read
        check_placement(cfg, mcfg, dtype, world)
    for note in [*cfg.notes, *mcfg.notes]:
        say(note)
    torch.manual_seed(cfg.seed)
    if world.rank > 0:
        world.barrier()  # (rank 0 tokenizes into the cache first, the others read it or make their own)
    rows, eval_rows = prepare_data(cfg, mcfg, model_dir, console)
    if world.several and world.rank == 0:
        world.barrier()
    show_example(rows, model_dir, say)
    # a step's rows: those of one process with per_device_train_batch_size x world size rows a micro-batch
    plan = StepPlan(len(rows), cfg.per_device_train_batch_size * world.size, cfg.gradient_accumulation_steps,
                    cfg.seed)
    total = plan.total_steps(cfg.num_train_epochs, cfg.max_steps)
    warmup = warmup_steps(total, cfg.warmup_steps, cfg.warmup_ratio)
    job = Job(cfg, mcfg, model_dir, out, rows, eval_rows, plan, total, warmup, dtype, resume, world=world)
    if (eval_rows is not None or cfg.eval_steps is not None) and cfg.eval_strategy == "no" and not cfg.do_eval:
        say("note: evaluation data or eval_steps is set but eval_strategy is no: no evaluation will run")
    if cfg.template is not None and all(e.formatting == "tokenized" for e in resolve(cfg.dataset, cfg.dataset_dir)):
        say(f"note: template '{cfg.template}' is not used: tokenized datasets come rendered already")
    active = mcfg.num_params(active=True)
    say(f"[bold]tiermem-train[/]: {mcfg.family} {job.n_params / 1e6:,.1f}M params"
        + (f" ({active / 1e6:,.1f}M active)" if active != job.n_params else "")
        + (" (generic path)" if getattr(mcfg, "generic", False) else "") + f", {mcfg.num_layers} layers, "
        f"{'bf16' if cfg.bf16 else 'fp32'}; {len(rows)} training rows"
        + (f", {len(eval_rows)} evaluation rows" if eval_rows is not None else "")
        + f"; {total} steps of {cfg.per_device_train_batch_size}x{cfg.gradient_accumulation_steps}"
        + (f"x{world.size} ranks" if world.several else "") + f" rows (warmup {warmup})")
    return job


def open_training_session(job: Job, say) -> Session:
    """The store and its optimizer: this process's (the ``tiermem`` config), or the service's that
    ``tiermem_server`` names (which also decides, for a run it does not hold, the checkpoint to resume)."""
    cfg, mcfg = job.cfg, job.mcfg
    settings = OptimSettings(AdamWConfig(cfg.adam_beta1, cfg.adam_beta2, cfg.adam_epsilon, cfg.weight_decay),
                             cfg.bf16, {w.name: w.decay for w in all_weights(mcfg)}, group_order(mcfg))
    specs = state_specs(mcfg, job.dtype)
    world = job.world
    if world.several and not cfg.tiermem_server:
        return _open_rank_session(job, world, specs, settings, say)
    if not cfg.tiermem_server:
        scfg = store_config(cfg.tiermem)
        job.store_plan = plan_run(job, scfg, say)
        return open_session(specs, settings, config=scfg, plan=job.store_plan)
    label = {"model": str(cfg.model_name_or_path), "output_dir": str(job.out.resolve())}
    workload, plan_input = run_plan.service_plan_input(mcfg, job.dtype, step_shape(job), cfg.loss_chunk_tokens,
                                                       cfg.tiermem_physical_batch_size)
    run_id = run_identity(cfg, mcfg, job.dtype, job.rows)
    if world.several:  # (every rank attached to the host's service: trainer.parallel.dp_service)
        from trainer.parallel.dp_service import open_service_rank_session

        session = open_service_rank_session(world, specs, settings, cfg.tiermem_server, run_id, label, plan_input)
    else:
        session = open_session(specs, settings, server=cfg.tiermem_server, label=label, run_id=run_id,
                               plan_input=plan_input)
    try:
        say(_attach_line(session))
        if session.attached.plan is not None:  # the service planned the run (as an embedded run plans)
            job.store_plan = run_plan.from_service(session.attached.plan, specs, workload,
                                                   cfg.per_device_train_batch_size)
            for line in run_plan.lines(job.store_plan):
                say(line)
        if session.continues_at is None:  # a new run in the service (from the checkpoint it names, if it lost one)
            job.resume = _checked_resume(cfg, job.out, mcfg, job.model_dir, session.named_checkpoint, say,
                                         loads=world.rank == 0)
    except BaseException:
        session.close()
        raise
    return session


def _open_rank_session(job: Job, world: World, specs, settings, say) -> Session:
    """One rank's session of a run of several: the host's first rank plans (no state in HBM) and opens the store,
    the others attach to it (``trainer.parallel.dp_session``)."""
    from trainer.parallel.dp_checks import rank_store_config
    from trainer.parallel.dp_session import open_rank_session

    scfg = rank_store_config(job.cfg, world)
    plan = None
    if world.local_rank == 0:
        from trainer.parallel.dp import owners, reduction_bytes

        # (one host: state may live in its owner's HBM; several hosts keep every group's state on every host)
        own = owners(settings.groups, specs, world.size) if world.nodes == 1 else None
        plan = job.store_plan = plan_run(job, scfg, say, hbm_state=own is not None, hbm_taken=reduction_bytes(specs),
                                         owners=own)
        if plan is None:  # (every kind pinned: the fixed rule places)
            plan = make_plan(specs, scfg, streamed_kinds=("param",), owners=own)
    session = open_rank_session(world, specs, settings, scfg, plan)
    if world.local_rank != 0:
        job.store_plan = session.store.plan
    mine = sorted((g for g, r in session.owner.items() if r == world.rank), key=lambda g: settings.groups.index(g))
    say(f"{world.size} ranks share this host's store; rank 0 updates {len(mine)} of {len(settings.groups)} groups "
        f"({_span(mine)}) with {session.optimizer.local.threads} CPU AdamW threads, the others the rest")
    in_hbm = session.store.plan.need(world.rank)["gpu"] - session.store.plan.slot_bytes * session.store.plan.n_slots
    if session.store.plan.owners is not None and in_hbm:
        say(f"each rank keeps the state of its groups that live in HBM in its own GPU's (rank 0: "
            f"{format_size(in_hbm)})")
    return session


def check_placement(cfg: TrainConfig, mcfg, dtype: torch.dtype, world: World | None = None) -> None:
    """The state placed under the budgets as the run will place it (nothing allocated, no data read): a run
    that cannot fit is refused (BudgetError) first. The planner's fit does not depend on the compute's speed,
    so nothing is timed or measured here."""
    several = world is not None and world.several
    if several:
        from trainer.parallel.dp_checks import rank_store_config

        scfg = rank_store_config(cfg, world)
    else:
        scfg = store_config(cfg.tiermem)
    device = compute_device(scfg)
    machine = Machine.h200("the fit check")
    if device.type == "cuda":
        machine.gpu_memory = torch.cuda.get_device_properties(device).total_memory
    shape = run_plan.Shape(cfg.per_device_train_batch_size, cfg.cutoff_len, cfg.gradient_accumulation_steps)
    budgets = run_plan.local_budgets(scfg, mcfg, dtype, cfg.output_dir, saves(cfg))
    own = _owners(mcfg, dtype, world) if several else None
    if run_plan.make(mcfg, dtype, scfg, shape, machine, device, cfg.loss_chunk_tokens, time_it=False,
                     budgets=budgets, hbm_state=not several or own is not None,
                     hbm_taken=_reductions(mcfg, dtype) if several else 0, owners=own,
                     piece_rows=cfg.tiermem_physical_batch_size) is None:
        make_plan(state_specs(mcfg, dtype), scfg, streamed_kinds=("param",), owners=own)  # every kind pinned


def _owners(mcfg, dtype: torch.dtype, world: World) -> dict | None:
    """Several ranks of one host: each group's owner, whose HBM may hold its state (trainer.parallel.dp.owners); None
    with several hosts (every host keeps every group's state, none in HBM)."""
    from trainer.parallel.dp import owners

    if world.nodes > 1:
        return None
    return owners(group_order(mcfg), state_specs(mcfg, dtype), world.size)


def _reductions(mcfg, dtype: torch.dtype) -> int:
    """HBM several ranks' gradient reductions take (trainer.parallel.dp.reduction_bytes)."""
    from trainer.parallel.dp import reduction_bytes

    return reduction_bytes(state_specs(mcfg, dtype))


def _where(executor: Executor) -> str:
    """Where in a step the executor is (for an out-of-memory line): " of layer 7, pass 2 of 13"."""
    layer = "" if executor.layer is None else (f" of layer {executor.layer}" if isinstance(executor.layer, int)
                                                else f" ({executor.layer})")
    passes = f", pass {executor.at_pass} of {executor.last_passes}" if (executor.last_passes or 1) > 1 else ""
    return layer + passes


def step_shape(job: Job) -> run_plan.Shape:
    """The first step's micro-batches as the planner sees them: rows x padded tokens, and how many."""
    cfg = job.cfg
    mbs = job.plan.rows_of_step(0) if job.total else [[0]]
    seq = max(max(len(job.rows.input_ids[i]) for i in idx) for idx in mbs)
    return run_plan.Shape(cfg.per_device_train_batch_size, seq, len(mbs))


def plan_run(job: Job, scfg, say, hbm_state: bool = True, hbm_taken: int = 0, owners: dict | None = None):
    """The planner's plan for an embedded run (None when the placement pins every kind), told in a few lines
    (``hbm_state`` False: no state in HBM, as several hosts' stores; ``hbm_taken``: HBM taken besides, as several
    ranks' gradients in flight; ``owners``: several ranks of a host, each group's state in its owner's HBM)."""
    device = compute_device(scfg)
    machine = run_plan.machine_for(scfg, device)
    budgets = run_plan.local_budgets(scfg, job.mcfg, job.dtype, job.out, saves(job.cfg))
    plan = run_plan.make(job.mcfg, job.dtype, scfg, step_shape(job), machine, device, job.cfg.loss_chunk_tokens,
                         budgets=budgets, hbm_state=hbm_state, keep=job.cfg.tiermem_keep_activations,
                         hbm_taken=hbm_taken, owners=owners, piece_rows=job.cfg.tiermem_physical_batch_size)
    if plan is not None:
        run_plan.keep_activations(plan, job.cfg.tiermem_keep_activations, job.mcfg)
        lines = run_plan.lines(plan)
        if explicit_gpu_share(job.cfg.tiermem):  # the user's optimizer.gpu_share wins
            plan.gpu_updates = None
            lines = run_plan.lines(plan)
        for line in lines:
            say(line)
    return plan


def load_weights(job: Job, session: Session, console: Console, say) -> int:
    """The run's weights into the store: the service's run as it stands, a checkpoint, the pretrained
    weights or a random initialisation; returns the step training starts at."""
    cfg, store, plan = job.cfg, session.store, job.plan
    if session.continues_at is not None:
        start = session.continues_at
        say(f"continuing the service's run at step {start} (epoch {plan.epoch_of(start):.2f})")
        return start
    kinds = {"param": job.dtype, **({"master": torch.float32} if cfg.bf16 else {})}
    start = 0
    world = job.world
    if world.several and world.local_rank != 0:  # (the host's first rank fills the shared store)
        start = world.broadcast_json(None)
        if session.own_hbm:  # (and each rank the state it keeps in its HBM)
            _load_own_hbm(job, session)
        if job.resume is not None:
            ckpt.set_rng_state(ckpt.tiermem_state(job.resume).get("rng", {}))
        _ranks_loaded(session, start, group_order(job.mcfg))
        return start
    with _bar(console) as bar:
        what = "resuming" if job.resume else "initialising" if cfg.tiermem_init == "random" else "loading"
        task = bar.add_task(f"{what} weights", total=job.n_params)
        adv = lambda n: bar.advance(task, n)
        held = None if not getattr(session, "remote", None) else {e.spec.name for e in store.catalog.entries()}
        if job.resume is not None:
            start = ckpt.load(store, job.resume, job.mcfg, job.dtype, cfg.bf16, adv)
            ckpt.set_rng_state(ckpt.tiermem_state(job.resume).get("rng", {}))
        elif cfg.tiermem_init == "random":
            init_weights(store, job.mcfg, kinds, cfg.seed, store.gpu.device, adv, names=held)
        else:
            import_weights(store, job.mcfg, job.model_dir, kinds, adv, names=held)
    session.loaded(start)
    if world.several:
        world.broadcast_json(start)
        _ranks_loaded(session, start, group_order(job.mcfg))
    if job.resume is not None:
        say(f"resumed from {job.resume} at step {start} (epoch {plan.epoch_of(start):.2f})")
    return start


def _ranks_loaded(session, start: int, groups) -> None:
    """Several ranks: every rank of the host's store (its own, or the service's) starts at ``start``."""
    if session.attached is not None:
        from trainer.parallel.dp_service import loaded
    else:
        from trainer.parallel.dp_session import loaded
    loaded(session, start, groups)


def _load_own_hbm(job: Job, session) -> None:
    """Several ranks: the state this rank keeps in its HBM, from the checkpoint resumed (its moments and master
    weights) or the model (its master weights; the moments start at zero)."""
    cfg, store, names = job.cfg, session.store, session.own_hbm
    if job.resume is not None:
        ckpt.load(store, job.resume, job.mcfg, job.dtype, cfg.bf16, only=names)
    elif cfg.bf16 and cfg.tiermem_init == "random":
        init_weights(store, job.mcfg, {"master": torch.float32}, cfg.seed, store.gpu.device, names=names)
    elif cfg.bf16:
        import_weights(store, job.mcfg, job.model_dir, {"master": torch.float32}, names=names)


def train(job: Job, session: Session, start: int, console: Console, say) -> dict:
    """Steps ``start``..total (logging, checkpoints, evaluation), then the export; returns the results."""
    cfg, mcfg, out, plan, total = job.cfg, job.mcfg, job.out, job.plan, job.total
    store, optimizer, n_params = session.store, session.optimizer, job.n_params
    active = job.mcfg.num_params(active=True)  # what a token computes with (a sparse model's top-k experts)
    rows, dtype, model_dir = job.rows, job.dtype, job.model_dir
    scfg = store.cfg
    world = job.world
    lead = world.lead
    if not lead:  # (what the other ranks would write goes to a scratch folder, removed at the end)
        import tempfile

        out = Path(tempfile.mkdtemp(prefix=f"tiermem-rank{world.rank}-"))
    executor = saver = part = stats = tb = lock = None
    pauses = GcPauses()
    try:
        out.mkdir(parents=True, exist_ok=True)
        if lead:  # (held until the run ends: a second run on output_dir is refused, and touches nothing here)
            lock = OutputLock.take(out, say)
        ckpt.remove_partial(out)
        budget = activation_budget(cfg, store, job.store_plan)
        tb = open_writer(cfg, out) if lead else None  # report_to: tensorboard (sets cfg.logging_dir)
        keep = cfg.tiermem_keep_activations  # (auto: the plan's choice; without a plan, none)
        if keep == "auto":
            keep = len(getattr(job.store_plan, "keep", ()) or ())
        args = dict(resolved(cfg, scfg, budget, store),
                    tiermem_model_path="generic" if getattr(mcfg, "generic", False) else "template",
                    torch_compile=mcfg.compile is not None, tiermem_keep_activations=keep,
                    tiermem_physical_batch_size=min(piece_rows(cfg, job.store_plan) or cfg.per_device_train_batch_size,
                                                    cfg.per_device_train_batch_size))
        (out / "training_args.yaml").write_text(yaml.safe_dump(args, sort_keys=False))
        if getattr(job.store_plan, "prediction", None) is not None:  # (replayable: tiermem plan --workload FILE)
            told = run_plan.report(job.store_plan, cfg.gradient_accumulation_steps)
            (out / "tiermem_plan.json").write_text(json.dumps(told, indent=1, default=str) + "\n")
            if told["advice"]:  # (what `tiermem plan` would advise: more tokens a step, more DRAM, a faster disk)
                say(f"plan: advice: {told['advice']}")
        executor = Executor(store, mcfg, dtype, optimizer, cfg.max_grad_norm, cfg.loss_chunk_tokens, budget, keep,
                            reducer=getattr(session, "reducer", None), piece_rows=piece_rows(cfg, job.store_plan))
        sync = None  # several hosts: their stores kept in step (trainer.parallel.dp_hosts)
        if world.nodes > 1:
            from trainer.parallel.dp_hosts import HostSync

            sync = HostSync(world, session, cfg.bf16)
        report = Reporter(out, total, active, say, resume_step=start, sink=tb.record if tb else None,
                          first_step=cfg.logging_first_step)
        report.pauses = pauses
        # (the updates may be split again by what the first steps measure: one process, its own store, on CUDA, and
        # the split the planner's, not optimizer.gpu_share's)
        may_resplit = (store.gpu.is_cuda and not world.several and session.attached is None
                       and getattr(job.store_plan, "gpu_updates", None) is not None and hasattr(optimizer, "resplit"))
        watch = PlanWatch(job.store_plan, start, may_resplit) \
            if getattr(job.store_plan, "prediction", None) is not None else None
        if watch is not None:
            report.predicted = watch.predicted
        saved: dict[int, str] = {}  # checkpoints written, for trainer_state.json's best_model_checkpoint
        last_eval = None  # (step, loss, seconds) of the latest evaluation

        def live() -> dict:
            opt = {"last_update_s": optimizer.last_step_seconds, "split": optimizer.last_split,
                   "gpu_share": optimizer.gpu_share, "cpu_groups": store.cfg.optimizer.cpu_groups}
            retries = torch.cuda.memory_stats(store.gpu.device).get("num_alloc_retries", 0) if store.gpu.is_cuda else 0
            return dict(report.live, phase=executor.phase, layer=executor.layer, optimizer=opt, alloc_retries=retries,
                        tflops=6 * active * report.live.get("tokens_per_s", 0.0) / 1e12,
                        plan=watch.live() if watch is not None else None)

        stats = StatsFile(out / "tiermem_stats.json", store, live, sink=session.progress_sink)
        if saves(cfg) and lead:
            lineage = ckpt.lineage_for(out, job.resume, session.continues_at)  # (save_total_limit prunes its own)
            saver = ckpt.Saver(store, mcfg, out, model_dir, dtype, cfg.bf16, cfg.save_only_model,
                               cfg.save_total_limit, say, lineage=lineage, resumed=job.resume)
            if world.several and session.host is not None:  # (the owners of the other groups wait for the saver
                saver.on_released = session.host.publish_saved  # to have read them; a service's commit waits)
                if session.remote and not cfg.save_only_model:  # (the other ranks' HBM: their parts)
                    saver.remote, saver.wait_part = session.remote, session.host.wait_shard
                    saver.parts = session.parts
            optimizer.set_gate(saver.gate)
        if saves(cfg) and not lead and session.own_hbm and not cfg.save_only_model:
            from trainer.parallel.checkpoint_part import PartSaver

            part = PartSaver(store, mcfg, job.out, world.rank, session.own_hbm, cfg.bf16,
                             lambda n: session.host.publish_shard(world.local_rank, n))
            if part.holds_state:
                optimizer.set_part_gate(part.gate)
            else:
                part = None
        t0 = time.perf_counter()
        rows_seen = 0
        link_bytes, disk_busy = _link_bytes(store), store.mover.disk.snapshot()["busy_s"]
        report.replay(cfg.logging_steps)  # steps a killed trainer took but did not log
        executor.before_commit = lambda n, result: report.pending(n, result, lr, plan.epoch_of(n),
                                                                  time.perf_counter() - t0)
        with _bar(console) as bar:
            task = bar.add_task("training", total=total, completed=start)
            for step in range(start, total):
                batches = []
                mbs = plan.rows_of_step(step)
                rows_seen += sum(len(idx) for idx in mbs)
                if world.several:  # (this rank's rows of each micro-batch)
                    from trainer.parallel.dp import my_rows

                    mbs = my_rows(mbs, world.rank, cfg.per_device_train_batch_size)
                for idx in mbs:
                    batches.append(collate([rows.input_ids[i] for i in idx], [rows.labels[i] for i in idx],
                                           _pad_id(mcfg)))
                lr = cfg.learning_rate * lr_factor(cfg.lr_scheduler_type, step, total, job.warmup)
                try:
                    result = executor.step(batches, step, lr)
                except NonFiniteStep:  # not applied: the last good update and its checkpoint still finish
                    optimizer.wait()
                    if saver is not None:
                        saver.wait()
                    if part is not None:
                        part.wait()
                    raise
                except torch.OutOfMemoryError:
                    raise BudgetError(
                        f"the GPU ran out of memory in step {step + 1} ({len(batches)} micro-batches of "
                        f"{cfg.per_device_train_batch_size} rows x up to {cfg.cutoff_len} tokens, as "
                        f"{executor.last_passes or 1} layer-major passes, beside the state kept in HBM; in the "
                        f"{executor.phase}{_where(executor)}); lower "
                        "per_device_train_batch_size, tiermem_physical_batch_size or cutoff_len, "
                        "tiermem_activation_budget (a step then runs as "
                        "several layer-major passes)" + (", tiermem_keep_activations" if executor.last_kept
                                                         else "") + " or tiers.gpu.budget") from None
                if sync is not None:  # (every host's next forward reads the new weights)
                    sync.compute_copies(step + 1)
                if step == start and cfg.tiermem_keep_activations not in (0, "auto"):  # (auto: the plan says)
                    asked = f"the {cfg.tiermem_keep_activations}"
                    say(f"note: the activations of {executor.last_kept} layers are kept ({asked} "
                        "tiermem_keep_activations asks for; only layers whose weights live in HBM can be, none with "
                        "a load-balancing loss): their backward skips the recompute")
                if step == start and executor.piece_rows and executor.piece_rows < cfg.per_device_train_batch_size \
                        and not getattr(job.store_plan, "piece_rows", 0):  # (a plan's line says it otherwise)
                    say(f"note: each micro-batch of {cfg.per_device_train_batch_size} rows runs as "
                        f"{pieces.count(cfg.per_device_train_batch_size, executor.piece_rows)} pieces of "
                        f"{executor.piece_rows} row{'s' if executor.piece_rows > 1 else ''} "
                        "(tiermem_physical_batch_size)")
                if step == start and executor.last_passes > 1:
                    say(f"note: a step's boundary activations exceed the activation budget "
                        f"({format_size(executor.activation_budget)}): each step runs as {executor.last_passes} "
                        "layer-major passes, gradients adding up in the store between them")
                now = _link_bytes(store)  # what each link carried this step: top's predicted step time
                disk_busy_now = store.mover.disk.snapshot()["busy_s"]
                if watch is not None:
                    corrected = watch.measured
                    disk = _disk_step(link_bytes, now, disk_busy_now - disk_busy)
                    for line in watch.observe(step - start, result, optimizer.last_split, disk):
                        say(line)
                    report.predicted = watch.predicted
                    if corrected is None and watch.measured is not None and lead:
                        _plan_measured(out / "tiermem_plan.json", watch.measured)
                        if watch.resplit_to is not None:  # (from the next step's backward on)
                            optimizer.resplit(watch.resplit_to)
                report.step(step + 1, result, lr, plan.epoch_of(step + 1), time.perf_counter() - t0,
                            step + 1 == total, cfg.logging_steps)
                if step == start:  # (the setup's and the compile's objects: out of later collections' walk)
                    pauses.freeze()
                report.live["link_bytes_per_step"] = {k: n - link_bytes.get(k, 0) for k, n in now.items()
                                                      if n > link_bytes.get(k, 0)}
                report.live["disk_busy_s_per_step"] = disk_busy_now - disk_busy  # (either way: top's NVMe busy)
                link_bytes, disk_busy = now, disk_busy_now
                done, per_epoch = step + 1, plan.steps_per_epoch
                if eval_due(cfg, done, per_epoch, total):  # (before the save: its trainer_state holds it)
                    t_eval = time.perf_counter()
                    loss = evaluate(executor, job.eval_rows, cfg, mcfg, done, world)
                    last_eval = (done, loss, time.perf_counter() - t_eval)
                    report.eval(done, loss, plan.epoch_of(done), time.perf_counter() - t0)
                if sync is not None and saves(cfg) and save_due(cfg, done, per_epoch, total):
                    sync.to_lead(done)  # (the other hosts' groups' state, to the store the lead saves from)
                if saver is None and world.node == 0 and world.several and saves(cfg) \
                        and save_due(cfg, done, per_epoch, total):
                    optimizer.expect_save(done)  # (the lead saves: update done + 1 waits for its reading)
                    if part is not None:  # (this rank writes the state its HBM holds)
                        part.begin(done)
                if saver is not None and save_due(cfg, done, per_epoch, total):
                    session.refresh_layout()
                    saved[done] = str(out / f"checkpoint-{done}")
                    own = {"global_step": done, "epoch": plan.epoch_of(done), "total_steps": total,
                           "rng": ckpt.rng_state(), "config": resolved(cfg, scfg, budget, store)}
                    hf_state = hf.trainer_state(cfg, hf.log_rows(out, done), done, total, plan.epoch_of(done),
                                                per_epoch, n_params, checkpoints=saved)
                    saver.begin(done, {"trainer_state.json": hf_state, "tiermem_state.json": own})
                bar.advance(task)
            optimizer.wait()
            if part is not None:
                part.wait()
            if sync is not None:
                sync.to_lead(total)
            if world.several and lead:  # (every other rank's last update too, whole: the export reads it)
                optimizer.wait_all(total)
            if saver is not None:
                saver.wait()
        runtime = time.perf_counter() - t0
        final_eval = None
        if cfg.do_eval:  # (HF: trainer.evaluate() after training; the last step's when it was just evaluated)
            if last_eval is None or last_eval[0] != total:
                t_eval = time.perf_counter()
                loss = evaluate(executor, job.eval_rows, cfg, mcfg, total, world)
                last_eval = (total, loss, time.perf_counter() - t_eval)
                report.eval(total, loss, plan.epoch_of(total), time.perf_counter() - t0)
            final_eval = hf.eval_metrics(last_eval[1], last_eval[2], len(job.eval_rows),
                                         -(-len(job.eval_rows) // cfg.per_device_eval_batch_size),
                                         plan.epoch_of(total), cfg.stage)
        if not lead:  # (the lead exports; this rank is done: its going away is no loss)
            session.rank_done()
            return {}
        session.refresh_layout()
        if session.attached is None:  # (the service keeps its state) the disk's room goes to the export
            store.discard_stored(DISCARDED_AT_END)
        with _bar(console) as bar:
            task = bar.add_task("exporting", total=n_params)
            export_model(store, mcfg, out, "master" if cfg.bf16 else "param", dtype, model_dir,
                         lambda n: bar.advance(task, n))
        results = report.results(plan.epoch_of(total), runtime, max(total - start, 1), rows_seen)
        hf.save_metrics(out, "train", results)
        if final_eval is not None:
            hf.save_metrics(out, "eval", final_eval)
        hf.write_state(out / "trainer_state.json",
                       hf.trainer_state(cfg, hf.log_rows(out), total, total, plan.epoch_of(total),
                                        plan.steps_per_epoch, n_params, final=results, checkpoints=saved))
        if cfg.plot_loss:
            plot_loss(out, report.losses)
            if report.eval_losses:
                plot_loss(out, report.eval_losses, "eval_loss")
        final = dict(store.stats(), alloc_retries=torch.cuda.memory_stats(store.gpu.device).get("num_alloc_retries", 0)
                     if store.gpu.is_cuda else 0)
        (out / "store_stats.json").write_text(json.dumps(final, indent=1, default=str) + "\n")
        report.live.update(finished=True, train_loss=results["train_loss"], train_runtime=runtime, eta_s=0.0)
        stats.close()
        stats = None
        session.finished()
        say(f"done: {total} steps in {runtime:.1f}s, train_loss {results['train_loss']:.4f}; "
                      f"model saved to {out}")
        lock.release(finished=True)
        return results
    except BaseException:
        if saver is not None:
            saver.settle()  # a checkpoint already read out of the store is still worth writing
        if part is not None:
            part.settle()
        raise
    finally:
        pauses.close()
        if stats is not None:
            stats.close()
        if lock is not None:  # (a run that stopped before its end leaves the lock file: trainer.outputs.output_dir)
            lock.release(finished=False)
        if executor is not None:
            executor.close()
        if tb is not None:
            tb.close()
        if not lead:
            import shutil

            shutil.rmtree(out, ignore_errors=True)


def model_config(model_dir: Path, cfg: TrainConfig | None = None):
    """The model's config.json read (for the path that computes it: ``tiermem_model_path``; scaled by
    ``rope_scaling`` for cutoff_len as LLaMA-Factory scales it), with the run's
    load-balancing loss weight (``moe_aux_loss_coef``) and whether its layers are compiled (``torch_compile``);
    its problems reported as the user's (one line, exit code 2)."""
    try:
        mcfg = (load_model(model_dir) if cfg is None else
                load_model(model_dir, cfg.tiermem_model_path, cfg.rope_scaling, cfg.cutoff_len))
    except ModelConfigError as e:
        raise ConfigError(str(e)) from None
    if cfg is None:
        return mcfg
    mcfg.compile = compile_choice(cfg, mcfg)
    return load_balancing_coef(mcfg, cfg.moe_aux_loss_coef)


def _plan_measured(path: Path, measured: dict) -> None:
    """Add what the run measured against its plan (the compute's and the CPU worker's factors, the CPU rates in
    the run, the corrected prediction) to its tiermem_plan.json, as "run"."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    data["run"] = measured
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
        os.replace(tmp, path)
    except OSError:  # (a report: a full disk leaves the plan as the run started with it, and no temp file)
        tmp.unlink(missing_ok=True)


def compile_choice(cfg: TrainConfig, mcfg):
    """torch_compile for this run: (backend, mode) or None; auto compiles on CUDA (the store's compute device, or
    an attached trainer's GPU)."""
    from trainer.model.compiled import CompileError, choose

    on_cuda = torch.cuda.is_available() and (bool(cfg.tiermem_server) or wants_cuda(cfg.tiermem))
    try:
        return choose(cfg.torch_compile, cfg.torch_compile_backend, cfg.torch_compile_mode, mcfg, on_cuda)
    except CompileError as e:
        raise ConfigError(str(e)) from None


def _checked_resume(cfg: TrainConfig, out: Path, mcfg, model_dir: Path, named: dict | None = None,
                    say=None, loads: bool = True) -> Path | None:
    """The checkpoint to resume from (checked whole and this model's) and, for a fresh start from
    pretrained weights, that the weight files are there: before anything is touched. ``loads``: this process
    loads the checkpoint (the check of its large files starts now, in the background)."""
    resume = find_resume(cfg, out, named, say)
    if resume is not None:
        ckpt.check(resume, mcfg, model_dir, background=loads, trust_old=cfg.tiermem_trust_old_checkpoints)
        if say is not None:  # (what the rerun changed: a note each, and it goes on with the new values)
            for line in config_changes.notes(resume, ckpt.tiermem_state(resume).get("config"), to_plain(cfg)):
                say(line)
    if cfg.tiermem_init == "pretrained" and resume is None:
        check_weight_files(mcfg, model_dir)
    return resume


# keys that do not change what a run computes: a rerun that differs only in them continues the run
NOT_IDENTITY = {"logging_steps", "save_steps", "save_only_model", "save_total_limit", "plot_loss", "report_to",
                "overwrite_output_dir", "overwrite_cache", "preprocessing_num_workers", "tiermem_server",
                "tiermem_cache_dir", "resume_from_checkpoint", "eval_strategy", "eval_steps",
                "per_device_eval_batch_size", "eval_dataset", "save_strategy", "logging_first_step", "logging_dir",
                "do_eval", "metric_for_best_model", "tiermem_dist_timeout", "tiermem_trust_old_checkpoints",
                # how the layers are computed, not what: the same math (kept graphs bit for bit; compiled kernels
                # to rounding)
                "tiermem_keep_activations", "torch_compile", "torch_compile_backend", "torch_compile_mode"}


def run_identity(cfg: TrainConfig, mcfg, dtype: torch.dtype, rows: Rows) -> str:
    """A digest of what the run computes: the model's tensors, the settings that change the math, the rows."""
    data = hashlib.sha256()
    for ids, labels in zip(rows.input_ids, rows.labels):
        data.update(np.asarray(ids, dtype=np.int64).tobytes())
        data.update(b"|" if labels is None else np.asarray(labels, dtype=np.int64).tobytes())
        data.update(b"\n")
    settings = {k: v for k, v in to_plain(cfg).items() if k not in NOT_IDENTITY}
    ident = {"model": ckpt.signature(mcfg), "dtype": str(dtype), "settings": settings, "data": data.hexdigest()}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _link_bytes(store) -> dict[str, int]:
    return {name: int(link.get("bytes", 0)) for name, link in store.mover.stats().items()}


def _disk_step(before: dict, now: dict, busy: float) -> tuple[int, int, float]:
    """What the disk did in a step: (bytes read, bytes written, seconds busy in either direction)."""
    moved = lambda links: sum(now.get(k, 0) - before.get(k, 0) for k in links)  # noqa: E731
    return moved(("nvme->dram", "nvme->gpu")), moved(("dram->nvme", "gpu->nvme")), busy


def _attach_line(session: Session) -> str:
    """What an attached run says at start: the service, whether it holds the run, how the update is split."""
    a, opt = session.attached, session.optimizer
    mine = [g for g in opt.groups if g in opt.mine]
    split = (f"this trainer's GPU updates {len(mine)} of {len(opt.groups)} groups ({_span(mine)}), the service "
             "the others" if mine else "the service updates every group")
    return (f"attached to the tiermem service at {a.client.path}"
            + (f" (its run is at step {a.committed})" if a.initialized else " (a new run)") + f"; {split}")


def _span(groups: list) -> str:
    """Groups named briefly: ``embed, 0-3, 5``."""
    parts, run = [], []
    for g in groups + [None]:
        if isinstance(g, int) and run and g == run[-1] + 1:
            run.append(g)
            continue
        if run:
            parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [g] if isinstance(g, int) else []
        if g is not None and not isinstance(g, int):
            parts.append(str(g))
    return ", ".join(parts)


def piece_rows(cfg: TrainConfig, store_plan=None) -> int | None:
    """Rows the GPU computes at once: the plan's (tiermem_physical_batch_size: auto, or the number it pins),
    else the pinned number, else None (each micro-batch as it is)."""
    if getattr(store_plan, "piece_rows", 0):
        return store_plan.piece_rows
    rows = cfg.tiermem_physical_batch_size
    return rows if rows != "auto" else None


def activation_budget(cfg: TrainConfig, store: Store, store_plan=None) -> int | None:
    """Bytes of boundary activations one layer-major pass may keep on the GPU: tiermem_activation_budget, the
    planner's (which chose the passes), or half the free HBM."""
    if cfg.tiermem_activation_budget != "auto":
        return cfg.tiermem_activation_budget
    if store_plan is not None:
        return store_plan.activation_budget
    dev = store.gpu.device
    if dev.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(dev)
    return int(free * 0.5)


def find_resume(cfg: TrainConfig, out: Path, named: dict | None = None, say=None) -> Path | None:
    """The checkpoint to resume from: ``resume_from_checkpoint``, else the one the service ``named`` (it lost
    the run's state, which lives on there: even with overwrite_output_dir), else (as LLaMA-Factory) the newest
    complete checkpoint in output_dir unless overwrite_output_dir is set. Refuses a non-empty output_dir
    that holds no checkpoint unless overwrite_output_dir is set. Says in one line why it does not take
    the named one."""
    if out.is_file():
        raise ConfigError(f"output_dir {out} is a file")
    above = out
    while not above.exists():
        above = above.parent
    if not above.is_dir():
        raise ConfigError(f"output_dir {out} cannot be made: {above} is a file")
    if not os.access(above, os.W_OK | os.X_OK):
        raise ConfigError(f"output_dir {out} cannot be written: {above} is not writable by this user")
    if named is None:
        return _own_choice(cfg, out, say)
    say = say or print
    path = Path(str(named.get("checkpoint")))
    lost = f"the service lost this run's state (step {named.get('step')}) and named {path} to resume from"
    if cfg.resume_from_checkpoint and Path(cfg.resume_from_checkpoint).resolve() != path.resolve():
        say(f"{lost}; resuming from {cfg.resume_from_checkpoint} instead, as resume_from_checkpoint says")
        return Path(cfg.resume_from_checkpoint)
    if (path / "checkpoint.json").is_file():
        say(f"{lost}: resuming from it" + (" (overwrite_output_dir is set, but the run's state is there)"
                                           if cfg.overwrite_output_dir else ""))
        return path
    fallback = _own_choice(cfg, out, say)
    say(f"{lost}, but it is no longer there; " + (f"resuming from {fallback}" if fallback else "starting from step 0"))
    return fallback


def _own_choice(cfg: TrainConfig, out: Path, say=None) -> Path | None:
    """find_resume without a checkpoint named by the service."""
    if cfg.resume_from_checkpoint:
        return Path(cfg.resume_from_checkpoint)
    if cfg.overwrite_output_dir or not out.is_dir():
        return None
    found = ckpt.checkpoints(out)
    if found:
        return found[-1][1]
    if interrupted_run(out):  # (what a run of this tool left when it stopped before a checkpoint: replaced)
        (say or print)(f"note: output_dir {out} holds only what a tiermem-train run that stopped before its first "
                       "checkpoint left: this run starts from step 0 and replaces it")
    elif any(not p.name.startswith(".checkpoint-") for p in out.iterdir()):
        raise ConfigError(f"output_dir {out} already exists and is not empty (and holds no checkpoint to resume); "
                          "set overwrite_output_dir: true or choose another output_dir")
    return None


def prepare_data(cfg: TrainConfig, mcfg, model_dir: Path, console: Console):
    """The training rows and the evaluation rows (or None), tokenized through the cache, with a bar."""
    say = lambda text: console.print(text, soft_wrap=True, highlight=False)

    def load(names: str, what: str) -> Rows:
        with _bar(console) as bar:
            task = bar.add_task(f"tokenizing {what}", total=None)
            rows = load_rows(names, cfg, mcfg, model_dir, lambda n: bar.advance(task, n),
                             lambda text: bar.update(task, description=f"tokenizing {what} ({text})"), say)
        say(f"{what}: {len(rows)} rows from {', '.join(rows.sources)}"
            + (" (from the cache)" if rows.from_cache else "")
            + (f"; {rows.dropped} dropped with nothing to predict" if rows.dropped else "")
            + (f"; {rows.skipped} bad rows skipped" if rows.skipped else ""))
        return rows

    rows = load(cfg.dataset, "training data")
    eval_rows = load(cfg.eval_dataset, "evaluation data") if cfg.eval_dataset else None
    if cfg.val_size > 0:
        rows, eval_rows = split_eval(rows, cfg.val_size, cfg.seed)
    return rows, eval_rows


LINES = "\n\t"  # the control characters dataset text keeps on the terminal: the example's lines, its tabs


def show_example(rows: Rows, model_dir: Path, say) -> None:
    """Print the first training example decoded, and the part of it that is trained (as LLaMA-Factory does)."""
    if not (Path(model_dir) / "tokenizer.json").is_file():
        return
    from trainer.data.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    ids, labels = rows.input_ids[0], rows.labels[0]
    trained = ids if labels is None else [t for t in labels if t != -100]
    # (as Text: the dataset's own text, "[" and ":" included, is not read as rich markup or emoji codes)
    say(Text(f"example input ({len(ids)} tokens):\n{printable(tok.decode(ids), keep=LINES)}"))
    say(Text(f"example trained part ({len(trained)} tokens):\n{printable(tok.decode(trained), keep=LINES)}"))


def evaluate(executor: Executor, rows: Rows, cfg: TrainConfig, mcfg, version: int, world: World | None = None) -> float:
    """Mean loss over every trained token of ``rows``, with the weights after ``version`` updates; the
    micro-batches go layer-major in groups of gradient_accumulation_steps (the activations of a step). Several
    ranks take every world-size-th micro-batch each and add up their sums."""
    bs, group = cfg.per_device_eval_batch_size, cfg.gradient_accumulation_steps
    mbs = [list(range(i, min(i + bs, len(rows)))) for i in range(0, len(rows), bs)]
    if world is not None and world.several:
        mbs = mbs[world.rank::world.size]
    total, count = 0.0, 0
    for g in range(0, len(mbs), group):
        batches = [collate([rows.input_ids[i] for i in idx], [rows.labels[i] for i in idx], _pad_id(mcfg))
                   for idx in mbs[g: g + group]]
        s, n = executor.evaluate(batches, version)
        total, count = total + s, count + n
    if world is not None and world.several:
        total, count = world.sum([total, count])
    return total / max(count, 1)


def _pad_id(mcfg) -> int:
    """The id padded positions take (any id of the vocabulary: they are masked out of the loss and of attention)."""
    pad = mcfg.pad_token_id
    return pad if pad is not None and 0 <= pad < mcfg.vocab_size else 0


def _describe_store(store: Store, say) -> None:
    by = store.plan.bytes_by_kind()
    parts = []
    for tier in ("gpu", "dram", "nvme"):
        kinds = by.get(tier) or {}
        if kinds:
            parts.append(f"{tier}: " + ", ".join(f"{k} {format_size(v)}" for k, v in kinds.items()))
    say("store: " + "; ".join(parts) + f"; {store.gpu.n_slots} GPU slots of {format_size(store.gpu.slot_bytes)}")


def _bar(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    console=console, transient=True)
