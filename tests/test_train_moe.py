"""Mixture-of-experts models train exactly: tiny Qwen3-MoE (a dense layer among sparse ones, renormalised
top-k), Mixtral and gpt-oss (through the template: sinks, sliding windows, yarn, the clamped experts with biases),
with the router's load-balancing loss on, end fp32 streamed training with the same weights, losses and gradient
norms as transformers + torch AdamW; the export loads with from_pretrained. The
grouped expert computation and the load-balancing loss match a plain per-token reading of them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.test_train_parity import HP, assert_same_weights, nvme_moments, reference_training, run_cli
from tests.tiny_models import save_tiny_model, write_tokenized_dataset
from trainer.model.config import MoeSpec
from trainer.model.moe import RouterStats, experts, grouped_available, moe_ffn, route

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family,passes", [pytest.param("qwen3_moe", 2, marks=pytest.mark.slow), ("mixtral", 1),
                                           pytest.param("gpt_oss", 2, marks=pytest.mark.slow)])
def test_moe_training_matches_transformers(tmp_path, family, passes):
    model_dir = save_tiny_model(family, tmp_path / "model")
    data_dir = tmp_path / "data"
    name = write_tokenized_dataset(data_dir)
    norms: list[float] = []
    losses: list[float] = []
    ref = reference_training(model_dir, data_dir, name, norms, losses)
    assert max(norms) > HP["max_grad_norm"], "the test must make clipping trigger"
    budget = {"tiermem_activation_budget": "1KiB"} if passes > 1 else {}  # one layer-major pass per micro-batch
    assert run_cli(tmp_path, model_dir, data_dir, name, nvme_moments(tmp_path), tiermem_model_path="template",
                   **budget) == 0
    out = tmp_path / "out"
    assert_same_weights(out, ref, tied=False)
    log = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    assert [r["grad_norm"] for r in log] == pytest.approx(norms, rel=1e-5)
    assert [r["loss"] for r in log] == pytest.approx(losses, rel=1e-5)

    # the load-balancing loss is in what was matched: training without it ends elsewhere
    cfg = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(dict(cfg, output_router_logits=False)))
    without = reference_training(model_dir, data_dir, name, [])
    got = load_file(out / "model.safetensors")
    assert max(float((got[n] - without[n]).norm() / without[n].norm()) for n in got) > 1e-3

    if family in ("mixtral", "gpt_oss"):  # the export loads in transformers and computes the reference's logits
        ref_dir = tmp_path / "ref"
        ref_dir.mkdir()
        (ref_dir / "config.json").write_text(json.dumps(cfg))
        save_file({n: t.contiguous() for n, t in ref.items()}, ref_dir / "model.safetensors")
        ids = torch.randint(1, 96, (2, 11), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            got_logits = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids).logits
            want_logits = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)(ids).logits
        torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)


def _spec(norm: bool) -> MoeSpec:
    return MoeSpec(5, 2, 8, norm, (0,), "mlp", ("gate_proj", "up_proj", "down_proj"), 0.1)


def _expert_weights(spec: MoeSpec, hidden: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    w = {"mlp.gate.weight": torch.randn(spec.num_experts, hidden, generator=g)}
    for e in range(spec.num_experts):
        w[f"mlp.experts.{e}.gate_proj.weight"] = torch.randn(8, hidden, generator=g)
        w[f"mlp.experts.{e}.up_proj.weight"] = torch.randn(8, hidden, generator=g)
        w[f"mlp.experts.{e}.down_proj.weight"] = torch.randn(hidden, 8, generator=g)
    return w


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("norm", [False, True])
def test_grouped_experts_match_a_per_token_loop(norm, grouped, monkeypatch):
    """Either way of running the experts (torch's grouped matmuls, one matmul chain per expert) computes what
    a plain loop over the tokens and their top-k experts computes."""
    monkeypatch.setenv("TIERMEM_MOE_GROUPED", "1" if grouped else "0")
    g = torch.Generator().manual_seed(0)
    spec, n, hidden = _spec(norm), 23, 8
    h = torch.randn(n, hidden, generator=g)
    w = _expert_weights(spec, hidden, g)
    assert grouped_available(h, 8) == (grouped and hasattr(torch, "_grouped_mm"))
    got = moe_ffn(w, h.view(1, n, hidden), spec, None).view(n, hidden)
    want = torch.zeros(n, hidden, dtype=torch.float64)
    for t in range(n):
        p = torch.softmax(w["mlp.gate.weight"] @ h[t], dim=0)
        top = torch.topk(p, spec.top_k)
        weights = top.values / top.values.sum() if norm else top.values
        for wt, e in zip(weights.double(), top.indices.tolist()):
            x = h[t].double()
            gate, up, down = (w[f"mlp.experts.{e}.{p}_proj.weight"].double() for p in ("gate", "up", "down"))
            want[t] += wt * (down @ (torch.nn.functional.silu(gate @ x) * (up @ x)))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert route(h, w["mlp.gate.weight"], 2, norm)[2].unique().numel() > 2  # tokens spread over the experts


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
def test_grouped_and_per_expert_matmuls_agree_with_an_idle_expert():
    g = torch.Generator().manual_seed(1)
    spec, n, hidden = _spec(True), 19, 8
    w = _expert_weights(spec, hidden, g)
    h = torch.randn(n, hidden, generator=g)
    _, top_w, top_i = route(h, w["mlp.gate.weight"], 2, True)
    top_i = torch.where(top_i == 4, 0, top_i)  # expert 4 gets no token: an empty group

    def run(grouped):
        leaves = {k: t.clone().requires_grad_() for k, t in w.items() if "experts" in k}
        x = h.clone().requires_grad_()
        ws = [tuple(leaves[f"mlp.experts.{e}.{p}_proj.weight"] for p in ("gate", "up", "down"))
              for e in range(spec.num_experts)]
        y = experts(x, top_w, top_i, ws, grouped=grouped)
        return [y, *torch.autograd.grad(y, [x, *leaves.values()], torch.ones_like(y), allow_unused=True)]

    for name, a, b in zip(["output", "input", *[k for k in w if "experts" in k]], run(True), run(False)):
        a = torch.zeros_like(b) if a is None and b is not None else a
        b = torch.zeros_like(a) if b is None and a is not None else b
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_load_balancing_loss_and_its_gradient_match_transformers():
    """Counted layer by layer (forward), the loss equals transformers' over all layers' logits with the
    padding masked; the frozen per-layer terms differentiate to the gradient of transformers' loss."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    g = torch.Generator().manual_seed(1)
    spec = MoeSpec(6, 2, 4, True, (0, 1, 2), "mlp", ("gate_proj", "up_proj", "down_proj"), 0.1)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    logits = [torch.randn(10, 6, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    want = load_balancing_loss_func(tuple(logits), 6, 2, mask)
    want_grads = torch.autograd.grad(want, logits)
    stats = RouterStats(mask, 10, spec, 1.0, torch.device("cpu"))
    for lg in logits:
        stats.observe(lg.detach(), torch.topk(torch.softmax(lg.detach(), -1), 2).indices)
    assert float(stats.freeze()) == pytest.approx(float(want.detach()), rel=1e-6)  # (both count in fp32)
    for lg, wg in zip(logits, want_grads):
        stats.observe(lg, None)
        torch.testing.assert_close(torch.autograd.grad(stats.take_term(), lg)[0], wg)


def test_the_load_balancing_loss_is_on_as_config_json_or_moe_aux_loss_coef_says():
    from trainer.model.config import load_balancing_coef, model_config_from_dict

    base = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 8, "hidden_size": 16, "intermediate_size": 8,
            "num_hidden_layers": 4, "num_attention_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 8, "mlp_only_layers": [0], "decoder_sparse_step": 1, "router_aux_loss_coef": 0.01}
    off = model_config_from_dict(base)  # (published configs: output_router_logits false)
    assert off.moe.aux_loss_coef == 0.0 and off.moe.sparse_layers == (1, 2, 3)
    assert model_config_from_dict(dict(base, output_router_logits=True)).moe.aux_loss_coef == 0.01
    assert load_balancing_coef(off, 0.02).moe.aux_loss_coef == 0.02
    assert load_balancing_coef(model_config_from_dict(dict(base, output_router_logits=True)), 0).moe.aux_loss_coef == 0
    assert load_balancing_coef(off, None) is off
    every_other = model_config_from_dict(dict(base, mlp_only_layers=[], decoder_sparse_step=2))
    assert every_other.moe.sparse_layers == (1, 3)
    assert every_other.num_params() - every_other.num_params(active=True) == 2 * 2 * every_other.moe.expert_params(16)
