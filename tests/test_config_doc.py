"""Every config key carries its type and its meaning in its field (one source of truth): no field is typed
``Any``; ``tiermem-train --keys`` prints each key's type, default and meaning by group; docs/config.md is the
generator's output (``python -m trainer.config_doc > docs/config.md``); the parsed tiermem config knows which
keys the user set (``set_keys``), which the run's checks ask instead of reading the YAML again."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import yaml

from tests.procs import ROOT
from tests.test_config_keys import _write  # (a config over a model and a dataset that are there)
from tiermem.config import OptimizerConfig, StoreConfig
from tiermem.tiers import registry
from trainer.cli import main
from trainer.config import load_train_config
from trainer.config_doc import markdown
from trainer.config_fields import GROUPS, TrainConfig
from trainer.config_keys import KEYS
from trainer.state import explicit_gpu_share, store_config, store_settings, wants_cuda

CONFIGS = [TrainConfig, StoreConfig, OptimizerConfig, *(registry.tier_type(n).Config for n in registry.names())]


def _types(tp) -> list:
    return [tp, *(t for a in typing.get_args(tp) for t in _types(a))]


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_key_has_a_precise_type_and_a_meaning(cls):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        assert typing.Any not in _types(hints[f.name]), f"{cls.__name__}.{f.name} is typed Any"
        assert len(f.metadata.get("help", "")) > 10, f"{cls.__name__}.{f.name} says nothing of what it means"
        if cls is TrainConfig:
            assert f.metadata["group"] in GROUPS, f.name


def test_docs_config_md_is_current():
    """docs/config.md is what the generator writes from the fields today: a key added, renamed or explained
    anew without regenerating it fails here (python -m trainer.config_doc > docs/config.md)."""
    assert (ROOT / "docs/config.md").read_text() == markdown()


def test_docs_config_md_lists_every_key():
    text = markdown()
    for cls, prefix in ((TrainConfig, ""), (OptimizerConfig, "optimizer.")):
        for f in dataclasses.fields(cls):
            assert f"| `{prefix}{f.name}` |" in text, f.name
    for key in ("tiers.gpu.budget", "tiers.dram.path", "tiers.nvme.io_chunk", "placement", "probe", "name",
                "tiermem_server"):
        assert f"| `{key}` |" in text, key
    for key in KEYS:
        assert f"`{key}`" in text, key


def test_keys_prints_each_key_with_its_type_default_and_meaning(capsys):
    assert main(["--keys"]) == 0
    out = capsys.readouterr().out
    for heading in GROUPS.values():
        assert f"\n{heading}\n" in out, heading
    assert "  model_name_or_path: string, required\n      a local Hugging Face model directory" in out
    assert "  tiermem_keep_activations: integer | auto, default auto\n      decoder layers whose forward" in out
    assert "  tiermem_activation_budget: size | auto | null, default auto\n" in out
    assert "  tiers.dram.budget: size | auto, default 90% of what /dev/shm and RAM have free\n" in out
    assert "  optimizer.gpu_share: fraction (0-1) | auto, default auto\n" in out
    assert "  sequence_parallel_size: no effect: one GPU holds the whole row" in out
    lines = out.splitlines()
    for f in dataclasses.fields(TrainConfig):
        assert sum(line.startswith(f"  {f.name}: ") for line in lines) == 1, f.name


@pytest.mark.parametrize("key,value,needle", [
    ("tiermem", 5, "tiermem: expected a path to a tiermem config file or an inline mapping, got 5"),
    ("tiermem", True, "tiermem: expected a path to a tiermem config file or an inline mapping, got True"),
    ("tiermem_physical_batch_size", 0, "tiermem_physical_batch_size must be a number of rows (1 or more) or auto"),
    ("tiermem_keep_activations", "3", "tiermem_keep_activations must be a number of layers (0 or more) or auto"),
    ("tiermem_activation_budget", "lots", "tiermem_activation_budget: cannot read 'lots' as a size"),
    ("torch_compile", 1, "torch_compile must be true, false or auto, got 1"),
    ("report_to", {"a": 1}, "report_to: unexpected value"),
])
def test_a_value_of_the_wrong_type_is_one_line(tmp_path, key, value, needle):
    with pytest.raises(Exception, match="^" + needle.replace("(", r"\(").replace(")", r"\)")) as e:
        load_train_config(_write(tmp_path, **{key: value}))
    assert "\n" not in str(e.value)


def test_typed_values_are_read_as_their_types(tmp_path):
    cfg = load_train_config(_write(tmp_path, report_to=["tensorboard", "wandb"], tiermem_activation_budget="1KiB",
                                   tiermem_keep_activations=2, torch_compile=False, tiermem_physical_batch_size="auto"))
    assert cfg.report_to == "tensorboard" and cfg.tiermem_activation_budget == 1024
    assert cfg.tiermem_keep_activations == 2 and cfg.torch_compile is False
    assert cfg.tiermem_physical_batch_size == "auto"
    cfg = load_train_config(_write(tmp_path, tiermem_activation_budget=None))
    assert cfg.tiermem_activation_budget is None, "null: no limit"


def test_the_parsed_tiermem_config_knows_what_the_user_set(tmp_path):
    """set_keys: the keys given a value of their own (not null, not auto), kept through resolve_auto; the
    run's questions (the DRAM path chosen, a GPU share that wins, CUDA wanted) asked of it."""
    written = {"tiers": {"gpu": {"device": "cpu"}, "dram": {"budget": "64MiB", "pin": "auto"}}, "probe": None,
               "optimizer": {"gpu_share": "auto", "cpu_groups": "last"}}
    chosen = store_settings(written)
    assert chosen.set_keys == {"tiers.gpu.device", "tiers.dram.budget", "optimizer.cpu_groups"}
    assert chosen.tiers.host_tier.path == "anonymous", "a training run's default arena"
    assert not explicit_gpu_share(chosen) and not wants_cuda(chosen)
    resolved = store_config(written)
    assert resolved.set_keys == chosen.set_keys and resolved.optimizer.gpu_share is not None
    assert not explicit_gpu_share(resolved), "a share resolve_auto decided is not the user's"
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"tiers": {"dram": {"path": str(tmp_path), "budget": "64MiB"}},
                                    "optimizer": {"gpu_share": 0.0}}))
    chosen = store_settings(str(path))
    assert chosen.set_keys == {"tiers.dram.path", "tiers.dram.budget", "optimizer.gpu_share"}
    assert chosen.tiers.host_tier.path == str(tmp_path) and explicit_gpu_share(chosen)
    assert wants_cuda(store_config(str(path))), "device auto: CUDA where there is one"
    assert store_settings(None).set_keys == frozenset() and wants_cuda(store_settings(None))
