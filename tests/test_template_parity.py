"""The template computes what transformers computes: each RoPE type long-context checkpoints use (linear,
dynamic NTK, yarn with its attention factor, longrope's two factor sets, llama3) on Llama and Qwen3, and gpt-oss
(attention sinks, sliding-window layers shorter than the rows, yarn, the router's bias and top-k softmax, the
clamped SwiGLU experts with biases), forward and backward, at a length beyond the model's positions and one
within them (where dynamic and longrope change their frequencies). The sinks' exact formulation from the
attention's log-sum-exp agrees with flex attention's forward where torch has it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.tiny_models import hf_config, randomize
from trainer.model.config import model_config_from_dict
from trainer.model.layers import rms_norm
from trainer.model.stages import TemplateStages
from trainer.model.weights import EMBED, LM_HEAD, NORM, all_weights

transformers = pytest.importorskip("transformers")

HALF = 6  # head_dim 12 (qwen3) / 8 (llama): longrope's lists have head_dim / 2 entries
ROPES = {  # (the default RoPE: tests/test_train_parity.py)
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "mscale": 0.8,
                    "mscale_all_dim": 0.5, "beta_fast": 16, "truncate": False},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 8, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8},
}


def _model(family: str, rope: str | None):
    extra = {"max_position_embeddings": 16}
    if rope is not None:
        params = dict(ROPES[rope], rope_theta=10000.0)
        if rope == "longrope":
            half = 6 if family == "qwen3" else 4
            params.update(short_factor=[1.0 + 0.1 * i for i in range(half)],
                          long_factor=[1.5 + 0.5 * i for i in range(half)])
        extra.update(rope_parameters=params, rope_scaling=None)  # (tiny llama's own llama3 scaling replaced)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, **extra), dtype=torch.float32)
    randomize(model)
    raw = model.config.to_dict()
    raw["architectures"] = [type(model).__name__]
    cfg = model_config_from_dict(raw)
    assert cfg.rope["rope_type"] == (ROPES[rope]["rope_type"] if rope else "yarn")
    return model, cfg


def _template_logits(cfg, weights: dict, ids: torch.Tensor) -> torch.Tensor:
    stages = TemplateStages(cfg, torch.float32, torch.device("cpu"))
    ctx = stages.contexts([ids], [None], 1, False)[0]
    x = stages.embed({EMBED: weights[EMBED]}, ids, ctx)
    for i in range(cfg.num_layers):
        x = stages.layer(i, {w.local: weights[w.name] for w in all_weights(cfg) if w.group == i}, x, ctx)
    head = weights[EMBED] if cfg.tie_word_embeddings else weights[LM_HEAD]
    return F.linear(rms_norm(x, weights[NORM], cfg.rms_norm_eps, cfg.norm_weight_fp32), head)


CASES = [("llama", r) for r in ROPES] + [("qwen3", r) for r in ROPES] + [("gpt_oss", None)]


@pytest.mark.parametrize("family,rope", CASES, ids=[f"{f}-{r or 'own'}" for f, r in CASES])
def test_the_template_computes_what_transformers_computes(family, rope):
    model, cfg = _model(family, rope)
    if family == "gpt_oss":
        assert cfg.windows == (6, None, 6) and cfg.rope["rope_type"] == "yarn"
    params = dict(model.named_parameters())
    for seq in (24, 7):  # beyond max_position_embeddings (16), then within the original 8 positions
        ids = torch.randint(0, 96, (2, seq), generator=torch.Generator().manual_seed(seq))
        weights = {w.name: params[w.name].detach().clone().requires_grad_() for w in all_weights(cfg)}
        got = _template_logits(cfg, weights, ids)
        want = model(input_ids=ids).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        probe = torch.randn(got.shape, generator=torch.Generator().manual_seed(1))
        got_grads = torch.autograd.grad((got * probe).sum(), list(weights.values()))
        want_grads = torch.autograd.grad((want * probe).sum(), [params[n] for n in weights])
        for name, g, w in zip(weights, got_grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6, msg=f"{name} at {seq} tokens")
    if family == "gpt_oss":  # the clamps and the sinks were in play
        assert float(params["model.layers.0.self_attn.sinks"].detach().abs().max()) > 0.5


def test_dynamic_and_longrope_frequencies_follow_the_length():
    """Beyond the model's positions dynamic NTK grows its base with the length and longrope takes its long
    factors; within them both give their short-length frequencies (as a fresh transformers model does)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for rope in ("dynamic", "longrope"):
        model, cfg = _model("llama", rope)
        for seq in (40, 24, 16, 7):
            kw = {"seq_len": seq} if rope == "dynamic" or seq > 8 else {}
            want, _ = ROPE_INIT_FUNCTIONS[rope](model.config, "cpu", **kw)
            torch.testing.assert_close(cfg.inv_freq(seq), want.float(), rtol=1e-6, atol=0)
        assert not torch.equal(cfg.inv_freq(40), cfg.inv_freq(7))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [None, 5])
def test_sinks_from_the_log_sum_exp_match_flex_attention(window):
    """The CPU's materialised kernel gives flex attention's output and log-sum-exp (forward: flex attention
    has no backward on a CPU; the GPU runs flex), and the sinks applied from it give transformers' eager
    attention with sinks."""
    from trainer.model.attention import attention, plain_with_lse

    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 13, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    sinks = torch.randn(4, generator=g, dtype=torch.float64)
    out, lse = plain_with_lse(q, k, v, window)
    w = window or 13
    mask = fa.create_block_mask(lambda b, h, i, j: (i >= j) & (i - j < w), None, None, 13, 13, device="cpu")
    if hasattr(fa, "AuxRequest"):
        f_out, aux = fa.flex_attention(q, k, v, block_mask=mask, enable_gqa=True, return_aux=fa.AuxRequest(lse=True))
        f_lse = aux.lse
    else:
        f_out, f_lse = fa.flex_attention(q, k, v, block_mask=mask, enable_gqa=True, return_lse=True)
    torch.testing.assert_close(out, f_out)
    torch.testing.assert_close(lse.to(f_lse.dtype), f_lse)
    # transformers' eager attention with sinks: the sink as one more softmax column
    scores = q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 8 ** -0.5
    i = torch.arange(13)
    allowed = (i.view(-1, 1) >= i.view(1, -1)) & (i.view(-1, 1) - i.view(1, -1) < w)
    scores = torch.cat([scores.masked_fill(~allowed, float("-inf")), sinks.view(1, 4, 1, 1).expand(2, 4, 13, 1)], -1)
    want = torch.softmax(scores, -1)[..., :-1] @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(attention(q, k, v, sinks, window), want)
