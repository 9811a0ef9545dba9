"""LLaMA-Factory's ``rope_scaling`` key scales config.json as LLaMA-Factory does (factor ceil(cutoff_len / the
pretrained length), max_position_embeddings that length x factor) and trains exactly the model so scaled, which
the export's config.json describes; a RoPE the template does not compute goes to the generic path under
``tiermem_model_path: auto`` with one note, and is refused in one line when the template is forced."""

from __future__ import annotations

import json

import pytest

from tests.test_train_parity import assert_same_weights, reference_training, run_cli
from tests.tiny_models import save_tiny_model, write_tokenized_dataset
from trainer.model.rope import llamafactory_scaling

transformers = pytest.importorskip("transformers")

TIERMEM = {"tiers": {"gpu": {"device": "cpu"}, "dram": {"budget": "64MiB"}}}


@pytest.mark.slow
def test_the_rope_scaling_key_trains_the_model_llamafactory_scales(tmp_path, capsys):
    """Qwen3 (template) with 8 positions, rows up to 20 tokens, cutoff_len 64, rope_scaling: yarn: the run trains
    what transformers trains from config.json scaled by hand as LLaMA-Factory scales it (yarn, factor 8 = 64 / 8,
    original_max_position_embeddings 8, max_position_embeddings 64), and exports that config.json."""
    model_dir = save_tiny_model("qwen3", tmp_path / "model", max_position_embeddings=8)
    data_dir = tmp_path / "data"
    name = write_tokenized_dataset(data_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    scaled_dir = tmp_path / "scaled"  # what LLaMA-Factory's configure_rope makes of it
    save_tiny_model("qwen3", scaled_dir, max_position_embeddings=8)
    theta = raw["rope_parameters"]["rope_theta"]
    want = dict(raw, max_position_embeddings=64,
                rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8,
                                 "rope_theta": theta})
    (scaled_dir / "config.json").write_text(json.dumps(want))
    norms: list[float] = []
    losses: list[float] = []
    ref = reference_training(scaled_dir, data_dir, name, norms, losses)
    assert run_cli(tmp_path, model_dir, data_dir, name, TIERMEM, rope_scaling="yarn", cutoff_len=64) == 0
    out = tmp_path / "out"
    said = capsys.readouterr().out
    assert said.count("note: rope_scaling: yarn with factor 8 for cutoff_len 64") == 1, said
    assert_same_weights(out, ref, tied=True)
    log = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in log] == pytest.approx(losses, rel=1e-5)
    exported = json.loads((out / "config.json").read_text())
    assert exported["rope_parameters"] == want["rope_parameters"] and exported["max_position_embeddings"] == 64
    assert "tiermem_model_path: template" in (out / "training_args.yaml").read_text()


def test_llamafactory_scaling_of_config_json():
    """The legacy form (rope_scaling + rope_theta) keeps its form; a scaling's own pretrained length is the one
    scaled from; llama3 gets LLaMA-Factory's frequency factors, linear only its factor; rows within the model's
    positions change nothing."""
    legacy = {"max_position_embeddings": 4096, "rope_theta": 5e5}
    got, note = llamafactory_scaling(legacy, "llama3", 10000)
    assert got == dict(legacy, max_position_embeddings=12288, rope_scaling={
        "rope_type": "llama3", "factor": 3.0, "original_max_position_embeddings": 4096, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0})
    assert "factor 3" in note
    assert llamafactory_scaling(legacy, "linear", 8192)[0]["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    scaled = {"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                                   "original_max_position_embeddings": 32768}}
    got, _ = llamafactory_scaling(scaled, "dynamic", 100000)
    assert got["max_position_embeddings"] == 131072 and got["rope_scaling"] == {
        "rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 32768}
    same, note = llamafactory_scaling(legacy, "yarn", 4096)
    assert same is legacy and note.startswith("note: rope_scaling: yarn has no effect here: cutoff_len 4096")


def test_a_rope_the_template_does_not_compute_goes_to_the_generic_path(tmp_path, capsys):
    model_dir = save_tiny_model("qwen2", tmp_path / "model",
                                rope_parameters={"rope_type": "proportional", "rope_theta": 10000.0, "factor": 2.0})
    data_dir = tmp_path / "data"
    name = write_tokenized_dataset(data_dir, n_rows=4)
    assert run_cli(tmp_path, model_dir, data_dir, name, TIERMEM, max_steps=1) == 0
    said = capsys.readouterr().out
    assert said.count("note: the template does not cover this model (RoPE type 'proportional' is not supported by "
                      "the template") == 1, said
    assert "(generic path)" in said
    assert "tiermem_model_path: generic" in (tmp_path / "out" / "training_args.yaml").read_text()
    assert run_cli(tmp_path, model_dir, data_dir, name, TIERMEM, max_steps=1, tiermem_model_path="template",
                   output_dir=str(tmp_path / "forced")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "RoPE type 'proportional' is not supported by the template" in err, err
