"""A JSON-serialisable snapshot of the store: tiers, links and waits. Cheap enough to take every second. The
checks of a snapshot read back (``snapshot_problem``) import nothing heavy: ``tiermem stats --run`` needs no
torch."""

from __future__ import annotations

import time
from collections import defaultdict


def snapshot(store) -> dict:
    from tiermem.tiers.base import DEVICE, STORAGE

    tiers_of = store.tiers
    by_kind: dict[str, dict[str, int]] = {t: defaultdict(int) for t in tiers_of}
    valid: dict[str, int] = defaultdict(int)
    for e in store.catalog.entries():
        by_kind[e.tier][e.spec.kind] += e.extent.nbytes
        valid[e.tier] += e.spec.nbytes if e.valid else 0
    for tier, n in store.reserved().items():  # (a step's boundary activations there: tiermem.store.scratch)
        by_kind[tier]["activations"] += n
    budgets = store.plan.budgets if store.plan is not None else {}
    # a trainer attached to a service maps the service's arena and NVMe file: its allocators only hold the
    # layout it attached with, so free space and fragmentation are the service's to say (tiermem stats)
    host = tiers_of.host
    attached = host is not None and not host.owner
    tiers = {}
    for name, tier in tiers_of.items():
        alloc = tier.allocator
        info = {
            "role": tier.role,  # (what `tiermem top` names the tier by, without this process's tiers' registry)
            **({"label": type(tier).label, "resource": type(tier).resource} if tier.role == STORAGE else {}),
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


# The shape of a snapshot where its readers (tiermem top, stats --prometheus) take numbers: each part's keys that
# hold a number (or null), and those that hold a mapping of names to numbers. A snapshot from a file or a trainer's
# progress frame is checked against it before it is kept or shown.
_RUN = ({"step", "total_steps", "epoch", "loss", "grad_norm", "lr", "eval_loss", "tokens_per_s", "tflops",
         "tflops_attention", "step_s", "eta_s", "train_loss", "train_runtime", "disk_busy_s_per_step", "alloc_retries"},
        {"split", "link_bytes_per_step"})
_OPTIMIZER = ({"last_update_s", "gpu_share", "committed", "updated", "lag_groups"}, {"split"})
_PLAN = ({"predicted_step_s", "compute", "wait_optimizer", "wait_transfer"}, {"busy", "bytes"})
_TIER = ({"capacity", "used", "free", "budget", "valid_bytes", "fragmentation", "slots", "slots_free", "slot_bytes"},
         {"by_kind"})
_LINK = ({"bytes", "gbps_now", "gbps_avg", "busy_s", "queue"}, set())
_BIG = 1 << 63  # (a JSON integer past this is no count of bytes or seconds: floats overflow on it)


def _number(v) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and
                         (isinstance(v, float) or -_BIG < v < _BIG))


def _part(obj, where: str, shape: tuple[set, set]) -> str | None:
    if obj is None:
        return None
    if not isinstance(obj, dict):
        return f"{where}: expected an object"
    numbers, maps = shape
    for key in numbers:
        if not _number(obj.get(key)):
            return f"{where}.{key}: expected a number, got {str(obj.get(key))[:40]!r}"
    for key in maps:
        value = obj.get(key)
        if value is not None and not (isinstance(value, dict) and all(map(_number, value.values()))):
            return f"{where}.{key}: expected an object of numbers"
    return None


def _parts(obj, where: str, shape: tuple[set, set]) -> str | None:
    """A mapping of names to parts of ``shape`` (the tiers, the links)."""
    if obj is None:
        return None
    if not isinstance(obj, dict):
        return f"{where}: expected an object"
    return next((p for k, v in obj.items() if (p := _part(v, f"{where}.{k}", shape))), None)


def run_problem(run, where: str = "run") -> str | None:
    """What is wrong with a run's figures (a trainer's ``live``) where numbers go, or None."""
    if run is not None and not isinstance(run, dict):
        return f"{where}: expected an object"
    run = run or {}
    return (_part(run, where, _RUN) or _part(run.get("optimizer"), f"{where}.optimizer", _OPTIMIZER)
            or _part(run.get("plan"), f"{where}.plan", _PLAN))


def store_problem(store, where: str = "store") -> str | None:
    """What is wrong with a store's snapshot where numbers go, or None."""
    if store is not None and not isinstance(store, dict):
        return f"{where}: expected an object"
    store = store or {}
    waits = store.get("waits_s")
    if waits is not None and not (isinstance(waits, dict) and all(map(_number, waits.values()))):
        return f"{where}.waits_s: expected an object of numbers"
    return _parts(store.get("tiers"), f"{where}.tiers", _TIER) or _parts(store.get("links"), f"{where}.links", _LINK)


def snapshot_problem(snap) -> str | None:
    """What is wrong with a whole snapshot ({store, run, pid, service}) where numbers go, or None."""
    if not isinstance(snap, dict):
        return "expected a JSON object (a tiermem stats snapshot)"
    if snap.get("service") is not None and not isinstance(snap["service"], dict):
        return "service: expected an object"
    if not _number(snap.get("pid")):
        return "pid: expected a number"
    return store_problem(snap.get("store")) or run_problem(snap.get("run"))
