"""The run's state placed: the fit checked before any data is read (nothing timed, nothing allocated), the plan
made before the store opens and told in a few lines, and what a step takes from it (the bytes of boundary
activations a pass may keep, the rows the GPU computes at once)."""

from __future__ import annotations

import torch

from tiermem.plan.machine import Machine
from tiermem.plan.placement import make_plan
from tiermem.plan.resolve import compute_device
from trainer.config import activations_role
from trainer.model.weights import group_order
from trainer.planning import run_plan
from trainer.run.when import saves
from trainer.state import explicit_gpu_share, state_specs, store_config


def check_placement(cfg, mcfg, dtype: torch.dtype, ranks=None) -> None:
    """The state placed under the budgets as the run will place it (nothing allocated, no data read): a run
    that cannot fit is refused (BudgetError) first. The planner's fit does not depend on the compute's speed,
    so nothing is timed or measured here. ``ranks``: the run's (``trainer.parallel.ranks``; None: one process)."""
    scfg = store_config(cfg.tiermem) if ranks is None else ranks.store_config(cfg)
    device = compute_device(scfg)
    machine = Machine.h200("the fit check")
    if device.type == "cuda":
        machine.gpu_memory = torch.cuda.get_device_properties(device).total_memory
    shape = run_plan.Shape(cfg.micro_rows, cfg.cutoff_len, cfg.gradient_accumulation_steps, cfg.pair_rows)
    budgets = run_plan.local_budgets(scfg, mcfg, dtype, cfg.output_dir, saves(cfg))
    specs = state_specs(mcfg, dtype)
    hbm_state, taken, owners = (True, 0, None) if ranks is None else ranks.sharing(group_order(mcfg), specs)
    if run_plan.make(mcfg, dtype, scfg, shape, machine, device, cfg.loss_chunk_tokens, time_it=False,
                     budgets=budgets, hbm_state=hbm_state, hbm_taken=taken, owners=owners,
                     piece_rows=cfg.tiermem_physical_batch_size, activations=activations_role(cfg)) is None:
        make_plan(specs, scfg, streamed_kinds=("param",), owners=owners)  # every kind pinned


def step_shape(job) -> run_plan.Shape:
    """The first step's micro-batches as the planner sees them: rows x padded tokens, and how many."""
    cfg = job.cfg
    mbs = job.plan.rows_of_step(0) if job.total else [[0]]
    seq = max(max(len(job.rows.input_ids[r]) for r in job.rows.rows_of(idx)) for idx in mbs)
    return run_plan.Shape(cfg.micro_rows, seq, len(mbs), cfg.pair_rows)


def plan_run(job, scfg, say, hbm_state: bool = True, hbm_taken: int = 0, owners: dict | None = None):
    """The planner's plan for an embedded run (None when the placement pins every kind), told in a few lines
    (``hbm_state`` False: no state in HBM, as several hosts' stores; ``hbm_taken``: HBM taken besides, as several
    ranks' gradients in flight; ``owners``: several ranks of a host, each group's state in its owner's HBM)."""
    device = compute_device(scfg)
    machine = run_plan.machine_for(scfg, device)
    budgets = run_plan.local_budgets(scfg, job.mcfg, job.dtype, job.out, saves(job.cfg))
    plan = run_plan.make(job.mcfg, job.dtype, scfg, step_shape(job), machine, device, job.cfg.loss_chunk_tokens,
                         budgets=budgets, hbm_state=hbm_state, keep=job.cfg.tiermem_keep_activations,
                         hbm_taken=hbm_taken, owners=owners, piece_rows=job.cfg.tiermem_physical_batch_size,
                         activations=activations_role(job.cfg))
    if plan is not None:
        run_plan.keep_activations(plan, job.cfg.tiermem_keep_activations, job.mcfg)
        lines = run_plan.lines(plan)
        if explicit_gpu_share(scfg):  # the user's optimizer.gpu_share wins
            plan.gpu_updates = None
            lines = run_plan.lines(plan)
        # (placed by fixed figures on a CPU: a layout never turns on its load)
        if device.type != "cuda" and not scfg.probe:
            lines.append("plan: the prediction is for the H200 machine's figures (no GPU here and no probe file): the "
                         "CPU stand-in's steps take far longer, and its first steps correct it; `tiermem plan` "
                         "predicts with this machine's own figures")
        for line in lines:
            say(line)
    return plan


def piece_rows(cfg, store_plan=None) -> int | None:
    """Rows the GPU computes at once: the plan's (tiermem_physical_batch_size: auto, or the number it pins),
    else the pinned number, else None (each micro-batch as it is)."""
    if store_plan is not None and store_plan.piece_rows:
        return store_plan.piece_rows
    rows = cfg.tiermem_physical_batch_size
    return rows if rows != "auto" else None


def activation_budget(cfg, store, store_plan=None) -> int | None:
    """Bytes of boundary activations one layer-major pass may keep on the GPU: tiermem_activation_budget, the
    planner's (which chose the passes), or half the free HBM."""
    if cfg.tiermem_activation_budget != "auto":
        return cfg.tiermem_activation_budget
    if store_plan is not None:
        return store_plan.activation_budget
    dev = store.device
    if dev.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(dev)
    return int(free * 0.5)


def kept_layers(cfg, store_plan=None) -> int:
    """Decoder layers whose activations a step keeps: tiermem_keep_activations, or (auto) the plan's choice
    (without a plan, none)."""
    keep = cfg.tiermem_keep_activations
    if keep == "auto":
        return len(store_plan.keep or ()) if store_plan is not None else 0
    return keep


def activations_home(cfg, store_plan=None) -> tuple:
    """(host tier, n): the step's boundary activations 0..n-1 live in that tier (the plan's), the rest on the GPU;
    (None, 0): all on the GPU. tiermem_activations: dram with no plan to size the arena for them (every kind
    pinned) is refused in one line."""
    from tiermem.errors import ConfigError
    from tiermem.tiers import registry
    from tiermem.tiers.base import HOST

    if store_plan is not None and store_plan.act_host:
        return registry.primary(HOST), store_plan.act_host
    if activations_role(cfg) == HOST:
        raise ConfigError("tiermem_activations: dram is not supported yet without the planner's placement (every kind "
                          "pinned, several ranks, or a run attached to a service): leave a kind to the planner, or use "
                          "auto")
    return None, 0
