"""What a store's users ask of it besides moving bytes (``Store`` has these methods; the trainer uses nothing
else of a store): which tensors it holds and their specs, where a group's tensors live, each group's version
(waited for, set after a load, followed), its device, streaming slots and placed bytes, its links' traffic, and
its config as it runs.

    store.holds(name); store.spec(name); store.names(group, kind)
    store.version(group); store.set_version(group, v); store.wait_version(group, v, timeout)
    store.on_new_version(fn)                 # fn(group, version) after each version moves on
    store.in_device_memory(group, kind)      # computed on where it lives (HBM), no copy
    store.traffic()                          # bytes by link, storage read and written, disk busy seconds
    store.config_as_run()                    # the config as plain data, every auto as decided
"""

from __future__ import annotations

import torch

from tiermem.config import StoreConfig
from tiermem.schema import to_plain
from tiermem.specs import Group, TensorSpec
from tiermem.tiers import registry


class StoreQueries:
    """The read side of ``Store`` (a base class of it: ``tiermem.store.store``), over its ``cfg``, ``plan``,
    ``catalog``, ``tiers`` and ``mover``."""

    @property
    def config(self) -> StoreConfig:
        """The store's config (for a store attached to a service, the service's)."""
        return self.cfg

    @property
    def device(self) -> torch.device:
        """The device the store computes on (its device tier's)."""
        return self.tiers.device.device

    def tier(self, name: str):
        """The store's tier ``name`` (None: it has none of that name)."""
        return self.tiers.get(name)

    # -- tensors -------------------------------------------------------------------------------------------
    def holds(self, name: str) -> bool:
        """Whether the store holds tensor ``name`` (a rank's store lacks the state other ranks keep in their HBM)."""
        return name in self.catalog

    def spec(self, name: str) -> TensorSpec:
        """Tensor ``name``'s spec: its shape, dtype, kind and group."""
        return self.catalog[name].spec

    def names(self, group: Group | None = None, kind: str | None = None) -> list[str]:
        """The names of the store's tensors (with ``group`` and ``kind``: of that group's kind), in the order they
        were made."""
        if group is None:
            return [e.spec.name for e in self.catalog.entries()]
        return [e.spec.name for e in self.catalog.group_entries(group, kind)]

    def in_device_memory(self, group: Group, kind: str) -> bool:
        """Whether the group has tensors of ``kind`` and every one lives in the device tier's memory (HBM), where it
        is computed on without a copy."""
        entries = self.catalog.group_entries(group, kind)
        return bool(entries) and all(e.tier == self.tiers.device_name for e in entries)

    # -- versions ------------------------------------------------------------------------------------------
    def version(self, group: Group) -> int:
        """The last update whose whole state of the group is home."""
        return self.catalog.version(group)

    def set_version(self, group: Group, version: int) -> None:
        """The group's tensors hold update ``version`` (loaded from a checkpoint, or another process's update
        followed): whoever waits for it wakes."""
        self.catalog.bump(group, to=version)

    def wait_version(self, group: Group, version: int, timeout: float | None = None) -> float:
        """Block until the group holds update ``version`` or a later one (TimeoutError after ``timeout`` seconds);
        the seconds waited."""
        return self.catalog.wait_version(group, version, timeout=timeout)

    def on_new_version(self, fn) -> None:
        """Call ``fn(group, version)`` each time a group's version moves on (None: no longer)."""
        self.catalog.on_bump = fn

    # -- the device, the placement, the traffic ------------------------------------------------------------
    def sync_device(self) -> None:
        """Wait, asleep, until the kernels the calling thread queued on the store's device have run."""
        self.tiers.device.sync()

    def slots(self) -> tuple[int, int]:
        """The device tier's streaming slots: how many, and the bytes of each."""
        device = self.tiers.device
        return device.n_slots, device.slot_bytes

    def bytes_by_tier(self) -> dict[str, dict[str, int]]:
        """The bytes of state the placement puts on each tier, by kind (every registered tier, in order)."""
        return self.plan.bytes_by_kind()

    def traffic(self) -> dict:
        """What the store's links have carried so far (a step's is the difference of two): ``links``, bytes by
        link (``a->b``); ``storage_read`` and ``storage_written``, the bytes its storage tiers read into memory
        and wrote from it; ``disk_busy_s``, the seconds its disks were busy either way."""
        links = {name: int(link.get("bytes", 0)) for name, link in self.mover.stats().items()}
        read = written = 0
        for name in self.tiers.storage():
            reads, writes = registry.storage_links(name)
            read += sum(links.get(k, 0) for k in reads)
            written += sum(links.get(k, 0) for k in writes)
        return {"links": links, "storage_read": read, "storage_written": written,
                "disk_busy_s": self.mover.disk.snapshot()["busy_s"]}

    def config_as_run(self) -> dict:
        """The store's config as plain data as it runs: each tier's budget as the plan has it, a storage tier's
        backend as the tier chose it, the placement as decided (``placement_of``)."""
        out = to_plain(self.cfg)
        if self.plan is None:
            return out
        tiers = out["tiers"]
        for name, budget in self.plan.budgets.items():
            if tiers.get(name) is not None and budget is not None:
                tiers[name]["budget"] = budget
        for name in self.tiers.storage():  # (a backend the section may leave to the tier: auto)
            chosen = self.tiers[name].stats().get("backend")
            if tiers.get(name) is not None and "backend" in tiers[name] and chosen is not None:
                tiers[name]["backend"] = chosen
        out["placement"] = placement_of(self.plan.where)
        return out


def placement_of(where: dict) -> dict:
    """A plan's placement: kind -> tier where every group of the kind is on one tier, else kind -> {tier:
    [groups]} (a record of the decision: ``auto`` spills the last layers' coldest kinds to NVMe)."""
    by_kind: dict[str, dict[str, list]] = {}
    for (group, kind), tier in where.items():
        by_kind.setdefault(kind, {}).setdefault(tier, []).append(group)
    return {kind: next(iter(tiers)) if len(tiers) == 1 else {t: [str(g) for g in gs] for t, gs in tiers.items()}
            for kind, tiers in by_kind.items()}
