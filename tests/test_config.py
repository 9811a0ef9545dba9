"""The tiermem config: sizes, unknown keys, bad values, each a one-line ConfigError."""

from __future__ import annotations

import pytest

from tiermem.config import load_store_config
from tiermem.errors import ConfigError
from tiermem.sizes import format_size, parse_size


@pytest.mark.parametrize("text,expected", [
    ("40GiB", 40 << 30), ("1.5 GB", 1_500_000_000), ("512MiB", 512 << 20), ("4KiB", 4096), (4096, 4096),
    ("1TiB", 1 << 40), ("10", 10),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["lots", "-1GiB", "4 parsecs", True, -5, 1.5])
def test_parse_size_rejects(bad):
    with pytest.raises(ConfigError):
        parse_size(bad, "tiers.dram.budget")


def test_format_size():
    assert format_size(1536) == "1.5 KiB"
    assert format_size(3 << 30) == "3.0 GiB"


def test_full_config_reads():
    cfg = load_store_config({
        "tiers": {"gpu": {"budget": "40GiB"}, "dram": {"budget": "96GiB"},
                  "nvme": {"path": "/mnt/nvme/tiermem", "budget": "1TiB", "backend": "auto"}},
        "placement": {"param": "dram", "exp_avg": "nvme", "exp_avg_sq": "nvme"},
    })
    assert cfg.tiers.gpu.budget == 40 << 30
    assert cfg.tiers.nvme.budget == 1 << 40
    assert cfg.placement["exp_avg"] == "nvme"


@pytest.mark.parametrize("data,fragment", [
    ({"tier": {}}, "unknown config key 'tier' (did you mean 'tiers'?)"),
    ({"tiers": {"dram": {"budgte": "1GiB"}}}, "unknown config key 'tiers.dram.budgte' (did you mean 'budget'?)"),
    ({"tiers": {"dram": {"budget": "lots"}}}, "tiers.dram.budget: cannot read 'lots' as a size"),
    ({"tiers": {"nvme": {"path": "/x", "backend": "kvikoi"}}}, "(did you mean 'kvikio'?)"),
    ({"placement": {"exp_avg": "disk"}}, "unknown tier 'disk'"),
    ({"placement": {"momentum": "dram"}}, "unknown kind 'momentum'"),
    ({"placement": {"exp_avg": "nvme"}}, "tiers.nvme is not configured"),
    ({"tiers": {"nvme": {"budget": "1GiB"}}}, "tiers.nvme.path is required"),
    ({"placement": "everywhere"}, "expected 'auto' or a mapping"),
    ({"optimizer": {"cpu_groups": "lats"}}, "optimizer.cpu_groups: 'lats' is not one of auto, spread, last"),
])
def test_config_errors_are_one_line(data, fragment):
    with pytest.raises(ConfigError) as e:
        load_store_config(data)
    assert fragment in str(e.value)
    assert "\n" not in str(e.value)


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_store_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers: {gpu: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_store_config(bad)


def test_yaml_bools_read_as_the_words_they_were():
    """YAML reads a bare no / true as a bool: where a key's choices are words, the word is meant."""
    from tiermem.schema import load_dataclass
    from trainer.config import TrainConfig

    base = {"model_name_or_path": "m", "output_dir": "o", "dataset": "d"}
    assert load_dataclass(TrainConfig, dict(base, eval_strategy=False)).eval_strategy == "no"
    assert load_store_config({"tiers": {"dram": {"pin": True}}}).tiers.dram.pin == "true"
    assert load_store_config({"tiers": {"dram": {"pin": False}}}).tiers.dram.pin == "false"
    with pytest.raises(ConfigError, match="eval_strategy: True is not one of no, steps, epoch"):
        load_dataclass(TrainConfig, dict(base, eval_strategy=True))


def test_format_duration_reads_as_timedelta_and_takes_any_number():
    """An ETA of 2**64 steps (max_steps) overflowed timedelta and ended the run in a traceback."""
    from datetime import timedelta

    from tiermem.sizes import format_duration

    for s in (0, 59, 3600, 86399, 86400, 90061, 2.5, 10 ** 6):
        assert format_duration(s) == str(timedelta(seconds=int(s)))
    assert format_duration(2.0 ** 70).endswith("days, 16:17:04")
    assert [format_duration(v) for v in (None, float("nan"), float("inf"), "abc")] == ["-"] * 4


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_parse_size_refuses_non_finite_numbers(bad):
    with pytest.raises(ConfigError, match="tiers.dram.budget"):
        parse_size(bad, "tiers.dram.budget")
