"""Shared fixtures: a store config whose "gpu" tier is backed by CPU memory, and scratch directories."""

from __future__ import annotations

import os
import uuid

import pytest

from tiermem.config import load_store_config


@pytest.fixture(autouse=True)
def _dataset_cache(tmp_path, monkeypatch):
    """Each test tokenizes into its own cache directory and keeps service state in its own state directory,
    never the user's."""
    monkeypatch.setenv("TIERMEM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


@pytest.fixture
def nvme_dir(tmp_path):
    """A directory on a real disk (O_DIRECT works there), unlike tmpfs."""
    return tmp_path / "nvme"


@pytest.fixture
def store_name():
    return f"tiermem-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def make_cfg(nvme_dir, store_name):
    def make(placement="auto", nvme=True, dram_budget="64MiB", nvme_budget="64MiB", gpu_budget=None, **extra):
        tiers = {"gpu": {"device": "cpu", "budget": gpu_budget}, "dram": {"budget": dram_budget}}
        if nvme:
            tiers["nvme"] = {"path": str(nvme_dir), "budget": nvme_budget, "backend": "posix"}
        return load_store_config({"tiers": tiers, "placement": placement, "name": store_name, **extra})

    return make
