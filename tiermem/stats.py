"""A JSON-serialisable snapshot of the store: tiers, links and waits. Cheap enough to take every second."""

from __future__ import annotations

import time
from collections import defaultdict

from tiermem.config import TIERS


def snapshot(store) -> dict:
    by_kind: dict[str, dict[str, int]] = {t: defaultdict(int) for t in TIERS}
    valid: dict[str, int] = defaultdict(int)
    for e in store.catalog.entries():
        by_kind[e.tier][e.spec.kind] += e.extent.nbytes
        valid[e.tier] += e.spec.nbytes if e.valid else 0
    budgets = store.plan.budgets if store.plan is not None else {}
    tiers = {}
    for name in TIERS:
        tier = store.tier(name)
        if tier is None:
            continue
        alloc = tier.allocator
        info = {
            "capacity": alloc.capacity,
            "used": alloc.used_bytes(),
            "free": alloc.free_bytes(),
            "budget": budgets.get(name),
            "by_kind": dict(by_kind[name]),
            "valid_bytes": valid[name],
            "fragmentation": round(alloc.fragmentation(), 4),
        }
        if name == "gpu":
            info.update(device=str(tier.device), slots=tier.n_slots, slots_free=tier.slots_free(),
                        slot_bytes=tier.slot_bytes)
        elif name == "dram":
            info.update(path=str(tier.path or "anonymous"), pinned=tier.pinned)
        else:
            info.update(path=str(tier.path), backend=tier.backend_name, backend_mode=tier.backend.reason)
        tiers[name] = info
    groups = {str(g): store.catalog.version(g) for g in store.catalog.groups()}
    return {
        "time": time.time(),
        "store": store.name,
        "tiers": tiers,
        "links": store.mover.stats(),
        "waits_s": {k: round(v, 6) for k, v in store.waits.items()},
        "group_versions": groups,
    }
