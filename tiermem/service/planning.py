"""A service's run planned as an embedded run is: the trainer sends its step's workload (its layer timed on its
GPU) and the HBM its step may use; the service plans with its own machine figures and budgets, with no state in
HBM (the state must outlive the trainer's GPU memory), and answers with the plan so the trainer runs and
watches it (passes, activation budget, predicted step).

    plan, share, told = plan_run(specs, plan_cfg, raw_cfg, msg["plan"], machine)   # or None: the fixed rule
"""

from __future__ import annotations

import copy
import dataclasses

from tiermem.config import StoreConfig
from tiermem.plan.machine import Machine, machine_for
from tiermem.plan.placement import Plan, default_budgets
from tiermem.plan.planner import plan_step
from tiermem.plan.resolve import compute_device
from tiermem.plan.workload import Workload
from tiermem.service.requests import RequestError
from tiermem.specs import TensorSpec
from tiermem.tiers import registry
from tiermem.tiers.base import DEVICE

# the service's crash-safe CPU AdamW (out of place, or in place behind an undo copy) against plain fused
# AdamW on the same cores: 0.26-0.38x measured on the H200 host (docs/measurements.md, tools/bench_optim.py)
CRASH_SAFE_CPU = 0.37


def service_machine(cfg: StoreConfig) -> Machine:
    """The figures the service plans with, found as a training run finds its own (``machine_for``): its
    config's ``probe`` file; else a quick probe where it computes on CUDA; else assumed."""
    return machine_for(cfg, compute_device(cfg))


def plan_run(specs: list[TensorSpec], plan_cfg: StoreConfig, raw_cfg: StoreConfig, asked,
             machine) -> tuple[Plan, float, dict] | None:
    """The planner's plan of a new run from the trainer's ``asked`` ({workload, hbm_room}); None where the
    service places by its fixed rule (no workload sent, or a placement that pins every kind). ``machine`` is
    called for the figures (measured once, when first needed). Returns the plan, the share of groups the
    trainer's GPU worker updates, and what the trainer is told."""
    if asked is None:
        return None
    pins = plan_cfg.pins()
    if all(s.kind in pins for s in specs):
        return None
    if not isinstance(asked, dict):
        raise RequestError("'plan' must be an object: {workload, hbm_room}")
    try:
        w = Workload.from_json(asked.get("workload"))
    except ValueError as e:
        raise RequestError(str(e)) from None
    room = asked.get("hbm_room")
    if not (isinstance(room, int) and not isinstance(room, bool) and 0 < room < 1 << 50):
        raise RequestError("'plan.hbm_room' must be the bytes of HBM the trainer's step may use")
    groups = {s.group for s in specs}
    if set(w.groups) != groups:
        raise RequestError("the workload's groups are not the specs' groups")
    cuda = compute_device(plan_cfg).type == "cuda"
    budgets = {**default_budgets(plan_cfg), registry.primary(DEVICE): room}
    base = machine()  # (the service's CPU AdamW writes out of place or behind an undo copy)
    m = dataclasses.replace(base, assumed=list(base.assumed), cpu_adamw=base.cpu_adamw * CRASH_SAFE_CPU)
    cfg = copy.deepcopy(plan_cfg)  # (the service's own store has no slots; its trainer streams through these)
    cfg.tiers.device_tier.slots = raw_cfg.tiers.device_tier.slots
    plan = plan_step(specs, cfg, w, m, budgets, cuda=False, hbm_state=False, gpu_worker=cuda)
    explicit = raw_cfg.optimizer.gpu_share is not None
    # (no state in HBM: every group streams, and the planner's split is a share of them all)
    share = plan_cfg.optimizer.gpu_share if explicit or not cuda else len(plan.gpu_updates) / len(w.groups)
    told = {"where": [[g, k, t] for (g, k), t in plan.where.items()],
            "gpu_updates": None if explicit else sorted(plan.gpu_updates, key=str),
            "passes": plan.passes, "activation_budget": plan.activation_budget,
            "activation_bytes": plan.activation_bytes, "hbm_room": plan.hbm_room, "machine": m.to_json()}
    return plan, share, told
