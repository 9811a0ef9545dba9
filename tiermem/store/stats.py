"""A JSON-serialisable snapshot of the store: tiers, links and waits. Cheap enough to take every second."""

from __future__ import annotations

import time
from collections import defaultdict

from tiermem.tiers.base import DEVICE


def snapshot(store) -> dict:
    tiers_of = store.tiers
    by_kind: dict[str, dict[str, int]] = {t: defaultdict(int) for t in tiers_of}
    valid: dict[str, int] = defaultdict(int)
    for e in store.catalog.entries():
        by_kind[e.tier][e.spec.kind] += e.extent.nbytes
        valid[e.tier] += e.spec.nbytes if e.valid else 0
    budgets = store.plan.budgets if store.plan is not None else {}
    # a trainer attached to a service maps the service's arena and NVMe file: its allocators only hold the
    # layout it attached with, so free space and fragmentation are the service's to say (tiermem stats)
    host = tiers_of.host
    attached = host is not None and not host.owner
    tiers = {}
    for name, tier in tiers_of.items():
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
        if attached and tier.role != DEVICE:
            info.update(used=sum(by_kind[name].values()), free=None, fragmentation=None, owner="service")
        info.update(tier.stats())
        tiers[name] = info
    groups = {str(g): store.catalog.version(g) for g in store.catalog.groups()}
    return {
        "time": time.time(),
        "store": store.name,
        "tiers": tiers,
        "links": store.mover.stats(),
        "disk": store.mover.disk.snapshot(),  # (the storage links together: busy while any carries a transfer)
        "waits_s": {k: round(v, 6) for k, v in store.waits.items()},
        "group_versions": groups,
    }


class StatsFile:
    """Writes the store's snapshot, plus what ``extra()`` returns (the trainer's progress), to a JSON file
    every ``interval`` seconds from a daemon thread, atomically (temp file + rename), so ``tiermem top
    --run`` and ``tiermem stats --run`` can follow an embedded run without touching it."""

    def __init__(self, path, store, extra=None, interval: float = 0.5, sink=None):
        """``sink(snapshot)``, when given, also receives every snapshot (an attached trainer sends it to the
        service, whose ``tiermem top --socket`` shows it)."""
        import threading

        self.path, self.store, self.extra, self.interval = path, store, extra or (lambda: {}), interval
        self.sink = sink
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tiermem-stats", daemon=True)
        self._thread.start()

    def write(self) -> None:
        import json
        import os

        snap = {"store": snapshot(self.store), "run": self.extra(), "pid": os.getpid()}
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(snap, default=str))
            os.replace(tmp, self.path)
        except OSError:  # (a full disk): leave no temp file behind
            tmp.unlink(missing_ok=True)
            raise
        if self.sink is not None:
            self.sink(json.loads(json.dumps(snap, default=str)))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.write()
            except Exception:  # noqa: BLE001 - monitoring must never disturb training
                pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self.write()
        except Exception:  # noqa: BLE001
            pass
