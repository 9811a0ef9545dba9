"""A service's tiermem config: read and checked for what a service needs, and planned (every ``auto``
decided for a service by ``tiermem.plan.resolve``)."""

from __future__ import annotations

import getpass
from pathlib import Path

from tiermem.config import StoreConfig, check_host_budget, load_store_config
from tiermem.errors import ConfigError
from tiermem.plan.resolve import compute_device, resolve_auto
from tiermem.specs import MOMENTS
from tiermem.tiers import registry, stripes
from tiermem.tiers.base import DEVICE, HOST, STORAGE
from tiermem.tiers.dram import on_disk
from tiermem.tiers.nvme import check_directory, directories

MOVABLE = ("master", *MOMENTS)  # kinds only the service touches between steps (SIGHUP may re-place them)
# the protocol's field (attach's reply) describing the storage tier's files a service shares with its trainer
DISK_FIELD = "nvme"


def shared_disk() -> str:
    """The storage tier a service shares with its trainers (its files): the first registered one."""
    return registry.of_role(STORAGE)[0]


def service_config(path: str) -> StoreConfig:
    """The service's tiermem config, checked for what a service needs."""
    cfg = load_store_config(path, path)
    device, host = registry.primary(DEVICE), registry.primary(HOST)
    if cfg.tiers.host_tier.path == "anonymous":
        raise ConfigError(f"{path}: the service's arena must be a shared file: set tiers.{host}.path to a tmpfs "
                          "directory such as /dev/shm")
    if cfg.durability == "step" and isinstance(cfg.placement, dict) and cfg.placement.get("grad") == device:
        raise ConfigError(f"{path}: durability: step keeps each step's gradients in the arena (the redo of an update a "
                          f"crash cut short needs them): place grad on {host}")
    shared = {device, host, shared_disk()}
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
        check_host_budget(cfg)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def check_arena_pinnable(cfg: StoreConfig, plan_cfg: StoreConfig, path: str) -> None:
    """Refuse (one line) an arena the GPU is to pin (``plan_cfg``'s decision) in a directory on a disk
    filesystem."""
    host = cfg.tiers.host_tier
    if plan_cfg.tiers.host_tier.pin == "true" and on_disk(Path(host.path)):
        raise ConfigError(f"{path}: tiers.dram.path {host.path} is on a disk filesystem: "
                          "the GPU cannot pin an arena there; set it to a tmpfs such as /dev/shm")


def check_disk_room(cfg: StoreConfig) -> None:
    """Refuse (one line) a shared storage tier's budget its directories have no room for: its files are sized
    to the budget, so a service says so at start, not when a trainer attaches."""
    nv = cfg.tiers[shared_disk()]
    if nv is not None and nv.budget:
        dirs = directories(nv)
        for d in dirs:
            file = Path(d) / f"{cfg.store_name()}.nvme"
            share = stripes.file_bytes(nv.budget, len(dirs), nv.io_chunk)
            check_directory(Path(d), share - (file.stat().st_size if file.is_file() else 0))


def planning_config(cfg: StoreConfig) -> StoreConfig:
    """The config the service plans and builds its own store with (``tiermem.plan.resolve``): no GPU slots or
    resident groups; the GPU (when the config names one and there is CUDA) only for the optimizer's GPU
    worker; every ``auto`` decided."""
    return resolve_auto(cfg, role="service")


def gpu_share(plan_cfg: StoreConfig) -> float:
    """The share of groups the trainer's GPU worker updates while the service's CPU AdamW updates the rest
    (resolved in ``plan_cfg``)."""
    return plan_cfg.optimizer.gpu_share
