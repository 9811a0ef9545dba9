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

from tiermem.config import StoreConfig
from tiermem.plan.placement import Plan, default_budgets
from tiermem.sizes import align_up
from tiermem.specs import KINDS, MOMENTS, TensorSpec
from tiermem.store.store import Store
from tiermem.tiers import registry
from tiermem.tiers.base import DEVICE, HOST, STORAGE, Making
from tiermem.tiers.extents import Extent

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


def shared_description(tier, section, chosen: bool = False) -> dict | None:
    """What another process needs to map a tier of a store (``attach_store``'s ``host`` and ``disk``), from the
    tier and its config section; (``chosen``) as the tier decided what its config left to it. None without
    the tier."""
    return None if tier is None else tier.describe(section, chosen)


def apply_layout(catalog, layout: dict[str, list]) -> None:
    """Point the catalog's entries at the places ``layout`` gives (names it lacks are left alone): a trainer
    following the service's out-of-place updates and re-placements."""
    for name, (tier, offset, nbytes) in layout.items():
        if name in catalog:
            e = catalog[name]
            if (e.tier, e.extent.offset) != (tier, offset):
                e.tier, e.extent = tier, Extent(int(offset), int(nbytes))


def _over(cfg: StoreConfig, specs: list[TensorSpec], layout: dict[str, list], tiers: dict) -> Store:
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


def _shared_tiers() -> tuple[str, str]:
    """The tiers a service's store shares with its trainers: the host tier (the arena) and the first storage
    tier (the NVMe file)."""
    return registry.primary(HOST), registry.primary(STORAGE)


def device_bytes(specs: list[TensorSpec], where: dict) -> int:
    """Bytes the device tier needs for the specs ``where`` puts on it (each tensor's start aligned)."""
    dev = registry.primary(DEVICE)
    align = registry.tier_type(dev).alignment
    return sum(align_up(s.nbytes, align) for s in specs if where[(s.group, s.kind)] == dev)


def device_bytes_by_rank(specs: list[TensorSpec], where: dict, owners: dict, world: int) -> list[int]:
    """``device_bytes`` of each rank's groups (several ranks: a group's state in HBM lives on its owner's GPU)."""
    return [device_bytes([s for s in specs if owners[s.group] == r], where) for r in range(world)]


def create_store(cfg: StoreConfig, specs: list[TensorSpec], plan: Plan, extra_host: int, extra_disk: int = 0,
                 owner: dict | None = None, extra_device: int = 0, hbm=None, owners: dict | None = None,
                 world: int = 1) -> tuple[Store, list[int]]:
    """The service's store for a new run: the arena (the host tier) sized to ``plan`` (+ ``extra_host``), the NVMe
    file (the first storage tier's) to its budget when one is set (room to move optimizer state there later),
    else to the plan (+ ``extra_disk``), and the HBM the plan gives to state (+ ``extra_device``), laid on the block
    ``hbm(nbytes)`` hands out (the service's, which its trainer maps: ``tiermem.tiers.hbm_share``). The arena is
    pinned when the config's GPU device is CUDA; its header records ``owner`` (the service). A run of ``world``
    ranks (``owners``: group -> rank) keeps each rank's groups' HBM state on that rank's GPU, ``extra_device``
    beside each (``hbm.parts``: ``tiermem.tiers.hbm_parts``). Returns the store and the HBM's bytes by rank."""
    host, disk = _shared_tiers()
    cap = plan.need()
    on_device = device_bytes(specs, plan.where)
    cap[registry.primary(DEVICE)] = on_device + extra_device if on_device else 0
    cap[host] += extra_host
    cap[disk] = cap[disk] + extra_disk if cap[disk] else 0
    if cfg.tiers[disk] is not None and cfg.tiers[disk].budget is not None:
        cap[disk] = max(cap[disk], cfg.tiers[disk].budget)
    dev, block, parts = registry.primary(DEVICE), None, [cap[registry.primary(DEVICE)]]
    if cap[dev] and hbm is not None:
        if world > 1:
            parts = [n + extra_device if n else 0 for n in device_bytes_by_rank(specs, plan.where, owners, world)]
            block = hbm.parts(parts, owners)
            parts = list(block.sizes)
        else:
            block = hbm(cap[dev])
    store = Store(cfg, cap, plan=plan, owner=owner, block=block)
    return store.create_all(update_order(specs), plan.where), parts


def update_order(specs: list[TensorSpec]) -> list[TensorSpec]:
    """``specs`` in the order a service's new store lays them out: what an update leaves where it is first, then
    each group's weights and moments, which every update writes to new places, group by group. A group's old
    state then leaves one hole where it goes, which the next group of its shape fills; in the specs' order (each
    weight's param, master, gradient and moments side by side) it left holes between the tensors that stay, too
    small for the next group's and too many for the room the service keeps (two groups' new state: issue 43)."""
    moved = ("master" if any(s.kind == "master" for s in specs) else "param", *MOMENTS)
    groups: dict = {}
    for s in specs:
        if s.kind in moved:
            groups.setdefault(s.group, []).append(s)
    return [s for s in specs if s.kind not in moved] + [s for ss in groups.values() for s in ss]


def _in_order(tiers: dict) -> dict:
    """``tiers`` in the registry's order (the store closes them in the reverse one)."""
    return {n: tiers[n] for n in registry.names() if tiers.get(n) is not None}


def _close_all(tiers: dict) -> None:
    for tier in reversed(list(tiers.values())):
        tier.close(remove=False)


def reopen_store(cfg: StoreConfig, specs: list[TensorSpec], layout: dict[str, list], disk_capacity: int,
                 owner: dict | None = None, device_capacity: int = 0, hbm=None, parts: list | None = None,
                 owners: dict | None = None) -> Store:
    """The service's store over the arena and NVMe file a previous service process left behind (its arena's header
    then names this process, and ``owner``), and HBM of ``device_capacity`` on the block ``hbm(nbytes)`` hands out,
    or (a run of several ranks) of ``parts[r]`` on rank r's GPU (the old ones died with that process: the caller
    puts back what they held)."""
    name, t = cfg.store_name(), cfg.tiers
    device = torch.device(t.device_tier.device)
    (host, disk), dev = _shared_tiers(), registry.primary(DEVICE)
    tiers: dict = {}
    try:
        tiers[host] = registry.tier_type(host).reopen_left(t[host], name, 0, device, owner=owner)
        if disk_capacity:
            tiers[disk] = registry.tier_type(disk).reopen_left(t[disk], name, disk_capacity, device)
        block = None
        if device_capacity and hbm is not None:
            block = hbm.parts(parts, owners) if parts is not None and len(parts) > 1 else hbm(device_capacity)
        tiers[dev] = registry.tier_type(dev).make(t[dev], device_capacity, Making(name, device, block=block))
    except BaseException:
        _close_all(tiers)
        raise
    return _over(cfg, specs, layout, _in_order(tiers))


def attach_store(cfg: StoreConfig, specs: list[TensorSpec], layout: dict[str, list], host_desc: dict,
                 disk_desc: dict | None, device: torch.device, n_slots: int,
                 resident: list[TensorSpec] = (), device_desc: dict | None = None) -> Store:
    """A trainer's store: the service's arena and NVMe file mapped here (as ``shared_description`` told them),
    the service's HBM block (``device_desc``) mapped below GPU slots of its own, and (``resident``) tensors of its
    own in its HBM (a rank's share of the host's HBM-resident state; invalid until written).

    Closing it unmaps and never removes anything: the state belongs to the service.
    """
    (host, disk), dev = _shared_tiers(), registry.primary(DEVICE)
    tiers: dict = {}
    try:
        tiers[host] = registry.tier_type(host).map_shared(host_desc, host_desc["name"], device)
        if disk_desc is not None:
            tiers[disk] = registry.tier_type(disk).map_shared(disk_desc, host_desc["name"], device)
        align = registry.tier_type(dev).alignment
        per_group: dict = {}
        for s in specs:
            if s.kind == "param":
                per_group[s.group] = per_group.get(s.group, 0) + align_up(s.nbytes, align)
        slot = max(per_group.values(), default=0)
        resident_bytes = sum(align_up(s.nbytes, align) for s in resident)
        if device_desc is not None:
            if resident:
                raise ValueError("a trainer maps the service's HBM or holds HBM-resident state of its own, not both")
            tiers[dev] = registry.tier_type(dev).map_shared(device_desc, device, slot, n_slots)
        else:
            tiers[dev] = registry.tier_type(dev).make(cfg.tiers[dev], resident_bytes,
                                                      Making(host_desc["name"], device, slot_bytes=slot,
                                                             n_slots=n_slots))
    except BaseException:
        _close_all(tiers)
        raise
    store = _over(cfg, specs, layout, _in_order(tiers))
    try:
        for s in resident:
            store.create(s, dev)
    except BaseException:
        store.close()
        raise
    return store
