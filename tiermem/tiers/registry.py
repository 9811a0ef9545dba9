"""The tiers tiermem knows, by name: each name's class (``tiermem.tiers.base.Tier``), in the order they were
registered, which is the order the config lists them, the store makes them and the planner reads them.

    register("cxl", CxlTier)          # a new tier: its module, and this line
    tier_type("nvme")                  # -> NvmeTier
    of_role(STORAGE)                   # -> ("nvme",)

The built-in tiers are registered below. A tier added at run time (a test's, a plugin's) is registered before
the config that names it is read; ``registered`` does it for a ``with`` block.
"""

from __future__ import annotations

import contextlib
import re

from tiermem.tiers.base import DEVICE, HOST, ROLES, STORAGE
from tiermem.tiers.dram import DramArena
from tiermem.tiers.gpu import GpuTier
from tiermem.tiers.nvme import NvmeTier

_TYPES: dict[str, type] = {}
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_NEEDS = {DEVICE: ("view", "acquire_slot", "release_slot", "sync"), HOST: ("view",),
          STORAGE: ("pread", "pwrite", "discard", "rates")}


def register(name: str, cls: type) -> None:
    """Make ``cls`` the tier named ``name`` (a config's ``tiers.<name>``, a placement's tier). The first tier of
    each of the roles device and host is the store's own one and must always be configured."""
    if not _NAME.match(name) or name == "auto" or hasattr(dict, name):
        raise ValueError(f"a tier's name is lower-case letters, digits and _ (not 'auto', nor a name of a "
                         f"mapping's methods), got {name!r}")
    if name in _TYPES:
        raise ValueError(f"a tier named {name!r} is registered already")
    role = getattr(cls, "role", None)
    if role not in ROLES:
        raise ValueError(f"{cls.__name__}.role must be one of {', '.join(ROLES)}, got {role!r}")
    missing = [a for a in ("Config", "optional", "make", "default_budget", "check_section", "allocate", "free",
                           "stats", "close", *_NEEDS[role]) if not hasattr(cls, a)]
    if role == STORAGE:
        missing += [a for a in ("resource", "label") if not hasattr(cls, a)]
    if missing:
        raise ValueError(f"{cls.__name__} is not a {role} tier: it lacks {', '.join(missing)}")
    if role == DEVICE and of_role(DEVICE):
        raise ValueError(f"a store has one device tier, and {of_role(DEVICE)[0]!r} is it")
    if role in (DEVICE, HOST) and not of_role(role) and cls.optional:
        raise ValueError(f"the first {role} tier is the store's own and cannot be optional")
    _TYPES[name] = cls


def unregister(name: str) -> None:
    _TYPES.pop(name)


@contextlib.contextmanager
def registered(name: str, cls: type):
    """``cls`` registered as ``name`` inside the block."""
    register(name, cls)
    try:
        yield cls
    finally:
        unregister(name)


def tier_type(name: str) -> type:
    """The class of the tier named ``name`` (KeyError when none is)."""
    return _TYPES[name]


def names() -> tuple[str, ...]:
    """Every registered tier's name, in registration order."""
    return tuple(_TYPES)


def role_of(name: str) -> str:
    return _TYPES[name].role


def of_role(role: str) -> tuple[str, ...]:
    """The registered tiers of ``role``, in registration order."""
    return tuple(n for n, cls in _TYPES.items() if cls.role == role)


def primary(role: str) -> str:
    """The first registered tier of ``role`` (device, host): the store's own, always configured."""
    return of_role(role)[0]


def links() -> list[str]:
    """The names of the links between the registered tiers, as the mover accounts them (``a->b``): the PCIe
    link each way between each host tier and the device (and its bulk lanes), each storage tier's to and from
    memory, and the copies within a host tier and within the device."""
    hosts, devices, stores = of_role(HOST), of_role(DEVICE), of_role(STORAGE)
    out = [x for h in hosts for d in devices for x in (f"{h}->{d}", f"{d}->{h}")]
    out += [x for h in hosts for d in devices for x in (f"{h}->{d} bulk", f"{d}->{h} bulk")]
    out += [x for s in stores for m in (*hosts, *devices) for x in (f"{s}->{m}", f"{m}->{s}")]
    return out + [f"{m}->{m}" for m in (*hosts, *devices)]


def storage_links(name: str) -> tuple[list[str], list[str]]:
    """The links a storage tier reads over (into memory) and writes over (from memory)."""
    mem = (*of_role(HOST), *of_role(DEVICE))
    return [f"{name}->{m}" for m in mem], [f"{m}->{name}" for m in mem]


register("gpu", GpuTier)
register("dram", DramArena)
register("nvme", NvmeTier)
