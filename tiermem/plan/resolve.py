"""Every ``auto`` of a tiermem config, resolved in one place from the config and the machine.

    cfg = resolve_auto(load_store_config(...), role="embedded")   # a training run's own store
    cfg = resolve_auto(cfg, role="service")                        # the store ``tiermem serve`` builds

What it decides (each value a user writes is kept as written):

- ``tiers.gpu.device``: CUDA when there is a GPU, else the CPU stand-in (a CUDA device the machine lacks
  is refused);
- ``tiers.dram.pin``: the arena is registered with CUDA when the store computes on a CUDA device;
- ``optimizer.gpu_share``: the share of DRAM/NVMe-resident groups the GPU worker updates while CPU AdamW
  updates the rest — 0 without CUDA; with it 0.7 embedded, 0.85 in a service (measured, below);
- ``optimizer.cpu_groups``: which of those groups the CPU worker takes — the last ones the next forward
  needs in a service with a GPU, spread evenly elsewhere (measured, below).

A service plans its own store with no GPU slots or resident groups: the GPU (when the config names one
and there is CUDA) serves only the optimizer's GPU worker. The resolved config is what ``tiermem top``,
the service's run record and a run's ``training_args.yaml`` show. (``placement: auto`` is the planner's,
``tiermem.plan``; ``tiers.nvme.backend: auto`` is the NVMe tier's, decided by what its directory allows.)
"""

from __future__ import annotations

import copy
from typing import Literal

import torch

from tiermem.config import StoreConfig
from tiermem.errors import ConfigError
from tiermem.tiers import registry
from tiermem.tiers.base import DEVICE

# measured best on the H200 machine (docs/measurements.md: streamed training; the service: attached vs embedded)
EMBEDDED_GPU_SHARE = 0.7
# a service's CPU AdamW is crash-safe (out of place), so slower: more of the update goes to the GPU, and with a
# GPU its CPU takes the groups the next forward needs last
SERVICE_GPU_SHARE = 0.85

Role = Literal["embedded", "service"]


def compute_device(cfg: StoreConfig) -> torch.device:
    """The device a store of ``cfg`` computes on: its device tier's ``device``; ``auto`` is CUDA when there is a
    GPU, else the CPU (the stand-in of the GPU tier). A CUDA device this machine does not have is refused."""
    want = cfg.tiers.device_tier.device
    if want == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if want.startswith("cuda"):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(want[5:]) if want.startswith("cuda:") else 0
        if index >= n:
            have = f"has {n} CUDA device{'s' if n != 1 else ''}" if n else "has no CUDA"
            raise ConfigError(f"tiers.{registry.primary(DEVICE)}.device: {want}, but this machine {have}; set "
                              "device: cpu (the CPU stand-in) or auto")
    return torch.device(want)


def on_cuda(cfg: StoreConfig) -> bool:
    """True when a store of ``cfg`` computes on a CUDA device."""
    return compute_device(cfg).type == "cuda"


def arena_pinned(cfg: StoreConfig) -> bool:
    """Whether the arena (the host tier) is registered with CUDA: its ``pin``, or (auto) when the store computes
    on a CUDA device."""
    pin = cfg.tiers.host_tier.pin
    return on_cuda(cfg) if pin == "auto" else pin == "true"


def resolve_auto(cfg: StoreConfig, role: Role = "embedded") -> StoreConfig:
    """A copy of ``cfg`` with every ``auto`` above decided for ``role`` on this machine."""
    c = copy.deepcopy(cfg)
    device, host = c.tiers.device_tier, c.tiers.host_tier
    device.device = str(compute_device(c))
    cuda = device.device.startswith("cuda")
    if role == "service":  # (a service always pins with a GPU: its trainer's copies read the arena)
        device.slots = 0
        device.budget = 0
        host.pin = "auto"
    if host.pin == "auto":  # (as arena_pinned, on the device just decided)
        host.pin = "true" if cuda else "false"
    if c.optimizer.gpu_share is None:
        c.optimizer.gpu_share = (SERVICE_GPU_SHARE if role == "service" else EMBEDDED_GPU_SHARE) if cuda else 0.0
    if c.optimizer.cpu_groups == "auto":
        c.optimizer.cpu_groups = "last" if role == "service" and cuda else "spread"
    return c
