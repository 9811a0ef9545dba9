"""A tier added from this file alone (no edit under tiermem/): a "slow disk" storage tier backed by one file in
a temporary directory, registered by name. The config reads its section, a placement pins a kind to it, the
planner and the cost model count its disk, the store stages through the arena to reach it, and a training run
with a kind pinned there ends with the weights of the same run without it."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tiermem.config import load_store_config
from tiermem.errors import ConfigError
from tiermem.plan.costmodel import Layout, describe_bound, predict
from tiermem.plan.machine import Machine
from tiermem.plan.placement import make_plan
from tiermem.plan.planner import sizes
from tiermem.plan.workload import Workload
from tiermem.sizes import size_or_auto
from tiermem.specs import TensorSpec, state_name
from tiermem.store.store import Store
from tiermem.tiers import registry
from tiermem.tiers.base import STORAGE, DiskRates
from tiermem.tiers.extents import ExtentAllocator

MiB = 1 << 20


@dataclass
class SlowDiskConfig:
    path: str | None = None
    budget: int | None = field(default=None, metadata={"convert": size_or_auto})


class SlowDisk:
    """A storage tier: one file, read and written with os.preadv/os.pwritev on a thread of its own."""

    role = STORAGE
    optional = True
    Config = SlowDiskConfig
    resource = "slowdisk"
    label = "slow disk"
    direct_to_gpu = False

    @classmethod
    def make(cls, section, capacity, at):
        return cls(Path(section.path) / f"{at.store_name}.slow", capacity)

    @classmethod
    def default_budget(cls, section, device, host_memory):
        return 64 * MiB

    @classmethod
    def check_section(cls, section, where):
        if not section.path:
            raise ConfigError(f"{where}.path is required")

    @classmethod
    def rates(cls, machine):
        return DiskRates(read=0.2e9, write=0.1e9, both=1.0)

    def __init__(self, path: Path, capacity: int):
        self.path, self.capacity = path, capacity
        self.allocator = ExtentAllocator(capacity, 4096)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(self._fd, capacity)
        self._io = cf.ThreadPoolExecutor(1, "slowdisk")

    def allocate(self, nbytes):
        return self.allocator.allocate(nbytes)

    def free(self, extent):
        self.allocator.free(extent)

    def pread(self, buf, extent):
        return self._io.submit(os.preadv, self._fd, [memoryview(buf.numpy())], extent.offset)

    def pwrite(self, buf, extent):
        return self._io.submit(os.pwritev, self._fd, [memoryview(buf.numpy())], extent.offset)

    def discard(self, extents):
        for e in extents:
            self.allocator.free(e)
        return 0

    def stats(self):
        return {"path": str(self.path), "backend": "one thread"}

    def close(self, remove=True):
        self._io.shutdown(wait=True)
        os.close(self._fd)
        if remove:
            self.path.unlink(missing_ok=True)


@pytest.fixture
def slowdisk(tmp_path):
    (tmp_path / "slow").mkdir()
    with registry.registered("slowdisk", SlowDisk):
        yield str(tmp_path / "slow")


def specs(layers: int = 3, n: int = MiB // 16) -> list[TensorSpec]:
    return [TensorSpec(state_name(f"layers.{i}.w", k), (n,), torch.float32, k, i)
            for i in range(layers) for k in ("param", "grad", "master", "exp_avg", "exp_avg_sq")]


def test_an_added_tier_is_read_from_the_config_and_refused_where_it_is_not_configured(slowdisk):
    cfg = load_store_config({"tiers": {"slowdisk": {"path": slowdisk, "budget": "8MiB"}},
                             "placement": {"exp_avg_sq": "slowdisk"}})
    assert cfg.tiers.slowdisk.budget == 8 * MiB and cfg.tiers.of_role(STORAGE) == ["slowdisk"]
    with pytest.raises(ConfigError, match="placement puts 'exp_avg' on slowdisk but tiers.slowdisk is not configured"):
        load_store_config({"placement": {"exp_avg": "slowdisk"}})
    with pytest.raises(ConfigError, match=r"tiers.slowdisk.path is required"):
        load_store_config({"tiers": {"slowdisk": {}}})
    with pytest.raises(ConfigError, match=r"unknown config key 'tiers.slowdisk.speed'"):
        load_store_config({"tiers": {"slowdisk": {"path": slowdisk, "speed": 1}}})


def test_the_registry_refuses_what_is_not_a_tier():
    class Half:
        role = STORAGE

    with pytest.raises(ValueError, match="lacks"):
        registry.register("half", Half)
    with pytest.raises(ValueError, match="lower-case"):
        registry.register("Slow Disk", SlowDisk)
    with pytest.raises(ValueError, match="registered already"):
        registry.register("nvme", SlowDisk)
    assert "half" not in registry.names()


def test_an_added_tier_is_placed_costed_and_holds_state_through_the_store(slowdisk, store_name):
    cfg = load_store_config({"tiers": {"gpu": {"device": "cpu"}, "dram": {"budget": "64MiB"},
                                       "slowdisk": {"path": slowdisk, "budget": "8MiB"}},
                             "placement": {"exp_avg_sq": "slowdisk"}, "name": store_name})
    s = specs()
    plan = make_plan(s, cfg)  # (every kind not pinned: DRAM, as the fixed rule has it)
    assert {t for (g, k), t in plan.where.items() if k == "exp_avg_sq"} == {"slowdisk"}
    assert plan.need()["slowdisk"] == 3 * MiB // 4 and plan.staging_bytes == 2 * MiB // 4  # (staged in DRAM)
    # the cost model: the CPU worker stages the moment from the slow disk and writes it back, at its rates
    group_bytes, params = sizes(s)
    w = Workload([1], 0, 2, {g: 0.01 for g in (0, 1, 2)}, {g: 0.03 for g in (0, 1, 2)}, 4096, 1, 0, 0, 6e9)
    p = predict(Layout(plan.where, set()), w, Machine.h200("synthetic"), group_bytes, params)
    assert p.bytes["slowdisk_read"] == p.bytes["slowdisk_write"] == 3 * MiB // 4
    assert p.busy["slowdisk"] == pytest.approx(3 * MiB // 4 / 0.2e9 + 3 * MiB // 4 / 0.1e9)
    assert describe_bound("slowdisk") == "slow disk"
    with Store.open(cfg, s) as store:
        assert store.slowdisk is not None and store.nvme is None
        for spec in s:
            store.write(spec.name, torch.full(spec.shape, float(spec.group + 1))).result()
        name = state_name("layers.1.w", "exp_avg_sq")
        assert torch.equal(store.read(name).result(), torch.full((MiB // 16,), 2.0))
        view = store.stage(1, "exp_avg_sq").result()  # (read into the arena, written back from there)
        view.tensors[name].mul_(3)
        store.mark_valid(1, "exp_avg_sq")
        view.release(write_back=True).result()
        assert torch.equal(store.read(name).result(), torch.full((MiB // 16,), 6.0))
        stats = store.stats()
        assert stats["tiers"]["slowdisk"]["by_kind"] == {"exp_avg_sq": 3 * MiB // 4}
        assert stats["links"]["slowdisk->dram"]["bytes"] > 0 and stats["links"]["dram->slowdisk"]["bytes"] > 0
        assert store.discard_stored(("exp_avg_sq",)) == 0 and name not in store.catalog


@pytest.mark.slow
def test_a_run_with_a_kind_on_an_added_tier_ends_with_the_weights_of_the_run_without_it(tmp_path, slowdisk):
    from tests.test_train_parity import run_cli
    from tests.tiny_models import save_tiny_model, write_tokenized_dataset

    model_dir = save_tiny_model("llama", tmp_path / "model")
    data_dir = tmp_path / "data"
    name = write_tokenized_dataset(data_dir)
    weights = {}
    for pinned in (True, False):
        run = tmp_path / ("pinned" if pinned else "plain")
        run.mkdir()
        tiermem = {"tiers": {"gpu": {"device": "cpu"}, "dram": {"budget": "64MiB"}}}
        if pinned:
            tiermem["tiers"]["slowdisk"] = {"path": slowdisk}
            tiermem["placement"] = {"exp_avg_sq": "slowdisk"}
        assert run_cli(run, model_dir, data_dir, name, tiermem, max_steps=3) == 0
        out = run / "out"
        weights[pinned] = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
        placement = yaml.safe_load((out / "training_args.yaml").read_text())["tiermem"]["placement"]
        stats = json.loads((out / "store_stats.json").read_text())
        if pinned:  # (the moment lived on the slow disk, staged through the arena at each update)
            assert placement["exp_avg_sq"] == "slowdisk", placement
            assert stats["links"]["slowdisk->dram"]["bytes"] > 0 and stats["links"]["dram->slowdisk"]["bytes"] > 0
        else:
            assert "slowdisk" not in json.dumps(placement)
    assert set(weights[True]) == set(weights[False])
    for k, v in weights[False].items():
        assert torch.equal(weights[True][k], v), k
