"""Causal self-attention for the template's layers, with grouped KV heads: plain (PyTorch's SDPA: its flash or
memory-efficient kernels on CUDA, no [T, T] scores), or with gpt-oss's attention sinks and sliding windows.

A sink is a learned logit per head that joins every query's softmax as one more column with a zero value:
``y_i = sum_j e^{s_ij} v_j / (sum_j e^{s_ij} + e^{sink})``. SDPA takes neither a sink nor a window without a
materialised mask, so the sinks are applied after the attention from its log-sum-exp ``L_i = log sum_j
e^{s_ij}``: ``y_i = o_i * sigmoid(L_i - sink)``, with ``o`` the plain softmax attention over the window. This
is exact (the same function, rounding aside), and its gradient is too, provided the kernel differentiates its
log-sum-exp output: the sink's gradient, and the share of the queries' and keys' gradients that flows through
the normaliser, come through ``L``.

The kernel that gives ``o`` and ``L``:

- on CUDA, ``torch.nn.attention.flex_attention`` compiled, with a block mask of the causal window: no [T, T]
  scores in memory, blocks wholly outside the window skipped, and its backward takes the log-sum-exp's gradient
  (PyTorch's flash and memory-efficient SDPA kernels return one but do not differentiate it);
- elsewhere (the CPU, where flex attention has no backward; or ``TIERMEM_FLEX_ATTENTION=0``), the scores
  materialised in fp32 per micro-batch, masked, and ``L`` by ``logsumexp``: exact, for short rows.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

_MASKS: dict = {}  # flex attention's block masks, by (length, window, device)
_COMPILED: list = []  # flex attention compiled (once a process)


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention of q [B, Hq, T, D] over k, v [B, Hkv, T, D] (Hq a multiple of Hkv)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None,
              window: int | None = None) -> torch.Tensor:
    """Causal attention of q [B, Hq, T, D] over k, v [B, Hkv, T, D], each query seeing the ``window`` latest
    positions up to its own (None: all of them), with a sink logit per query head (``sinks`` [Hq]; None: none).
    The scale is 1/sqrt(D)."""
    if sinks is None and (window is None or window >= q.shape[2]):
        return causal(q, k, v)
    out, lse = _with_lse(q, k, v, window)
    if sinks is None:
        return out
    wide = torch.promote_types(out.dtype, torch.float32)
    kept = torch.sigmoid(lse.to(wide) - sinks.to(wide).view(1, -1, 1))  # the share of each softmax on the tokens
    return (out.to(wide) * kept.unsqueeze(-1)).to(out.dtype)


def _use_flex(q: torch.Tensor) -> bool:
    return q.device.type == "cuda" and os.environ.get("TIERMEM_FLEX_ATTENTION", "1") != "0"


def _with_lse(q, k, v, window):
    """(attention output, its log-sum-exp [B, Hq, T] in fp32) of the causal window."""
    if _use_flex(q):
        return _flex(q, k, v, window)
    return plain_with_lse(q, k, v, window)


def plain_with_lse(q, k, v, window):
    """The scores materialised (fp32), masked to the causal window; their softmax attention and log-sum-exp."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    t = q.shape[2]
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q, k.transpose(-1, -2)).to(wide) * q.shape[-1] ** -0.5
    pos = torch.arange(t, device=q.device)
    gap = pos.view(-1, 1) - pos.view(1, -1)  # query position - key position
    allowed = (gap >= 0) if window is None else (gap >= 0) & (gap < window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return torch.matmul(probs.to(v.dtype), v), lse


def _flex(q, k, v, window):
    from torch.nn.attention import flex_attention as fa

    t = q.shape[2]
    key = (t, window, q.device)
    if key not in _MASKS:
        if len(_MASKS) > 16:
            _MASKS.clear()
        w = window if window is not None else t

        def in_window(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < w)

        _MASKS[key] = fa.create_block_mask(in_window, None, None, t, t, device=q.device)
    if not _COMPILED:
        _COMPILED.append(torch.compile(fa.flex_attention))
    kwargs = dict(block_mask=_MASKS[key], scale=q.shape[-1] ** -0.5, enable_gqa=q.shape[1] != k.shape[1])
    if hasattr(fa, "AuxRequest"):
        out, aux = _COMPILED[0](q, k, v, return_aux=fa.AuxRequest(lse=True), **kwargs)
        return out, aux.lse
    return _COMPILED[0](q, k, v, return_lse=True, **kwargs)
