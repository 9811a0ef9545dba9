"""The store's tiers: made from the config for a plan's capacities (or taken ready-made, over an existing arena
and files), found by name and by role, closed together.

    tiers = make_tiers(cfg, plan.need(), Making(name, device, pin, slot, n))   # bytes each tier needs
    tiers.device, tiers.host              # the device tier (HBM, the slots), the host tier that stages storage
    tiers.role(name)                       # -> "device", "host" or "storage"

Each configured tier is made in the registry's order (an optional one only when the plan puts state on it), and
closed in the reverse order.
"""

from __future__ import annotations

from tiermem.config import StoreConfig
from tiermem.tiers import registry
from tiermem.tiers.base import DEVICE, HOST, MEMORY, STORAGE, Making


class Tiers(dict):
    """name -> tier, in the order they were made. The store has one device tier; the first host tier stages
    the storage tiers' bytes."""

    def role(self, name: str) -> str | None:
        """The role of the tier ``name`` (None: the store has no such tier)."""
        tier = self.get(name)
        return None if tier is None else tier.role

    def of_role(self, role: str) -> list[str]:
        return [n for n, t in self.items() if t.role == role]

    def is_memory(self, name: str) -> bool:
        """Whether the tier's bytes have a memory view (the device's or a host tier)."""
        return self.role(name) in MEMORY

    @property
    def device_name(self) -> str | None:
        return next(iter(self.of_role(DEVICE)), None)

    @property
    def device(self):
        """The device tier (HBM and the streaming slots), or None."""
        name = self.device_name
        return None if name is None else self[name]

    @property
    def host_name(self) -> str | None:
        return next(iter(self.of_role(HOST)), None)

    @property
    def host(self):
        """The host tier the storage tiers stage through (the arena), or None."""
        name = self.host_name
        return None if name is None else self[name]

    def storage(self) -> list[str]:
        return self.of_role(STORAGE)

    def close(self, keep: bool = False) -> None:
        """Close every tier, the last made first (``keep``: leave their files, the service's state)."""
        for tier in reversed(list(self.values())):
            tier.close(remove=not keep)


def make_tiers(cfg: StoreConfig, capacity: dict[str, int], at: Making) -> Tiers:
    """Each tier ``cfg`` configures, sized to ``capacity[name]``: the ones that must always be there (the device
    and host tiers), and the optional ones the capacity asks for. On a failure the tiers made are closed."""
    tiers = Tiers()
    try:
        for name in cfg.tiers.configured():
            cls = registry.tier_type(name)
            if cls.optional and capacity.get(name, 0) <= 0:
                continue
            tiers[name] = cls.make(cfg.tiers[name], capacity.get(name, 0), at)
    except BaseException:
        tiers.close()
        raise
    return tiers
