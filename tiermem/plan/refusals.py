"""The planner's refusals: one line that says what the tiers hold, how much more the training state needs, and
what to add, for a run whose state or activations do not fit."""

from __future__ import annotations

from tiermem.plan.workload import Workload
from tiermem.sizes import format_size
from tiermem.tiers import registry
from tiermem.tiers.base import DEVICE, HOST, STORAGE


def short_line(group_bytes: dict, budgets: dict, state_room: int, why: str, short: int = 0,
               tier: str | None = None) -> str:
    """The refusal of a placement: what the tiers hold and how much more is needed (``short``: the shortfall the
    spill found, which counts DRAM's staging of storage-resident state; at least the state beyond the budgets).
    ``why``: ``host`` (DRAM is short and there is no storage tier), ``staging`` (DRAM is short of staging room),
    ``storage`` (the storage tier ``tier`` is over its budget) or ``export`` (its disk lacks the exported
    model's room)."""
    host, stores = registry.primary(HOST), registry.of_role(STORAGE)
    first = stores[0] if stores else None
    label = lambda t: registry.tier_type(t).label  # noqa: E731
    total = sum(group_bytes.values())
    fits = {"HBM": max(state_room, 0), "DRAM": budgets.get(host), **{label(s): budgets.get(s) for s in stores}}
    have = sum(v for v in fits.values() if v)
    more = max(total - have, short, 0)
    what = {"host": f"an {label(first)} tier (tiers.{first}: {{path: DIR}}) or a larger tiers.{host}.budget"
                    if first else f"a larger tiers.{host}.budget",
            "storage": f"a larger tiers.{tier}.budget or disk",
            "staging": f"a larger tiers.{host}.budget (DRAM stages each group's {label(tier or first)} state on its "
                       "way)" if first else "",
            "export": f"disk for the exported model beside the weights kept on {label(tier or first)}, a larger "
                      f"tiers.{host}.budget, or an output_dir on another disk" if first else ""}[why]
    held = ", ".join(f"{name} {format_size(v or 0)}" for name, v in fits.items() if name != "HBM")
    return (f"the training state ({format_size(total)}) does not fit: HBM {format_size(fits['HBM'] or 0)} beside the "
            f"activations, {held}" + (f"; {format_size(more)} more is needed" if more else "") + f": add {what}")


def does_not_fit(total: int, room: int, w: Workload, budgets: dict, partials: int = 0) -> str:
    """The refusal when no number of passes leaves room: the activations of a pass, or the state."""
    act = w.activation_bytes(w.micro_batches)  # (a pass of one micro-batch: the least a step may hold)
    extra = partials if w.micro_batches > 1 else 0
    if act > room:
        return (f"one micro-batch's activations ({format_size(act)}) do not fit in the GPU's "
                f"{format_size(max(room, 0))}: lower per_device_train_batch_size or cutoff_len")
    if act + extra > room:
        return (f"a pass of one micro-batch needs {format_size(act + extra)} of HBM (its activations "
                f"{format_size(act)}, and the largest group's gradient partial sums {format_size(extra)}, read back "
                f"on each pass after the first) and the GPU has {format_size(max(room, 0))}: raise "
                f"tiers.{registry.primary(DEVICE)}.budget, or lower per_device_train_batch_size or cutoff_len")
    host, stores = registry.primary(HOST), registry.of_role(STORAGE)
    tiers = [f"DRAM ({format_size(budgets.get(host) or 0)})"]
    tiers += [f"{registry.tier_type(s).label} ({format_size(budgets.get(s) or 0)})" for s in stores]
    return f"the training state ({format_size(total)}) does not fit in HBM, " + ", ".join(tiers[:-1]) + \
        f" and {tiers[-1]}"
