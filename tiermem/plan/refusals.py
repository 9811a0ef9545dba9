"""The planner's refusals: one line that says what the tiers hold, how much more the training state needs, and
every way to give it with its figure, for a run whose state or activations do not fit."""

from __future__ import annotations

import os
import shutil

from tiermem.plan.workload import Workload
from tiermem.sizes import format_size
from tiermem.tiers import registry
from tiermem.tiers.base import DEVICE, HOST, STORAGE


def disk_free(path) -> int | None:
    """Free bytes of the disk ``path`` (or its nearest existing parent) lies on; None when unknown."""
    try:
        where = os.path.abspath(os.path.expanduser(str(path)))
        while not os.path.isdir(where) and where != os.path.dirname(where):
            where = os.path.dirname(where)
        return shutil.disk_usage(where).free
    except (OSError, TypeError, ValueError):
        return None


def short_line(group_bytes: dict, budgets: dict, state_room: int, why: str, short: int = 0,
               tier: str | None = None, cfg=None, act: int = 0) -> str:
    """The refusal of a placement: what the tiers hold, how much more is needed (``short``: the shortfall the
    spill found, which counts DRAM's staging of storage-resident state; at least the state beyond the budgets),
    and every way to give it, each with its figure: a larger storage budget or another disk (``cfg``: the store's
    config, for the disk's free space; ``budgets["<tier>_free"]``: the planned machine's, when it is another), a
    larger DRAM budget, fewer activations in HBM (``act``: what a pass holds beside the state), a larger GPU
    budget where one is set. ``why``: ``host`` (DRAM is short and there is no
    storage tier), ``staging`` (DRAM is short of staging room), ``storage`` (the storage tier ``tier`` is over its
    budget) or ``export`` (its disk lacks the exported model's room)."""
    host, device, stores = registry.primary(HOST), registry.primary(DEVICE), registry.of_role(STORAGE)
    first = tier or (stores[0] if stores else None)
    label = lambda t: registry.tier_type(t).label  # noqa: E731
    total = sum(group_bytes.values())
    fits = {"HBM": max(state_room, 0), "DRAM": budgets.get(host), **{label(s): budgets.get(s) for s in stores}}
    have = sum(v for v in fits.values() if v)
    more = max(total - have, short, 0)
    held = ", ".join(f"{name} {format_size(v or 0)}" for name, v in fits.items() if name != "HBM")
    head = (f"the training state ({format_size(total)}) does not fit: HBM {format_size(fits['HBM'] or 0)} beside "
            f"the activations, {held}")
    if not more:
        return head + f": add to tiers.{host}.budget" + (f" or tiers.{first}.budget" if first else "")
    m = format_size(more)
    ways = []
    if why == "export":
        ways.append(f"an output_dir on another disk ({m} more room beside the weights kept on {label(first)} for the "
                    "exported model)")
    if why == "host" and first:
        ways.append(f"an {label(first)} tier of {m} or more (tiers.{first}: {{path: DIR}})")
    elif first and why != "staging":
        section = cfg.tiers.get(first) if cfg is not None else None
        where = getattr(section, "path", None)
        free = disk_free(where[0] if isinstance(where, list) else where) if where is not None else None
        has = f" (its disk has {format_size(free)} free)" if free is not None else ""
        if budgets.get(f"{first}_free") is not None:  # (planned for another machine: its disks', not this one's)
            has = f" (the planned machine's disks have {format_size(budgets[f'{first}_free'])})"
        ways.append(f"a tiers.{first}.budget {m} larger{has}"
                    + f", or a tiers.{first}.path on a disk with {format_size((budgets.get(first) or 0) + more)} free")
    stages = f" (DRAM stages each group's {label(first)} state on its way)" if why == "staging" and first else ""
    ways.append(f"a tiers.{host}.budget {m} larger{stages}")
    if act > more:
        ways.append(f"{m} fewer activations in HBM (a pass holds {format_size(act)}: a lower cutoff_len or "
                    "loss_chunk_tokens, fewer rows computed at once: tiermem_physical_batch_size)")
    if budgets.get(device) is not None:
        ways.append(f"a tiers.{device}.budget {m} larger, where the GPU has it")
    return f"{head}; {m} more is needed, any one of: " + "; ".join(ways)


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
