"""A service's run planned as an embedded run is: the trainer sends its step's workload (its layer timed on its
GPU) and the HBM its step may use; the service plans with its own machine figures and budgets, with HBM as a tier
(the state placed there lives in the service's own block, which its trainer maps: ``tiermem.service.hbm``), and
answers with the plan so the trainer runs and watches it (passes, activation budget, predicted step). HBM is
counted for what a service's run needs there beside an embedded run's: room for two groups' new state (updates
are out of place, as in DRAM) and the service's own CUDA context; with ``durability: step`` the gradients live in
DRAM and each update's new state in HBM is copied there (the link's cost counted). Where the trainer asks
(``keep``: its tiermem_keep_activations is auto), the layers that keep their forward's activations are chosen with
the placement, as an embedded run's are, and told (``keep``). Several ranks attached to one service are planned as an
embedded run's ranks are (``owners``): a group's state but its compute copy in its owner's HBM (the part of the
service's HBM on that rank's GPU, ``tiermem.tiers.hbm_parts``), within each rank's room.

    plan, share, told = plan_run(specs, plan_cfg, raw_cfg, msg["plan"], machine)   # or None: the fixed rule
"""

from __future__ import annotations

import copy
import dataclasses
import statistics

from tiermem.config import StoreConfig
from tiermem.errors import BudgetError
from tiermem.plan.costmodel import predict
from tiermem.plan.machine import Machine, machine_for
from tiermem.plan.placement import Plan, default_budgets
from tiermem.plan.planner import TIE, layout_of, plan_step, resplit
from tiermem.plan.resolve import compute_device
from tiermem.plan.workload import Workload
from tiermem.service.requests import RequestError
from tiermem.sizes import align_up
from tiermem.specs import MOMENTS, TensorSpec
from tiermem.tiers import registry
from tiermem.tiers.base import DEVICE, HOST

# the service's crash-safe CPU AdamW (out of place, or in place behind an undo copy) against plain fused
# AdamW on the same cores: 0.26-0.38x measured on the H200 host (docs/measurements.md, tools/bench_optim.py)
CRASH_SAFE_CPU = 0.37
# HBM the service's own CUDA context and allocator take on the trainer's GPU beside its block (its trainer's room,
# measured in the trainer's process, does not see them), and the block's slack for new state (runs.SLACK_CAP)
SERVICE_CONTEXT = 1 << 30
SPLIT_AFTER = 2  # the service's own updates measured before its split is tried again at their rate
SPLIT_OFF = 0.1  # ... when they took this much longer or shorter than planned


def service_machine(cfg: StoreConfig) -> Machine:
    """The figures the service plans with, found as a training run finds its own (``machine_for``): its
    config's ``probe`` file; else a quick probe where it computes on CUDA; else assumed."""
    return machine_for(cfg, compute_device(cfg))


def check_hbm_plan(where: dict, owners: dict | None) -> None:
    """Refuse, in one line, the compute copy in HBM for a run of several ranks (``owners``; ``where``: a plan's
    (group, kind) -> tier, or pins' kind -> tier): every rank's forward reads every group's, and each rank maps its
    own part of the service's HBM only."""
    on = [k[1] if isinstance(k, tuple) else k for k, t in where.items() if t == registry.primary(DEVICE)]
    if owners is not None and "param" in on:
        raise RequestError(f"the compute copy (param) in HBM ({registry.primary(DEVICE)}) for several ranks attached "
                           "to one service is not supported yet: every rank reads every group's; place param on "
                           "the arena or NVMe in the service's config")


def new_state_room(specs: list[TensorSpec], has_master: bool) -> int:
    """HBM for two groups' new state beside the plan's (the trainer's and the service's GPU workers write a group's
    update out of place): twice the largest group's weights and moments."""
    kinds = ("master" if has_master else "param", *MOMENTS)
    align, per = registry.tier_type(registry.primary(DEVICE)).alignment, {}
    for s in specs:
        if s.kind in kinds:
            per[s.group] = per.get(s.group, 0) + align_up(s.nbytes, align)
    return 2 * max(per.values(), default=0)


def plan_run(specs: list[TensorSpec], plan_cfg: StoreConfig, raw_cfg: StoreConfig, asked,
             machine, owners: dict | None = None, cuda: bool | None = None) -> tuple[Plan, float, dict] | None:
    """The planner's plan of a new run from the trainer's ``asked`` ({workload, hbm_room, keep}); None where the
    service places by its fixed rule (no workload sent, or a placement that pins every kind). ``machine`` is
    called for the figures (measured once, when first needed); ``owners`` (several ranks: group -> rank): each
    rank's groups' state in its own HBM, each rank's room the trainer's; ``cuda``: plan for a service on a CUDA GPU
    (None: whether the config's device is one; True on another machine: what a service there would plan). Returns
    the plan, the share of groups the trainers' GPU workers update, and what the trainer is told."""
    if asked is None:
        return None
    pins = plan_cfg.pins()
    check_hbm_plan(pins, owners)
    if all(s.kind in pins for s in specs):
        return None
    if not isinstance(asked, dict):
        raise RequestError("'plan' must be an object: {workload, hbm_room, keep}")
    try:
        w = Workload.from_json(asked.get("workload"))
    except ValueError as e:
        raise RequestError(str(e)) from None
    room = asked.get("hbm_room")
    if not (isinstance(room, int) and not isinstance(room, bool) and 0 < room < 1 << 50):
        raise RequestError("'plan.hbm_room' must be the bytes of HBM the trainer's step may use")
    more = asked.get("taken", 0)  # (several ranks: HBM a rank's step takes beside, the gradients in flight)
    if not (type(more) is int and 0 <= more < 1 << 50):
        raise RequestError("'plan.taken' must be the bytes of HBM a rank's step takes beside the plan's")
    keep = asked.get("keep", False)  # (a trainer of an earlier version does not ask: none kept, as it ran then)
    if type(keep) is not bool:
        raise RequestError("'plan.keep' must be true (the planner chooses the layers that keep their activations) "
                           "or false")
    groups = {s.group for s in specs}
    if set(w.groups) != groups:
        raise RequestError("the workload's groups are not the specs' groups")
    cuda = compute_device(plan_cfg).type == "cuda" if cuda is None else cuda
    capped = raw_cfg.tiers.device_tier.budget if raw_cfg.tiers.device_tier is not None else None
    # (the service's tiers.gpu.budget, where set, caps the HBM the trainer's step may use)
    budgets = {**default_budgets(plan_cfg), registry.primary(DEVICE): room if capped is None else min(room, capped)}
    base = machine()
    cfg = copy.deepcopy(plan_cfg)  # (the service's own store has no slots; its trainer streams through these)
    cfg.tiers.device_tier.slots = raw_cfg.tiers.device_tier.slots
    step = raw_cfg.durability == "step"
    if step and "grad" not in pins:  # (the redo of an update a crash cut short needs its gradient)
        cfg.placement = {**(cfg.placement if isinstance(cfg.placement, dict) else {}), "grad": registry.primary(HOST)}
    has_master = any(s.kind == "master" for s in specs)
    taken = new_state_room(specs, has_master) + (SERVICE_CONTEXT if cuda else 0) + more
    # (boundary activations on the GPU only: the trainer keeps them in its own memory, and the arena it maps is the
    # service's, with no room of the trainer's for them)
    try:
        # the service's CPU AdamW runs in place where its crash loses the run's state anyway (state in HBM under
        # durability: checkpoint, ``tiermem.service.hbm.lost_with_service``), else crash-safe: out of place or
        # behind an undo copy, slower; a plan for the fast one that keeps nothing in HBM is made again for the other
        for fast in ([True, False] if not step else [False]):
            m = base if fast else dataclasses.replace(base, assumed=list(base.assumed),
                                                      cpu_adamw=base.cpu_adamw * CRASH_SAFE_CPU)
            plan = plan_step(specs, cfg, w, m, budgets, cuda=False, hbm_state=True, gpu_worker=cuda, hbm_taken=taken,
                             write_through=step, keep_auto=keep, activations=DEVICE, owners=owners)
            if registry.primary(DEVICE) in plan.where.values():
                break
    except BudgetError as e:
        raise BudgetError(f"{e} (an attached run keeps its boundary activations in HBM: in DRAM they are not "
                          "supported yet with a service; tiermem-train without tiermem_server places them there)") \
            from None
    explicit = raw_cfg.optimizer.gpu_share is not None
    # (the planner's split is a share of every group, those in HBM included: the GPU worker updates them)
    share = plan_cfg.optimizer.gpu_share if explicit or not cuda else len(plan.gpu_updates) / len(w.groups)
    told = {"where": [[g, k, t] for (g, k), t in plan.where.items()],
            "gpu_updates": None if explicit else sorted(plan.gpu_updates, key=str),
            "passes": plan.passes, "activation_budget": plan.activation_budget,
            "activation_bytes": plan.activation_bytes, "hbm_room": plan.hbm_room, "machine": m.to_json(),
            "write_through": step, "keep": sorted(plan.keep)}
    return plan, share, told


def split_again(plan: Plan, cpu_seen: list[float]) -> set | None:
    """The groups the trainer's GPU worker should update (those with state in HBM among them) for ``plan``'s
    placement at the rate the service's CPU worker measured (``cpu_seen``: its seconds of AdamW and compute copy in
    each of its updates), where that rate is more than SPLIT_OFF off the plan's: the split ``resplit`` finds at it
    (of near-equal ones, the CPU's largest share), when it is predicted no slower than the plan's split at that rate
    (streaming a group's state through the GPU worker costs more beside the forward than the cost model counts).
    None: keep the split (too few updates seen, the rate as planned, or nothing better)."""
    planned = plan.prediction.busy.get("cpu", 0.0)
    if len(cpu_seen) < SPLIT_AFTER or planned <= 0:
        return None
    slower = statistics.median(cpu_seen[-SPLIT_AFTER:]) / planned
    if abs(slower - 1) <= SPLIT_OFF:
        return None
    m = dataclasses.replace(plan.machine, cpu_adamw=plan.machine.cpu_adamw / slower,
                            cpu_copy=plan.machine.cpu_copy / slower)
    found = resplit(plan, plan.workload, m)
    if found is None or found[0] == set(plan.gpu_updates):
        return None
    now = predict(layout_of(plan), plan.workload, m, plan.group_bytes, plan.params)
    return set(found[0]) if found[1].step <= now.step * (1 + TIE) else None
