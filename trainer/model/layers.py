"""The Llama-family computation as plain functions of the weights they are handed.

Nothing here owns a parameter: ``decoder_layer(w, x, rope, cfg)`` computes one decoder layer with the
tensors in ``w`` (names relative to the layer, e.g. "self_attn.q_proj.weight"), which may be views into
a streaming slot. Llama 2/3 and Mistral, Qwen2 (q/k/v biases) and Qwen3 (q/k RMSNorm) differ only in
which tensors ``w`` holds; a sparse layer of Qwen3-MoE or Mixtral has the experts' feed-forward
(``trainer.model.moe``) instead of the MLP. gpt-oss's layer has attention sinks and, on alternate layers, a
sliding window (``trainer.model.attention``), biases on every projection, norms whose weight multiplies in fp32,
and its own experts. Attention is causal with grouped KV heads; RoPE's cos/sin tables (``trainer.model.rope``)
come with the micro-batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.model.attention import attention
from trainer.model.config import ModelConfig
from trainer.model.moe import RouterStats, moe_ffn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_fp32: bool = False) -> torch.Tensor:
    """RMSNorm in fp32, cast back to x's dtype before the weight multiplies (Llama's), or after (gpt-oss's:
    ``weight_fp32``)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf).to(dtype) if weight_fp32 else weight * xf.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def _linear(x, w, name):
    return F.linear(x, w[name + ".weight"], w.get(name + ".bias"))


def decoder_layer(w: dict[str, torch.Tensor], x: torch.Tensor, rope, cfg: ModelConfig,
                  router: RouterStats | None = None, window: int | None = None) -> torch.Tensor:
    """One decoder layer: x [B, T, H] -> [B, T, H]; a sparse layer's routing goes to ``router``; ``window``:
    the layer's sliding attention window (None: full causal attention)."""
    b, t, _ = x.shape
    cos, sin = rope[0][:t], rope[1][:t]
    fp32w = cfg.norm_weight_fp32
    h = rms_norm(x, w["input_layernorm.weight"], cfg.rms_norm_eps, fp32w)
    q = _linear(h, w, "self_attn.q_proj").view(b, t, cfg.num_heads, cfg.head_dim)
    k = _linear(h, w, "self_attn.k_proj").view(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = _linear(h, w, "self_attn.v_proj").view(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, w["self_attn.q_norm.weight"], cfg.rms_norm_eps)
        k = rms_norm(k, w["self_attn.k_norm.weight"], cfg.rms_norm_eps)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    a = attention(q, k, v, w.get("self_attn.sinks"), window)
    a = a.transpose(1, 2).reshape(b, t, cfg.q_size)
    x = x + _linear(a, w, "self_attn.o_proj")
    h = rms_norm(x, w["post_attention_layernorm.weight"], cfg.rms_norm_eps, fp32w)
    if "mlp.gate_proj.weight" not in w:
        return x + moe_ffn(w, h, cfg.moe, router)
    m = F.silu(_linear(h, w, "mlp.gate_proj")) * _linear(h, w, "mlp.up_proj")
    return x + _linear(m, w, "mlp.down_proj")


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Targets for each position: the next token's label (-100 after the last)."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)


def head_loss_backward(h: torch.Tensor, targets: torch.Tensor, norm_w: torch.Tensor, head_w: torch.Tensor,
                       eps: float, scale: float, chunk_tokens: int, acc_hw: torch.Tensor | None = None,
                       weight_fp32: bool = False):
    """Final norm + LM head + summed cross-entropy over ``targets`` (-100 ignored), and its backward for
    a loss of ``sum * scale``, chunked over tokens so no [tokens, vocab] logits tensor exists, nor the norm's fp32
    copies of the whole row (the norm is token-wise: each chunk's is the whole row's).

    Returns (loss_sum, grad_h, grad_norm_w fp32, grad_head_w fp32). ``acc_hw``: an fp32 tensor the head weight's
    gradient is added into, chunk by chunk (a step's sum over micro-batches: no vocab x hidden tensor of this
    micro-batch's alone); it is returned as the head weight's gradient.
    """
    hidden = h.shape[-1]
    flat = h.detach().reshape(-1, hidden)
    nw = norm_w.detach().requires_grad_()
    hw = head_w.detach().requires_grad_()
    tgt = targets.reshape(-1)
    grad_flat = torch.empty_like(flat)
    grad_hw = acc_hw if acc_hw is not None else torch.zeros(head_w.shape, dtype=torch.float32, device=head_w.device)
    grad_nw = torch.zeros(norm_w.shape, dtype=torch.float32, device=norm_w.device)
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    for s in range(0, flat.shape[0], chunk_tokens):
        xc = flat[s: s + chunk_tokens].requires_grad_()
        with torch.enable_grad():
            logits = F.linear(rms_norm(xc, nw, eps, weight_fp32), hw).float()
            part = F.cross_entropy(logits, tgt[s: s + chunk_tokens], ignore_index=-100, reduction="sum")
            gx, gnw, gw = torch.autograd.grad(part * scale, [xc, nw, hw])
        grad_flat[s: s + chunk_tokens] = gx
        grad_nw += gnw
        grad_hw += gw
        loss += part.detach()
    return loss, grad_flat.view_as(h), grad_nw, grad_hw


def head_loss(h: torch.Tensor, targets: torch.Tensor, norm_w: torch.Tensor, head_w: torch.Tensor, eps: float,
              chunk_tokens: int, weight_fp32: bool = False) -> torch.Tensor:
    """Summed cross-entropy of the final norm + LM head over ``targets`` (-100 ignored), chunked (the norm too), no
    grad."""
    flat = h.reshape(-1, h.shape[-1])
    tgt = targets.reshape(-1)
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    for s in range(0, flat.shape[0], chunk_tokens):
        logits = F.linear(rms_norm(flat[s: s + chunk_tokens], norm_w, eps, weight_fp32), head_w).float()
        loss += F.cross_entropy(logits, tgt[s: s + chunk_tokens], ignore_index=-100, reduction="sum")
    return loss
