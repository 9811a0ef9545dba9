"""A service's tiermem config: read and checked for what a service needs, and planned (every ``auto``
decided for a service by ``tiermem.plan.resolve``)."""

from __future__ import annotations

import getpass

from tiermem.config import StoreConfig, load_store_config
from tiermem.errors import ConfigError
from tiermem.plan.resolve import compute_device, resolve_auto
from tiermem.specs import MOMENTS
from tiermem.tiers import registry
from tiermem.tiers.base import DEVICE, HOST, STORAGE
from tiermem.tiers.dram import check_budget

MOVABLE = ("master", *MOMENTS)  # kinds only the service touches between steps (SIGHUP may re-place them)


def service_config(path: str) -> StoreConfig:
    """The service's tiermem config, checked for what a service needs."""
    cfg = load_store_config(path, path)
    device, host, disks = registry.primary(DEVICE), registry.primary(HOST), registry.of_role(STORAGE)
    if cfg.tiers.host_tier.path == "anonymous":
        raise ConfigError(f"{path}: the service's arena must be a shared file: set tiers.{host}.path to a tmpfs "
                          "directory such as /dev/shm")
    if cfg.durability == "step" and isinstance(cfg.placement, dict) and cfg.placement.get("grad") == device:
        raise ConfigError(f"{path}: durability: step keeps each step's gradients in the arena (the redo of an update a "
                          f"crash cut short needs them): place grad on {host}")
    shared = {device, host, *disks[:1]}
    other = [t for t in cfg.tiers.configured() if t not in shared]
    if other:
        raise ConfigError(f"{path}: a service shares its arena and one storage tier with its trainers: the tiers "
                          f"{', '.join(other)} are not supported in service mode yet")
    if cfg.name is None:
        cfg.name = f"tiermem-{getpass.getuser()}"
    check_machine(cfg, path)
    return cfg


def check_machine(cfg: StoreConfig, path: str) -> None:
    """The config against this machine, at start: a CUDA device it lacks (write device: cpu for the CPU
    stand-in) and a DRAM budget larger than the arena's filesystem are refused in one line."""
    try:
        compute_device(cfg)
        check_budget(cfg.tiers.host_tier.budget, cfg.tiers.host_tier.path)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def planning_config(cfg: StoreConfig) -> StoreConfig:
    """The config the service plans and builds its own store with (``tiermem.plan.resolve``): no GPU slots or
    resident groups; the GPU (when the config names one and there is CUDA) only for the optimizer's GPU
    worker; every ``auto`` decided."""
    return resolve_auto(cfg, role="service")


def gpu_share(plan_cfg: StoreConfig) -> float:
    """The share of groups the trainer's GPU worker updates while the service's CPU AdamW updates the rest
    (resolved in ``plan_cfg``)."""
    return plan_cfg.optimizer.gpu_share
