"""Where every tensor of a store lives, as JSON, and stores rebuilt from it over existing memory.

The service and its trainer share one DRAM arena (a file) and the NVMe files. The service decides the
layout (tier, offset, length of every tensor), records it with its run and sends it to the trainer; both
then build a ``Store`` over the same bytes:

- ``create_store``: the service's store for a new run (new arena and files, sized to the plan);
- ``reopen_store``: the service's store after a restart, over the arena and files left behind;
- ``attach_store``: a trainer's store over the service's arena and files plus its own GPU slots.

Specs arriving from another process are checked here (names, shapes, dtypes, kinds, groups), since a
malformed one must be refused with a message, never crash the service.
"""

from __future__ import annotations

import math

import torch

from tiermem.config import KINDS, StoreConfig
from tiermem.plan.placement import Plan, default_budgets
from tiermem.sizes import align_up
from tiermem.specs import TensorSpec
from tiermem.store.store import Store
from tiermem.tiers.dram import HEADER, DramArena
from tiermem.tiers.extents import Extent, ExtentAllocator
from tiermem.tiers.gpu import ALIGN as GPU_ALIGN
from tiermem.tiers.gpu import GpuTier
from tiermem.tiers.nvme import NvmeTier

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_NAME = 512


def spec_to_json(s: TensorSpec) -> dict:
    return {"name": s.name, "shape": list(s.shape), "dtype": str(s.dtype).removeprefix("torch."), "kind": s.kind,
            "group": s.group}


def spec_from_json(d) -> TensorSpec:
    """A spec from untrusted JSON; ValueError with a one-line reason when it is malformed."""
    if not isinstance(d, dict):
        raise ValueError("a tensor spec must be an object")
    name, shape, dtype, kind, group = (d.get(k) for k in ("name", "shape", "dtype", "kind", "group"))
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
        raise ValueError(f"bad tensor name {str(name)[:80]!r}")
    if not isinstance(shape, list) or len(shape) > 8 or not all(isinstance(n, int) and 0 <= n < 1 << 40
                                                                   for n in shape):
        raise ValueError(f"{name}: bad shape {str(shape)[:80]}")
    if math.prod(shape) >= 1 << 40:
        raise ValueError(f"{name}: shape {shape} is too large")
    if dtype not in DTYPES:
        raise ValueError(f"{name}: unknown dtype {str(dtype)[:40]!r}")
    if kind not in KINDS:
        raise ValueError(f"{name}: unknown kind {str(kind)[:40]!r}")
    if isinstance(group, bool) or not isinstance(group, (int, str)) or (isinstance(group, str) and len(group) > 64):
        raise ValueError(f"{name}: bad group {str(group)[:40]!r}")
    return TensorSpec(name, tuple(shape), DTYPES[dtype], kind, group)


def layout_of(store: Store, group=None) -> dict[str, list]:
    """name -> [tier, offset, nbytes] for every tensor of the store (of one group)."""
    entries = store.catalog.entries() if group is None else [
        e for k in KINDS for e in store.catalog.group_entries(group, k)]
    return {e.spec.name: [e.tier, e.extent.offset, e.extent.nbytes] for e in entries}


def nvme_description(nvme: NvmeTier | None, tier_cfg, chosen: bool = False) -> dict | None:
    """What another process needs to map an NVMe tier's file (``attach_store``'s ``nvme``), from the tier and
    its config (``tiers.nvme``); the backend as configured, or (``chosen``) the one the tier chose. None
    without an NVMe tier."""
    if nvme is None:
        return None
    return {"dir": str(tier_cfg.path), "capacity": nvme.capacity,
            "backend": nvme.backend_name if chosen else tier_cfg.backend, "threads": tier_cfg.threads,
            "io_chunk": tier_cfg.io_chunk, "direct": tier_cfg.direct}


def apply_layout(catalog, layout: dict[str, list]) -> None:
    """Point the catalog's entries at the places ``layout`` gives (names it lacks are left alone): a trainer
    following the service's out-of-place updates and re-placements."""
    for name, (tier, offset, nbytes) in layout.items():
        if name in catalog:
            e = catalog[name]
            if (e.tier, e.extent.offset) != (tier, offset):
                e.tier, e.extent = tier, Extent(int(offset), int(nbytes))


def _over(cfg: StoreConfig, specs: list[TensorSpec], layout: dict[str, list], tiers: tuple) -> Store:
    """A store over existing tiers with every spec at its recorded place (extents reserved, bytes valid).
    It keeps the files when closed: a reopened service store until its recovery is done (a failure must
    not delete the state), an attached trainer's always (the state is the service's)."""
    store = Store(cfg, {}, plan=_plan_of(specs, layout, cfg), tiers=tiers)
    store.keep_files = True
    try:
        for s in specs:
            tier, offset, nbytes = layout[s.name]
            extent = Extent(int(offset), int(nbytes))
            store.tier(tier).allocator.reserve(extent)
            store.catalog.add(s, tier, extent).valid = True
    except BaseException:
        store.close()
        raise
    return store


def _plan_of(specs: list[TensorSpec], layout: dict[str, list], cfg: StoreConfig) -> Plan:
    where, group_bytes = {}, {}
    for s in specs:
        where[(s.group, s.kind)] = layout[s.name][0]
        group_bytes[(s.group, s.kind)] = group_bytes.get((s.group, s.kind), 0) + layout[s.name][2]
    return Plan(where, group_bytes, 0, 0, 0, default_budgets(cfg))


def create_store(cfg: StoreConfig, specs: list[TensorSpec], plan: Plan, extra_dram: int, extra_nvme: int = 0) -> Store:
    """The service's store for a new run: the arena sized to ``plan`` (+ ``extra_dram``), the NVMe file to
    its budget when one is set (room to move optimizer state there later), else to the plan (+ ``extra_nvme``).
    The arena is pinned when the config's GPU device is CUDA."""
    need = plan.need()
    nvme = need["nvme"] + extra_nvme if need["nvme"] else 0
    if cfg.tiers.nvme is not None and cfg.tiers.nvme.budget is not None:
        nvme = max(nvme, cfg.tiers.nvme.budget)
    store = Store(cfg, {"gpu": 0, "dram": need["dram"] + extra_dram, "nvme": nvme}, plan=plan)
    return store.create_all(specs, plan.where)


def reopen_store(cfg: StoreConfig, specs: list[TensorSpec], layout: dict[str, list], nvme_capacity: int) -> Store:
    """The service's store over the arena and NVMe file a previous service process left behind."""
    name, t = cfg.store_name(), cfg.tiers
    device = torch.device(t.gpu.device)
    dram = DramArena.reopen(name, t.dram.path, pin=device.type == "cuda")
    nvme = gpu = None
    try:
        if nvme_capacity:
            nvme = NvmeTier(t.nvme.path, name, nvme_capacity, t.nvme.backend, t.nvme.threads, t.nvme.io_chunk,
                            t.nvme.direct, reopen=True)
        gpu = GpuTier(device, 0, 0, 0)
    except BaseException:
        dram.close(remove=False)
        raise
    return _over(cfg, specs, layout, (gpu, dram, nvme))


def attach_store(cfg: StoreConfig, specs: list[TensorSpec], layout: dict[str, list], arena: dict,
                 nvme: dict | None, device: torch.device, n_slots: int,
                 resident: list[TensorSpec] = ()) -> Store:
    """A trainer's store: the service's arena and NVMe file mapped here, GPU slots of its own, and (``resident``)
    tensors of its own in its HBM (a rank's share of the host's HBM-resident state; invalid until written).

    Closing it unmaps and never removes anything: the state belongs to the service.
    """
    dram = DramArena.attach(arena["name"], arena["dir"], pin=device.type == "cuda")
    dram.allocator = ExtentAllocator(dram.size - HEADER, 4096, base=HEADER)
    nvme_tier = gpu = None
    try:
        if nvme is not None:
            nvme_tier = NvmeTier(nvme["dir"], arena["name"], nvme["capacity"], nvme["backend"], nvme["threads"],
                                 nvme["io_chunk"], nvme["direct"], reopen=True)
        per_group: dict = {}
        for s in specs:
            if s.kind == "param":
                per_group[s.group] = per_group.get(s.group, 0) + align_up(s.nbytes, GPU_ALIGN)
        slot = max(per_group.values(), default=0)
        gpu = GpuTier(device, sum(align_up(s.nbytes, GPU_ALIGN) for s in resident), slot, n_slots)
    except BaseException:
        if nvme_tier is not None:
            nvme_tier.close(remove=False)
        dram.close(remove=False)
        raise
    store = _over(cfg, specs, layout, (gpu, dram, nvme_tier))
    try:
        for s in resident:
            store.create(s, "gpu")
    except BaseException:
        store.close()
        raise
    return store
