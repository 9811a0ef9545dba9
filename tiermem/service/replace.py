"""SIGHUP re-placement: the config read again, and optimizer state moved between tiers to follow it at
the next commit, with the store's own copy-then-switch (``Store.copy_to``/``rehome``): every new place is
recorded before an old one is reused. A config that would move the running store's files (its name, the arena's
directory, the NVMe tier's, where its run is recorded) is refused with one line in the log: the store keeps them
(a service started later with the moved paths would not find the run). A part of ``Service``
(``tiermem.service.server``)."""

from __future__ import annotations

from pathlib import Path

from tiermem.errors import UserError
from tiermem.plan.placement import default_budgets, make_plan
from tiermem.service.config import MOVABLE, planning_config, service_config
from tiermem.service.hbm import on_device
from tiermem.service.journal import write_atomic
from tiermem.service.runs import Run
from tiermem.store.layout import layout_of


def _where(path) -> str | list | None:
    if isinstance(path, list):  # (a striped tier's directories)
        return [str(Path(p).resolve()) for p in path]
    return None if path is None else str(Path(path).resolve())


def moved_files(old, new) -> list[str]:
    """What a reloaded config ``new`` changes of where a running store's files are (its name, each tier's directory:
    the arena's, the NVMe tier's, which holds the run's record): one phrase each."""
    changes = []
    if new.store_name() != old.store_name():
        changes.append(f"name {old.store_name()} -> {new.store_name()}")
    for name in dict.fromkeys([*old.tiers, *new.tiers]):
        sections = [c.tiers.get(name) for c in (old, new)]
        if not any(hasattr(sec, "path") for sec in sections):
            continue
        where = [_where(sec.path) if sec is not None else None for sec in sections]
        if where[0] != where[1]:
            said = [sec.path if sec is not None else f"(no {name} tier)" for sec in sections]
            changes.append(f"tiers.{name}.path {said[0]} -> {said[1]}")
    return changes


class Replacement:
    def reload(self) -> None:
        """SIGHUP: read the config again; placement and budget changes apply at the next commit."""
        try:
            cfg = service_config(self.config_path)
        except UserError as e:
            self.say(f"SIGHUP: config not reloaded: {e}")
            return
        moved = moved_files(self.cfg, cfg)
        if moved:
            self.say(f"SIGHUP: config not reloaded: {'; '.join(moved)}: a running store keeps its files (and its "
                     "run's record) where they are; put the config back (to move the store, let its run finish "
                     "first)")
            return
        with self.lock:
            self.pending_config = cfg
        self.say("SIGHUP: config reloaded; re-placement happens before the next update")

    def _move_state(self, run: Run) -> bool:
        """Move optimizer state between tiers to follow the reloaded config (called by commit once the last
        update is whole, before the next starts); True when something moved."""
        cfg, self.pending_config = self.pending_config, None
        self.cfg, self.plan_cfg = cfg, planning_config(cfg)
        if on_device(run.store):
            self.say("re-placement skipped: the run keeps state in HBM, and moving it is not supported yet")
            return False
        budgets = dict(default_budgets(cfg), gpu=0)
        try:
            plan = make_plan(run.specs, self.plan_cfg, ("param",), budgets)
        except UserError as e:
            self.say(f"re-placement skipped: {e}")
            return False
        store, moves, refused = run.store, [], set()
        for e in store.catalog.entries():
            want = plan.where[(e.spec.group, e.spec.kind)]
            if want == e.tier:
                continue
            if e.spec.kind not in MOVABLE:
                refused.add(e.spec.kind)
                continue
            if store.tier(want) is None:
                refused.add(f"{e.spec.kind} (this run has no {want} tier: set tiers.{want}.budget to reserve one)")
                continue
            moves.append((e, want))
        if refused:
            self.say(f"re-placement of {', '.join(sorted(refused))} needs a new run; left in place")
        placed = []  # every copy first: a failure leaves the old placement whole
        try:
            for e, want in moves:
                placed.append((e, store.copy_to(e.spec.name, want).result()))
        except Exception as err:  # noqa: BLE001 - no room, I/O: keep the old placement
            for _, place in placed:
                store.tier(place.tier).free(place.extent)
            self.say(f"re-placement stopped: {err}; nothing moved")
            return False
        olds = [store.rehome(e.spec.name, place, free=False) for e, place in placed]
        run.record["layout"] = layout_of(store)
        run.record["epoch"] = run.guard.epoch = run.record.get("epoch", 0) + 1  # older journaled moves are void
        write_atomic(self.record_path, run.record)  # the new places are recorded before the old are reused
        for old in olds:
            store.tier(old.tier).free(old.extent)
        if moves:
            moved = {}
            for e, want in moves:
                moved.setdefault((e.spec.kind, want), 0)
                moved[(e.spec.kind, want)] += 1
            self.say("re-placed: " + ", ".join(f"{k} of {n} tensors -> {t}" for (k, t), n in moved.items()))
        return bool(moves)
