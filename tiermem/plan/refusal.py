"""The planner's refusal of a run that does not fit: what the training state needs, what each tier gives it, and
every way out with its figure (a larger DRAM or NVMe budget, another disk, fewer activations in HBM, a larger GPU
budget), in one line."""

from __future__ import annotations

import shutil

from tiermem.config import StoreConfig
from tiermem.sizes import format_size


def disk_free(path: str) -> int | None:
    """Free bytes of the disk ``path`` (or its nearest existing parent) lies on; None when unknown."""
    from tiermem.plan.placement import existing_parent

    try:
        return shutil.disk_usage(existing_parent(str(path))).free
    except OSError:
        return None


def line(total: int, fits: dict, more: int, tier: str, cfg: StoreConfig, act: int = 0, gpu_budget=None) -> str:
    """One line: the state (``total``) does not fit in what the tiers give it (``fits``: tier -> bytes), ``more``
    is needed (``tier``: where the spill found the shortfall: dram, nvme, staging or export); ``act``: the HBM the
    activations of a pass take beside the state; ``gpu_budget``: tiers.gpu.budget, where it is set."""
    head = (f"the training state ({format_size(total)}) does not fit: HBM {format_size(fits['gpu'] or 0)} beside "
            f"the activations, DRAM {format_size(fits['dram'] or 0)}, NVMe {format_size(fits['nvme'] or 0)}")
    if not more:
        return head
    m = format_size(more)
    ways = []
    if tier == "export":
        ways.append(f"an output_dir on another disk ({m} more room beside the weights kept on NVMe for the exported "
                    "model)")
    nvme = cfg.tiers.nvme
    if nvme is None:
        ways.append(f"an NVMe tier of {m} or more (tiers.nvme: {{path: DIR}})")
    elif tier != "staging":
        free = disk_free(nvme.path)
        have = fits["nvme"] or 0
        ways.append(f"a tiers.nvme.budget {m} larger" + (f" (its disk has {format_size(free)} free)"
                                                        if free is not None else "")
                    + f", or a tiers.nvme.path on a disk with {format_size(have + more)} free")
    staging = " (DRAM stages each group's NVMe state on its way)" if tier == "staging" else ""
    ways.append(f"a tiers.dram.budget {m} larger{staging}")
    if act > more:
        ways.append(f"{m} fewer activations in HBM (a pass holds {format_size(act)}: a lower cutoff_len, "
                    "per_device_train_batch_size or tiermem_physical_batch_size)")
    if gpu_budget is not None:
        ways.append(f"a tiers.gpu.budget {m} larger, where the GPU has it")
    return f"{head}; {m} more is needed, any one of: " + "; ".join(ways)
