"""The model's tensors by Hugging Face name, grouped the way the store streams them.

Groups are "embed" (the token embedding), 0..L-1 (one per decoder layer) and "head" (the final norm
and, unless tied to the embedding, the LM head). Inside a layer the template uses names relative to
the layer ("self_attn.q_proj.weight"); the store and checkpoints use full names.

A sparse (mixture-of-experts) layer's experts are tensors of that layer's group, one per expert and
projection, named as the published checkpoints name them (``mlp.experts.7.gate_proj.weight``,
``block_sparse_moe.experts.7.w1.weight``): every expert is needed by every layer's compute of a batch of
thousands of tokens, so the group is the unit to stream, and the store places its kinds like any other.
gpt-oss's checkpoints keep a layer's experts stacked in four tensors (``mlp.experts.gate_up_proj`` [E, H, 2I]
with gate and up columns interleaved, its bias, ``down_proj`` [E, I, H], its bias) beside the router's weight
and bias: the store holds them so, and the export writes them back unchanged. Weight decay follows the Hugging
Face Trainer's rule (none on biases and norm weights; gpt-oss's attention sinks are decayed as it decays them).
A model taken by the generic path (``trainer.model.generic``) lists its own weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.model.config import ModelConfig

EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class Weight:
    name: str  # the Hugging Face name
    shape: tuple[int, ...]
    group: int | str
    decay: bool  # weight decay applies (not to biases or normalisation weights)
    layer_name: str | None = None  # the name inside its layer, where it is not the name after "model.layers.N."

    @property
    def local(self) -> str:
        """The name inside its layer (for decoder layers), else the full name."""
        if self.layer_name is not None:
            return self.layer_name
        if isinstance(self.group, int):
            return self.name.split(".", 3)[3]
        return self.name


def layer_weights(cfg: ModelConfig, i: int) -> list[Weight]:
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    p = f"model.layers.{i}."
    out = [Weight(p + "input_layernorm.weight", (h,), i, False)]
    for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        out.append(Weight(p + f"self_attn.{proj}.weight", (rows, h), i, True))
        if cfg.attention_bias:
            out.append(Weight(p + f"self_attn.{proj}.bias", (rows,), i, False))
    out.append(Weight(p + "self_attn.o_proj.weight", (h, q), i, True))
    if cfg.o_bias:
        out.append(Weight(p + "self_attn.o_proj.bias", (h,), i, False))
    if cfg.qk_norm:
        out.append(Weight(p + "self_attn.q_norm.weight", (cfg.head_dim,), i, False))
        out.append(Weight(p + "self_attn.k_norm.weight", (cfg.head_dim,), i, False))
    if cfg.sinks:
        out.append(Weight(p + "self_attn.sinks", (cfg.num_heads,), i, True))
    out.append(Weight(p + "post_attention_layernorm.weight", (h,), i, False))
    if cfg.is_sparse(i):
        return out + expert_weights(cfg, i)
    for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
        out.append(Weight(p + f"mlp.{proj}.weight", shape, i, True))
        if cfg.mlp_bias:
            out.append(Weight(p + f"mlp.{proj}.bias", (shape[0],), i, False))
    return out


def expert_weights(cfg: ModelConfig, i: int) -> list[Weight]:
    """A sparse layer's router and experts (each expert's gate, up and down projections)."""
    m, h = cfg.moe, cfg.hidden_size
    p = f"model.layers.{i}.{m.block}."
    if m.kind == "gpt_oss":
        e, inter = m.num_experts, m.intermediate_size
        return [Weight(p + "router.weight", (e, h), i, True), Weight(p + "router.bias", (e,), i, False),
                Weight(p + "experts.gate_up_proj", (e, h, 2 * inter), i, True),
                Weight(p + "experts.gate_up_proj_bias", (e, 2 * inter), i, False),
                Weight(p + "experts.down_proj", (e, inter, h), i, True),
                Weight(p + "experts.down_proj_bias", (e, h), i, False)]
    out = [Weight(p + "gate.weight", (m.num_experts, h), i, True)]
    gate, up, down = m.proj
    for e in range(m.num_experts):
        for proj, shape in ((gate, (m.intermediate_size, h)), (up, (m.intermediate_size, h)),
                            (down, (h, m.intermediate_size))):
            out.append(Weight(p + f"experts.{e}.{proj}.weight", shape, i, True))
    return out


def all_weights(cfg) -> list[Weight]:
    """Every tensor, in forward order: embedding, layers, final norm, LM head."""
    if cfg.generic:  # a model of the generic path lists its own
        return cfg.weights()
    out = [Weight(EMBED, (cfg.vocab_size, cfg.hidden_size), "embed", True)]
    for i in range(cfg.num_layers):
        out += layer_weights(cfg, i)
    out.append(Weight(NORM, (cfg.hidden_size,), "head", False))
    if not cfg.tie_word_embeddings:
        out.append(Weight(LM_HEAD, (cfg.vocab_size, cfg.hidden_size), "head", True))
    return out


def group_order(cfg: ModelConfig) -> list[int | str]:
    """Groups in forward order: the order the optimizer updates them and the next forward needs them."""
    return ["embed", *range(cfg.num_layers), "head"]


def init_weight(w: Weight, cfg: ModelConfig, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """A freshly initialised fp32 tensor, as Hugging Face initialises these models (normal(0, std) for
    matrices, embeddings, gpt-oss's sinks and router bias; ones for norms, zeros for other biases)."""
    if cfg.generic:  # a model of the generic path: as its transformers class initialises it
        return cfg.init_weight(w, gen, device)
    if w.name.endswith("norm.weight"):
        return torch.ones(w.shape, device=device)
    if w.name.endswith((".bias", "_bias")) and not w.name.endswith("router.bias"):
        return torch.zeros(w.shape, device=device)
    t = torch.empty(w.shape, device=device)
    t.normal_(0.0, cfg.initializer_range, generator=gen)
    return t
