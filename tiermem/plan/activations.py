"""Boundary activations as a placed kind (issue 39): where a step's layer inputs live, HBM or the host tier, chosen
by the planner with the state.

A step keeps each layer's input for the backward's recompute (a boundary activation: tokens of a pass x hidden x
the compute dtype's bytes). On the GPU they compete with the state for HBM; the first layers' may instead live in
the host tier (the DRAM arena: ``tiermem.store.scratch``), written out as the forward leaves a layer and read back
one layer ahead of its backward, competing with the state for DRAM. The planner tries layouts with some of them
there where one pass does not hold them on the GPU (fewer passes, or a row too long for HBM at all); the cost
model counts their copies on the link each way (``costmodel``: ``Layout.act_host``).
"""

from __future__ import annotations

from tiermem.errors import BudgetError
from tiermem.plan.costmodel import Layout
from tiermem.plan.placement import Plan
from tiermem.plan.workload import Workload
from tiermem.tiers.base import DEVICE, HOST

EXTENT_ALIGN = 4096  # (an extent of the host tier is a multiple of it: tiermem.tiers.extents)
SLACK = 0.03


def host_counts(w: Workload, activations: str, possible: bool) -> list[int]:
    """Numbers of boundary activations (the first layers' inputs) to try in the host tier: ``gpu`` none; ``dram``
    every one but the last layer's output (the loss's input, used at once); ``auto`` none, then (tried where one
    pass does not hold them on the GPU) a quarter, a half, three quarters and all of them. ``possible`` False
    (several ranks, a service's run): none."""
    n = len(w.layers)
    if activations == DEVICE or not possible or not n:
        return [0]
    if activations == HOST:
        return [n]
    return [0, *sorted({max(1, n * q // 4) for q in (1, 2, 3)} - {n}), n]


def host_activation_bytes(w: Workload, passes: int, host: int) -> int:
    """Room in the host tier for the boundaries 0..``host``-1 of a pass: each micro-batch's extent aligned, and
    ``SLACK`` more (a later step's rows are cut into passes by the same bytes, but its extents may not fall in
    the holes the last pass left)."""
    if not host:
        return 0
    per_pass = -(-w.micro_batches // passes)
    return host * (int(w.layer_boundary_bytes(passes) * (1 + SLACK)) + per_pass * EXTENT_ALIGN)


def candidates(w: Workload, passes: list, hosts: list, one_pass: list, kept_from, keep_counts):
    """The layouts ``plan_step`` tries: (passes, layers given HBM for kept graphs, whether leftover HBM keeps more,
    boundary activations in the host tier). The passes without kept graphs, with activations in the host tier
    where one pass (``one_pass``, filled as the layouts are placed) does not hold them on the GPU; then kept
    graphs at the chosen layout's passes (``kept_from()``: it, or None; ``keep_counts``: how many), which
    they never add to."""
    for p in passes:
        for h in hosts:
            if not h or not one_pass:
                yield p, 0, False, h
    chosen = kept_from()
    if chosen is not None and not chosen.act_host:
        for k in keep_counts(w, True):
            yield chosen.passes, k, True, 0


def set_host_activations(plan: Plan, w: Workload, layout: Layout) -> None:
    """The plan's boundary activations in the host tier (``layout.act_host``), the room they take there, and the
    bytes of boundaries a pass may keep as the executor counts them (all of them: DRAM holds its share)."""
    if layout.act_host:
        plan.act_host, plan.act_host_bytes = layout.act_host, host_activation_bytes(w, layout.passes, layout.act_host)
        plan.activation_budget = w.layer_boundary_bytes(layout.passes) * (len(w.layers) + 1)


def host_budgets(budgets: dict, host: str, act_host: int) -> dict | None:
    """The budgets the state is placed in beside ``act_host`` bytes of activations in the host tier; None when they
    alone are more than its budget."""
    if not act_host or budgets.get(host) is None:
        return budgets
    return {**budgets, host: budgets[host] - act_host} if budgets[host] >= act_host else None


def not_on_nvme(err: BudgetError, tried: int) -> BudgetError:
    """The planner's refusal, saying (where layouts with boundary activations in the host tier were tried:
    ``tried``) that they do not go to NVMe yet."""
    if not tried:
        return err
    return BudgetError(f"{err} (boundary activations in DRAM were tried too; on NVMe they are not supported yet)")
