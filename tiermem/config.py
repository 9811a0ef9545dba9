"""The tiermem config: tier budgets and paths, and the placement policy.

    tiers:
      gpu:  {budget: 40GiB}
      dram: {budget: 96GiB}                       # arena file under /dev/shm unless path says otherwise
      nvme: {path: /mnt/nvme/tiermem, budget: 1TiB, backend: auto}
    placement: auto                               # or pin some kinds: {exp_avg_sq: nvme} (the rest planned)
    durability: checkpoint                        # a service's: or step (HBM-resident state written through)
    probe: probe.json                             # a `tiermem probe --save` file (a machine file: docs/machines.md)
                                                  # the planner reads (default: a quick probe at start)

The same schema is read by ``tiermem serve --config`` and inline under a training YAML's ``tiermem:`` key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from tiermem.errors import ConfigError, nearest, shown
from tiermem.schema import load_dataclass, setting
from tiermem.specs import KINDS, MOMENTS  # noqa: F401 - (MOMENTS: the trainer's name for them, from here)
from tiermem.tiers import registry
from tiermem.tiers.base import DEVICE, HOST
from tiermem.yamlfile import read_yaml

TIERS = registry.names()  # the tiers registered when the config is first imported: the built-in ones


class TiersConfig(dict):
    """``tiers:``: each registered tier's name -> its section (the tier class's ``Config``), or None for an
    optional tier the config leaves out; in the registry's order. A section reads as an attribute too
    (``cfg.tiers.dram.budget``)."""

    def __getattr__(self, name: str):
        if name in self:
            return self[name]
        raise AttributeError(name)

    def configured(self) -> list[str]:
        """The tiers the config has, in the registry's order."""
        return [n for n, s in self.items() if s is not None]

    def of_role(self, role: str) -> list[str]:
        """The configured tiers of ``role`` (``tiermem.tiers.base``), in the registry's order."""
        return [n for n in self.configured() if registry.role_of(n) == role]

    @property
    def device_tier(self):
        """The device tier's section (the store's HBM, and the device it computes on)."""
        return self[registry.primary(DEVICE)]

    @property
    def host_tier(self):
        """The host tier's section (the store's arena)."""
        return self[registry.primary(HOST)]


def default_tiers() -> TiersConfig:
    return TiersConfig({n: None if registry.tier_type(n).optional else registry.tier_type(n).Config()
                        for n in registry.names()})


def _tiers(value: Any, where: str) -> TiersConfig:
    """``tiers:`` read section by section, each checked by its tier's class."""
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping, got {value!r}")
    out = default_tiers()
    for name, section in value.items():
        if name not in out:
            raise ConfigError(f"unknown config key '{where}.{name}'{nearest(str(name), list(out))}")
        cls, at = registry.tier_type(name), f"{where}.{name}"
        if section is None and cls.optional:
            out[name] = None
            continue
        if not isinstance(section, dict):
            raise ConfigError(f"{at}: expected a mapping, got {section!r}")
        out[name] = load_dataclass(cls.Config, section, at)
        cls.check_section(out[name], at)
    return out


# what a store's name may not hold: it names files (NAME.arena, NAME.nvme, NAME.run.json, ...) in the tiers'
# directories, so it is one plain file-name component, with room left for the longest suffix in 255 bytes
NAME_BYTES = 200


def _name(value: Any, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ConfigError(f"{where}: expected a name (letters, digits, '-', '_', '.'), got {shown(value)}")
    name = str(value)
    if (name in ("", ".", "..") or "/" in name or any(ord(c) < 32 or ord(c) == 127 for c in name)
            or len(name.encode()) > NAME_BYTES):
        raise ConfigError(f"{where}: {shown(name)} is not a plain file name: the store's files are named after it "
                          f"in the tiers' directories (no '/', no control characters, not '.' or '..', at most "
                          f"{NAME_BYTES} bytes)")
    return name


def _placement(value: Any, where: str) -> str | dict[str, str]:
    """``auto`` (the planner places every kind), or a mapping kind -> tier that pins the kinds it names
    (``auto`` as a tier leaves that kind to the planner, as not naming it does)."""
    if value == "auto":
        return "auto"
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected 'auto' or a mapping kind -> tier, got {value!r}")
    out = {}
    for kind, tier in value.items():
        if kind not in KINDS:
            raise ConfigError(f"{where}: unknown kind '{kind}'{nearest(str(kind), KINDS)}; kinds are "
                              + ", ".join(KINDS))
        tiers = registry.names()
        if tier not in (*tiers, "auto"):
            raise ConfigError(f"{where}.{kind}: unknown tier '{tier}'{nearest(str(tier), tiers)}; tiers are "
                              + ", ".join(tiers) + " (or auto: planned)")
        out[kind] = tier
    return out


def _share(value: Any, where: str) -> float | None:
    if value == "auto":
        return None
    try:
        share = float(value)
    except (TypeError, ValueError):
        share = -1.0
    if not 0.0 <= share <= 1.0:
        raise ConfigError(f"{where}: expected 'auto' or a fraction between 0 and 1, got {value!r}")
    return share


@dataclass
class OptimizerConfig:
    """Where the optimizer step runs for groups whose state lives in DRAM or on NVMe."""

    gpu_share: float | None = setting(None, convert=_share, yaml_type="fraction (0-1) | auto", shown="auto", help=(
        "fraction of the DRAM/NVMe-resident groups whose AdamW step runs on the GPU (state streamed over PCIe and "
        "back) beside CPU AdamW; auto: the planner's split in a training run and in a service's planned run; with "
        "the fixed rule (every kind pinned) 0.7 with a CUDA GPU, 0 without, 0.85 in a service's config (its CPU "
        "AdamW is crash-safe, so slower). A value set here wins over the planner's"))
    cpu_groups: Literal["auto", "spread", "last"] = setting("auto", help=(
        "which of those groups the CPU worker takes: spread evenly over the forward order (both workers progress "
        "together), or last: the ones the next forward needs last (the GPU worker takes the first), for a slow "
        "CPU AdamW such as the service's; auto: last in a service with a GPU (attached / embedded step time "
        "1.003 against 1.05 with spread), else spread"))


@dataclass
class StoreConfig:
    """The whole tiermem config."""

    tiers: TiersConfig = setting(default_factory=default_tiers, convert=_tiers, help=(
        "each tier's section (tiers.<name>), the registered tiers' only: gpu and dram always there, nvme when "
        "set"))
    optimizer: OptimizerConfig = setting(default_factory=OptimizerConfig, help="where the optimizer step runs")
    placement: str | dict[str, str] = setting("auto", convert=_placement, yaml_type="auto | mapping kind -> tier",
                                              help=(
        "auto: the planner places every kind (param, grad, master, exp_avg, exp_avg_sq); or a mapping kind -> "
        "tier pinning the kinds it names (the planner places the rest; auto as a tier is the same as not naming "
        "the kind)"))
    name: str | None = setting(None, convert=_name, shown="tiermem-<pid>", help=(
        "names the arena and NVMe files (and a service's run record and lock) in the tiers' directories: one "
        "plain file name, no /, no control characters, not . or .., at most 200 bytes"))
    probe: str | None = setting(None, help=(
        "a machine file the planner reads (`tiermem probe --save` writes one; configs/machines/ has several); "
        "null: a training run probes PCIe, the disk (each way alone and both at once), CPU AdamW and its compute "
        "copy quickly at start (about 4 s)"))
    durability: Literal["checkpoint", "step"] = setting("checkpoint", help=(
        "a service's (`tiermem serve`): what a crash of the service may lose of the state it keeps in HBM (a "
        "trainer's crash loses nothing in any tier). checkpoint: nothing is copied during a step; the run resumes "
        "from its last checkpoint (so the service's CPU worker updates in place, at the plain CPU AdamW rate). "
        "step: the state kept in HBM is written through to DRAM each step (the planner counts the copy; grad is kept "
        "in DRAM): a crash loses no step. An embedded run "
        "refuses step (its state lives and dies with its process)"))

    # (not a key) the dotted keys the config gives a value of its own, neither null nor auto (``tiers.dram.path``,
    # ``optimizer.gpu_share``): what it leaves to tiermem is not among them. Set by load_store_config; kept by a
    # copy (resolve_auto's), so a resolved config still tells a decided value from the user's
    set_keys: ClassVar[frozenset[str]] = frozenset()

    def pins(self) -> dict[str, str]:
        """The kinds the placement pins to a tier (``auto`` and kinds not named are the planner's)."""
        return {k: t for k, t in self.placement.items() if t != "auto"} if isinstance(self.placement, dict) else {}

    def store_name(self) -> str:
        return self.name or f"tiermem-{os.getpid()}"


def chosen_keys(data: dict, prefix: str = "") -> set[str]:
    """The dotted keys of a tiermem config's mapping given a value of their own (neither null nor auto), walking
    into ``tiers``, each tier's section and ``optimizer``."""
    out = set()
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and (key in ("tiers", "optimizer") or prefix == "tiers."):
            out |= chosen_keys(v, key + ".")
        elif v is not None and v != "auto":
            out.add(key)
    return out


def load_store_config(source: str | Path | dict[str, Any] | None, where: str = "tiermem") -> StoreConfig:
    """Read a config from a YAML file path or an inline mapping (None gives the defaults)."""
    if source is None:
        return StoreConfig()
    if isinstance(source, (str, Path)):
        data = read_yaml(source, "tiermem config file")
    else:
        data = source
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping at the top level")
    if "tiers" in data and data["tiers"] is None:
        raise ConfigError("tiers: expected a mapping, got None")
    cfg = load_dataclass(StoreConfig, data, "")
    cfg.set_keys = frozenset(chosen_keys(data))
    for kind, tier in (cfg.placement.items() if isinstance(cfg.placement, dict) else ()):
        if tier != "auto" and cfg.tiers.get(tier) is None:
            raise ConfigError(f"placement puts '{kind}' on {tier} but tiers.{tier} is not configured; "
                              f"add tiers: {{{tier}: {{path: DIR, budget: SIZE}}}}")
    paths = [(f"tiers.{n}.path", sec, "path") for n, sec in cfg.tiers.items()
             if sec is not None and hasattr(sec, "path")]
    for key, holder, attr in (*paths, ("probe", cfg, "probe")):
        value = getattr(holder, attr, None)
        many = isinstance(value, list)  # (a striped tier's directories, one per device)
        if not (isinstance(value, str) or many):
            continue
        if not all(isinstance(v, str) and v.strip() for v in (value if many else [value])):
            raise ConfigError(f"{key} is an empty path: name the directory (or file), or leave the key out")
        expand = os.path.expanduser  # (~ as a shell expands it)
        setattr(holder, attr, [expand(v) for v in value] if many else expand(value))
    return cfg


def check_host_budget(cfg: StoreConfig) -> None:
    """Refuse (one line, a ConfigError) a budget of the store's host tier (the DRAM arena) that it can never have
    on this machine: more than the memory or the filesystem its ``path`` names."""
    from tiermem.tiers.dram import check_budget

    host = cfg.tiers.host_tier
    check_budget(host.budget, host.path)
