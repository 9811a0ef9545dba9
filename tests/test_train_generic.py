"""The generic path trains exactly: architectures the template does not cover (Gemma 2: scaled embedding,
alternating sliding-window layers shorter than the rows, logit soft-capping, tied head, zero-centred norms;
Phi-3: fused qkv and gate-up projections; GPT-2: learned positions, LayerNorms with biases, Conv1D) end fp32
streamed training with the same weights, losses and gradient norms as transformers + torch AdamW; a template
family forced through the generic path ends where the template does."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.test_train_parity import HP, assert_same_weights, nvme_moments, reference_training, run_cli
from tests.tiny_models import hf_config, save_tiny_model, write_tokenized_dataset

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family,passes", [pytest.param("gemma2", 1, marks=pytest.mark.slow), ("phi3", 2), ("gpt2", 1)])
def test_generic_training_matches_transformers(tmp_path, family, passes):
    model_dir = save_tiny_model(family, tmp_path / "model")
    data_dir = tmp_path / "data"
    name = write_tokenized_dataset(data_dir)
    norms: list[float] = []
    losses: list[float] = []
    ref = reference_training(model_dir, data_dir, name, norms, losses)
    assert max(norms) > HP["max_grad_norm"], "the test must make clipping trigger"
    budget = {"tiermem_activation_budget": "1KiB"} if passes > 1 else {}
    assert run_cli(tmp_path, model_dir, data_dir, name, nvme_moments(tmp_path), **budget) == 0
    out = tmp_path / "out"
    tied = json.loads((model_dir / "config.json").read_text()).get("tie_word_embeddings", False)
    assert tied == (family in ("gemma2", "gpt2"))
    assert_same_weights(out, ref, tied=tied)
    log = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    assert [r["grad_norm"] for r in log] == pytest.approx(norms, rel=1e-5)
    assert [r["loss"] for r in log] == pytest.approx(losses, rel=1e-5)
    args = (out / "training_args.yaml").read_text()
    assert "tiermem_model_path: generic" in args  # (auto, as decided: these families take the generic path)
    if family == "gemma2":  # the export loads in transformers and computes the reference weights' logits
        got = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        want = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        want.load_state_dict(ref, strict=False)  # (the tied head follows the embedding)
        ids = torch.randint(1, 96, (2, 13), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            torch.testing.assert_close(got(ids).logits, want(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # (issue 40: among the quick subset's slowest on 2 cores; the whole suite runs it)
def test_a_template_family_through_the_generic_path_ends_where_the_template_does(tmp_path):
    model_dir = save_tiny_model("qwen3", tmp_path / "model")  # (tied head, q/k norms)
    data_dir = tmp_path / "data"
    name = write_tokenized_dataset(data_dir, n_rows=8)
    tiermem = {"tiers": {"gpu": {"device": "cpu"}, "dram": {"budget": "64MiB"}}}
    assert run_cli(tmp_path, model_dir, data_dir, name, tiermem, tiermem_model_path="generic", max_steps=3) == 0
    generic = load_file(tmp_path / "out" / "model.safetensors")
    # the generic path keeping every layer's activations (no recompute) trains bit for bit the same
    assert run_cli(tmp_path, model_dir, data_dir, name, tiermem, tiermem_model_path="generic", max_steps=3,
                   overwrite_output_dir=True, tiermem_keep_activations=99) == 0
    kept = load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(kept[n], generic[n]) for n in generic)
    assert run_cli(tmp_path, model_dir, data_dir, name, tiermem, overwrite_output_dir=True, max_steps=3) == 0
    template = load_file(tmp_path / "out" / "model.safetensors")
    assert set(generic) == set(template)
    start = load_file(model_dir / "model.safetensors")
    for n in template:
        assert not torch.equal(template[n], start[n]) or n.endswith("norm.weight")
        err = (generic[n] - template[n]).norm() / template[n].norm()
        assert err <= 1e-5, f"{n}: relative error {err:.2e}"


MOE_AND_HYBRID = ["qwen3_next", "deepseek_v3", "deepseek_v2", "glm4_moe", "llama4", "qwen3_5"]


def round_trip(model_dir) -> dict[str, torch.Tensor]:
    """The checkpoint of ``model_dir`` loaded as the store holds it (trainer.outputs.weights_io: converted by
    transformers' rules) and written back as the export writes it (reverted), without the store: its on-disk
    tensors."""
    from trainer.model.disk_layout import Exporter
    from trainer.model.select import load_model
    from trainer.outputs.weights_io import _converted, check_weight_files, load_buffers

    cfg = load_model(model_dir, "generic")
    check_weight_files(cfg, model_dir)
    load_buffers(cfg, model_dir)
    held = dict(_converted(cfg, model_dir))
    names = [w.name for w in cfg.weights()]
    exporter = Exporter(cfg.layouts[str(model_dir)], names, cfg.buffers())
    out = [kv for n in names for kv in exporter.feed(n, held[n])]
    assert [k for k, _ in out] == [k for k, _ in exporter.items]
    return dict(out)


@pytest.mark.parametrize("family", MOE_AND_HYBRID)
def test_checkpoints_as_saved_train_through_the_generic_path(tmp_path, family, capsys):
    """Tiny random models saved by transformers (one tensor per expert on disk, fused in memory; DeepSeek-V3's and
    GLM-4.5's router score bias, a persistent buffer; Qwen3-Next's and Qwen3.5's gated delta-net through
    transformers' own code; Qwen3-Next's load-balancing loss) end fp32 streamed training through the generic path
    with transformers + torch AdamW's weights, losses and norms; the export holds the input's tensor names and
    shapes and loads with from_pretrained to the same logits."""
    model_dir = save_tiny_model(family, tmp_path / "model")
    saved = load_file(model_dir / "model.safetensors")
    back = round_trip(model_dir)  # load -> export: the same tensors, bit for bit
    assert set(back) == set(saved) and all(torch.equal(back[k], saved[k]) for k in saved)
    data_dir = tmp_path / "data"
    name = write_tokenized_dataset(data_dir)
    norms: list[float] = []
    losses: list[float] = []
    ref = reference_training(model_dir, data_dir, name, norms, losses)
    tiermem = {"tiers": {"gpu": {"device": "cpu"}, "dram": {"budget": "64MiB"}}}
    capsys.readouterr()
    assert run_cli(tmp_path, model_dir, data_dir, name, tiermem, tiermem_model_path="generic") == 0
    said = capsys.readouterr().out
    hybrid = family in ("qwen3_next", "qwen3_5")  # (the run says which implementation its linear attention runs)
    assert ("note: the linear attention runs " in said) == hybrid, said
    out = tmp_path / "out"
    assert_same_weights(out, ref, tied=False)
    log = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    assert [r["grad_norm"] for r in log] == pytest.approx(norms, rel=1e-5)
    assert [r["loss"] for r in log] == pytest.approx(losses, rel=1e-5)
    shapes = {k: v.shape for k, v in saved.items()}
    assert {k: v.shape for k, v in load_file(out / "model.safetensors").items()} == shapes
    got = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    (tmp_path / "ref").mkdir()  # (the reference's weights as saved: from_pretrained converts them as it does ours)
    save_file({k: v.contiguous() for k, v in ref.items()}, tmp_path / "ref" / "model.safetensors")
    shutil.copy(model_dir / "config.json", tmp_path / "ref")
    want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32)
    ids = torch.randint(1, 96, (2, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(got(ids).logits, want(ids).logits, rtol=1e-4, atol=1e-4)


def test_a_model_from_config_alone_exports_the_layout_save_pretrained_writes(tmp_path):
    """tiermem_init: random with a model directory of config.json alone: the export (and a checkpoint) holds the
    tensors save_pretrained writes (one per expert, the router's score bias), and loads with from_pretrained with
    nothing missing or unexpected."""
    model_dir = save_tiny_model("deepseek_v3", tmp_path / "model")
    saved = {k: v.shape for k, v in load_file(model_dir / "model.safetensors").items()}
    (model_dir / "model.safetensors").unlink()
    data_dir = tmp_path / "data"
    name = write_tokenized_dataset(data_dir)
    tiermem = {"tiers": {"gpu": {"device": "cpu"}, "dram": {"budget": "64MiB"}}}
    assert run_cli(tmp_path, model_dir, data_dir, name, tiermem, tiermem_init="random", max_steps=1, save_steps=1,
                   tiermem_model_path="generic") == 0
    for out in (tmp_path / "out", tmp_path / "out" / "checkpoint-1"):
        assert {k: v.shape for k, v in load_file(out / "model.safetensors").items()} == saved
        _, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


def test_a_random_start_is_drawn_as_transformers_draws_it(tmp_path):
    """tiermem_init: random through the generic path: each weight drawn as transformers' initialize_weights draws
    it, parents' _init_weights included (Qwen3-Next's MoE block initialises its router's weight: it had been left
    as uninitialised memory), and the store's every tensor drawn alone (no fused experts module made whole)."""
    from trainer.model.select import load_model

    save_tiny_model("qwen3_next", tmp_path / "model")
    cfg = load_model(tmp_path / "model", "generic")
    hf = transformers.AutoModelForCausalLM.from_config(hf_config("qwen3_next"), dtype=torch.float32)
    want = dict(hf.named_parameters())
    gen = torch.Generator().manual_seed(0)
    for w in cfg.weights():
        t = cfg.init_weight(w, gen, torch.device("cpu"))
        ref = want[w.name].detach()
        assert t.shape == ref.shape and torch.isfinite(t).all(), w.name
        if ref.numel() > 64 and ref.std() > 0:  # (drawn: the same spread)
            assert 0.7 < float(t.std() / ref.std()) < 1.4, w.name
        else:  # (a constant: ones, zeros)
            assert torch.equal(t, ref) or ref.numel() <= 64, w.name
    assert all(p.device.type == "meta" for p in cfg.model.parameters())


def test_a_model_larger_than_memory_is_described_without_its_weights():
    """The generic path builds the model on the meta device as from_pretrained does (DeepSeek-V3's fused experts
    are 30 GB a layer: more than a CI machine holds, which had refused it), its buffers drawn by the model's own
    _init_weights; active parameters count the routed experts at top_k of num_experts."""
    import importlib.util
    from pathlib import Path

    from trainer.model.generic_config import generic_config

    tool = Path(__file__).parent.parent / "tools" / "make_shape_run.py"
    spec = importlib.util.spec_from_file_location("shapes", tool)
    shapes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shapes)
    raw = dict(shapes.SHAPES["deepseek-v3"], num_hidden_layers=4)  # (3 dense, then 256 experts of 3 x 7168 x 2048)
    cfg = generic_config(raw)
    assert cfg.moe.sparse_layers == (3,) and cfg.moe.kind == "generic-no-aux"
    experts = 256 * 3 * 7168 * 2048
    assert cfg.num_params() - cfg.num_params(active=True) == experts - experts * 8 // 256
    assert cfg.layer_params(3) - cfg.layer_params(3, active=True) == experts - experts * 8 // 256  # (the planner's)
    assert (cfg.expert_params(3), cfg.expert_params(3, active=True), cfg.expert_params(0)) == (
        experts, experts * 8 // 256, 0)  # (the planner's routed experts' share, trainer.planning.plan_workload)
    # where transformers records no router logits (DeepSeek-V3 in 5.17: no MoeSpec), config.json still counts them
    unrecorded = dataclasses.replace(cfg, moe=None, routers=())
    assert unrecorded.num_params(active=True) == cfg.num_params(active=True)
    bias = cfg.buffers()["model.layers.3.mlp.gate.e_score_correction_bias"]
    assert bias.device.type == "cpu" and torch.equal(bias, torch.zeros(256))
    assert all(p.device.type == "meta" for p in cfg.model.parameters())


@pytest.mark.slow
def test_a_resumed_run_routes_with_the_checkpoint_s_score_bias(tmp_path):
    """A generic-path run resumed from its checkpoint (DeepSeek-V3: a persistent router score bias, which the store
    does not hold, read back from the checkpoint's model files) ends with the weights of the run that was not
    interrupted, bit for bit."""
    model_dir = save_tiny_model("deepseek_v3", tmp_path / "model")
    data_dir = tmp_path / "data"
    name = write_tokenized_dataset(data_dir)
    tiermem = {"tiers": {"gpu": {"device": "cpu"}, "dram": {"budget": "64MiB"}}}
    assert run_cli(tmp_path, model_dir, data_dir, name, tiermem, tiermem_model_path="generic", save_steps=3) == 0
    whole = load_file(tmp_path / "out" / "model.safetensors")
    (model_dir / "model.safetensors").rename(tmp_path / "moved.safetensors")  # (the bias from the checkpoint alone)
    assert run_cli(tmp_path, model_dir, data_dir, name, tiermem, tiermem_model_path="generic",
                   output_dir=str(tmp_path / "again"), resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"),
                   tiermem_init="random") == 0
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert set(again) == set(whole) and all(torch.equal(again[k], whole[k]) for k in whole)


@pytest.mark.slow
def test_sharded_checkpoints_convert_across_their_files(tmp_path, monkeypatch):
    """A checkpoint whose experts' tensors lie in several shards (save_pretrained's max_shard_size) loads through the
    generic path, and the export, sharded too, names every tensor as the input's index does."""
    import trainer.outputs.weights_io as weights_io

    model_dir = tmp_path / "model"
    single = save_tiny_model("qwen3_next", tmp_path / "single")
    transformers.AutoModelForCausalLM.from_pretrained(single).save_pretrained(model_dir, max_shard_size="20KB")
    saved = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(saved.values())) > 2
    data_dir = tmp_path / "data"
    name = write_tokenized_dataset(data_dir)
    monkeypatch.setattr(weights_io, "SHARD_BYTES", 40_000)
    tiermem = {"tiers": {"gpu": {"device": "cpu"}, "dram": {"budget": "64MiB"}}}
    assert run_cli(tmp_path, model_dir, data_dir, name, tiermem, tiermem_model_path="generic", max_steps=1) == 0
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(saved) and len(set(index.values())) > 1
    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


@pytest.mark.parametrize("change,said", [("drop", "(4 of mlp.experts.*.gate_proj.weight, 3 of mlp.experts.*.up_proj"),
                                         ("extra", "(4 of mlp.experts.*.gate_proj.weight, 5 of mlp.experts.*.up_proj")])
def test_a_checkpoint_that_does_not_convert_is_refused_in_one_line(tmp_path, capsys, change, said):
    """An expert's tensor missing from its set, or one more than the model has: one line naming the set and what it
    holds, exit code 2, nothing written to output_dir."""
    model_dir = save_tiny_model("deepseek_v3", tmp_path / "model")
    tensors = load_file(model_dir / "model.safetensors")
    key = "model.layers.1.mlp.experts.3.up_proj.weight"
    if change == "drop":
        del tensors[key]
    else:
        tensors[key.replace(".3.", ".9.")] = tensors[key].clone()
    save_file(tensors, model_dir / "model.safetensors")
    data_dir = tmp_path / "data"
    name = write_tokenized_dataset(data_dir)
    tiermem = {"tiers": {"gpu": {"device": "cpu"}, "dram": {"budget": "64MiB"}}}
    capsys.readouterr()
    assert run_cli(tmp_path, model_dir, data_dir, name, tiermem, tiermem_model_path="generic") == 2
    err = capsys.readouterr().err
    assert err.startswith("tiermem-train: error: ") and err.count("\n") == 1 and said in err, err
    assert not (tmp_path / "out").exists()
