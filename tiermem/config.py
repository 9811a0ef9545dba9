"""The tiermem config: tier budgets and paths, and the placement policy.

    tiers:
      gpu:  {budget: 40GiB}
      dram: {budget: 96GiB}                       # arena file under /dev/shm unless path says otherwise
      nvme: {path: /mnt/nvme/tiermem, budget: 1TiB, backend: auto}
    placement: auto                               # or pin some kinds: {exp_avg_sq: nvme} (the rest planned)
    probe: probe.json                             # a `tiermem probe --save` file the planner reads (default: a
                                                  # quick probe at start)

The same schema is read by ``tiermem serve --config`` and inline under a training YAML's ``tiermem:`` key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tiermem.errors import ConfigError, nearest, shown
from tiermem.schema import load_dataclass
from tiermem.sizes import parse_size
from tiermem.yamlfile import read_yaml

KINDS = ("param", "grad", "master", "exp_avg", "exp_avg_sq")
MOMENTS = ("exp_avg", "exp_avg_sq")  # Adam's two moments, fp32
TIERS = ("gpu", "dram", "nvme")


def _opt_size(value: Any, where: str) -> int | None:
    return None if value in (None, "auto") else parse_size(value, where)


def _device(value: Any, where: str) -> str:
    text = str(value).strip() if isinstance(value, str) else None
    if text in ("auto", "cpu", "cuda") or (text and text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise ConfigError(f"{where}: {value!r} is not a device tiermem computes on: auto, cuda, cuda:N or cpu")


def _threads(value: Any, where: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 1024:
        return value
    raise ConfigError(f"{where}: expected a number of I/O threads from 1 to 1024, got {shown(value)}")


def _io_chunk(value: Any, where: str) -> int:
    n = parse_size(value, where)
    if not 4096 <= n <= 1 << 30:
        raise ConfigError(f"{where}: expected a size from 4KiB to 1GiB (requests are split into pieces of it), got "
                          f"{shown(value)}")
    return n


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


def _slots(value: Any, where: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 64:
        return value
    raise ConfigError(f"{where}: expected a number of streaming slots from 1 to 64, got {value!r}")


@dataclass
class GpuTierConfig:
    """HBM for streamed layer slots and resident groups. ``budget: auto`` = what the placement needs."""

    budget: int | None = field(default=None, metadata={"convert": _opt_size})
    # "auto" (CUDA when there is a GPU, else the CPU), "cuda", "cuda:N", or "cpu" (the CPU stand-in)
    device: str = field(default="auto", metadata={"convert": _device})
    # streamed-layer slots per kind fetched to the GPU (current, next, the one being freed)
    slots: int = field(default=3, metadata={"convert": _slots})


@dataclass
class DramTierConfig:
    """The shared-memory arena; registered with CUDA as pinned memory when a GPU is present."""

    budget: int | None = field(default=None, metadata={"convert": _opt_size})
    path: str = "/dev/shm"  # directory that holds the arena file, or "anonymous" (private huge pages)
    pin: Literal["auto", "true", "false"] = "auto"
    preallocate: bool = False  # fallocate first: a /dev/shm filled meanwhile fails cleanly (~0.2 s/GiB)


@dataclass
class NvmeTierConfig:
    """Preallocated files in a directory, read and written through kvikio or POSIX I/O."""

    path: str | None = None
    budget: int | None = field(default=None, metadata={"convert": _opt_size})
    backend: Literal["auto", "kvikio", "posix"] = "auto"
    threads: int = field(default=8, metadata={"convert": _threads})  # I/O threads (posix) or kvikio's pool size
    io_chunk: int = field(default=16 << 20, metadata={"convert": _io_chunk})  # split large requests
    direct: bool = True  # O_DIRECT where the filesystem allows it


@dataclass
class TiersConfig:
    gpu: GpuTierConfig = field(default_factory=GpuTierConfig)
    dram: DramTierConfig = field(default_factory=DramTierConfig)
    nvme: NvmeTierConfig | None = None


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
        if tier not in (*TIERS, "auto"):
            raise ConfigError(f"{where}.{kind}: unknown tier '{tier}'{nearest(str(tier), TIERS)}; tiers are "
                              + ", ".join(TIERS) + " (or auto: planned)")
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

    # fraction of those groups updated on the GPU (state streamed over PCIe and back) instead of by CPU
    # AdamW; both run at once. auto: 0.7 with a CUDA GPU tier (measured best on the H200 machine), else 0.
    gpu_share: float | None = field(default=None, metadata={"convert": _share})
    # which of those groups the CPU worker takes: "spread" evenly over the forward order (both workers
    # progress together), or the "last" ones the next forward needs (a slow CPU AdamW, such as the
    # service's crash-safe one, then runs while the forward works through the GPU worker's groups).
    # auto: last in a service with a GPU (measured best on the H200 machine), else spread
    cpu_groups: Literal["auto", "spread", "last"] = "auto"


@dataclass
class StoreConfig:
    """The whole tiermem config."""

    tiers: TiersConfig = field(default_factory=TiersConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    placement: str | dict[str, str] = field(default="auto", metadata={"convert": _placement})
    name: str | None = field(default=None, metadata={"convert": _name})  # names the arena and NVMe files;
    # default tiermem-<pid>
    probe: str | None = None  # a `tiermem probe --save` file the planner reads (None: a quick probe at start)

    def pins(self) -> dict[str, str]:
        """The kinds the placement pins to a tier (``auto`` and kinds not named are the planner's)."""
        return {k: t for k, t in self.placement.items() if t != "auto"} if isinstance(self.placement, dict) else {}

    def store_name(self) -> str:
        return self.name or f"tiermem-{os.getpid()}"


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
    cfg = load_dataclass(StoreConfig, data, "")
    for kind, tier in (cfg.placement.items() if isinstance(cfg.placement, dict) else ()):
        if tier == "nvme" and cfg.tiers.nvme is None:
            raise ConfigError(f"placement puts '{kind}' on nvme but tiers.nvme is not configured; "
                              "add tiers: {nvme: {path: DIR, budget: SIZE}}")
    if not cfg.tiers.dram.path:
        raise ConfigError("tiers.dram.path: expected the directory of the arena file (a tmpfs such as /dev/shm), or "
                          "anonymous")
    if cfg.tiers.nvme is not None and not cfg.tiers.nvme.path:
        raise ConfigError("tiers.nvme.path is required: the directory that holds the NVMe tier's files")
    return cfg
