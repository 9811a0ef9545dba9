"""The files a store keeps on its tiers between processes, by the store's name: the host tier's arena, the storage
tier's files (one per drive) and a service's HBM block written at a clean stop. What a service discards
(``--fresh``) and what its stop line says to free."""

from __future__ import annotations

from pathlib import Path


def arena_file(cfg) -> Path:
    """The arena file of the store ``cfg`` (a StoreConfig) names, in its host tier's directory."""
    return Path(cfg.tiers.dram.path) / f"{cfg.store_name()}.arena"


def hbm_file(cfg) -> Path:
    """Where a service's clean stop writes its run's HBM block: beside the arena (it lives as long)."""
    return Path(cfg.tiers.dram.path) / f"{cfg.store_name()}.hbm"


def arena_dir(cfg) -> Path:
    """The directory the store's arena lives in (``tiermem arenas --dir``)."""
    return Path(cfg.tiers.dram.path)


def disk_files(cfg) -> list[Path]:
    """The storage tier's files of the store ``cfg`` names, one per drive ([]: no storage tier)."""
    from tiermem.tiers.nvme import directories

    nvme = cfg.tiers.nvme
    return [Path(d) / f"{cfg.store_name()}.nvme" for d in directories(nvme)] if nvme is not None else []
