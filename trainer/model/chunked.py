"""A decoder layer over a long row in sequence chunks: its working set bounded at any length.

A layer is token-wise but for its attention: the input norm and the q/k/v projections (with RoPE and a
Qwen3's q/k norms) of a token need only that token (``pre_attention``), and so do the output projection, the
second norm and the feed-forward (``post_attention``). Over a row of T tokens the layer runs these in chunks of
at most ``chunk`` tokens of each row, and the attention over the whole row (PyTorch's SDPA with ``is_causal``:
its flash or memory-efficient kernels on CUDA, no [T, T] scores and no mask tensor). What exists whole is
hidden-wide (the input, q, k, v, the attention's output, the output and their gradients); the feed-forward's
intermediate-wide activations (14336 wide on the Llama-3.1-8B shape: 15 GB a row of 524,288 tokens in bf16)
exist for one chunk at a time.

The backward recomputes in the same pieces, in reverse: q, k, v for the whole row (no graph), the attention
with its graph, each chunk's ``post_attention`` with its graph and its backward (the attention output's and
the input's gradients, and the weights'), the attention's backward, and each chunk's ``pre_attention`` again
with its backward. The weights' gradients are added chunk by chunk in fp32. The same function as
``trainer.model.layers.decoder_layer``, to rounding (the weights' gradients are sums over chunks).

A kept layer (``tiermem_keep_activations``) keeps the attention's graph from its forward (q, k, v, the output and
what the kernel saves: about 2.5 hidden-wide tensors a token on Llama's shapes, no wider one): its backward then
runs neither the q/k/v nor the attention's forward again, the costliest recompute of a long row (the attention
grows with the row's square).

    y = forward(w, x, rope, cfg, window, chunk, parts)
    y, kept = forward(w, x, rope, cfg, window, chunk, parts, keep=True)
    gx, gws = backward(w, x, gy, rope, cfg, window, chunk, parts[, kept])     # gws in w's order, fp32
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.model.attention import attention
from trainer.model.layers import _linear, _rotate_half, rms_norm
from trainer.model.moe import moe_ffn

# rows of at most this many tokens run whole (auto); longer ones in chunks of at most AUTO_CHUNK tokens
AUTO_WHOLE = 16384
AUTO_CHUNK = 8192


def chunk_of(setting: int | None, rows: int, t: int) -> int | None:
    """The chunk (tokens of each row) a layer over ``rows`` x ``t`` tokens runs in, or None: the row whole.
    ``setting`` (tiermem_seq_chunk): tokens of a chunk, all rows together; None: auto (rows of up to
    AUTO_WHOLE tokens whole, longer ones in equal chunks of at most AUTO_CHUNK tokens)."""
    limit = AUTO_CHUNK if setting is None else setting
    if (setting is None and rows * t <= AUTO_WHOLE) or rows * t <= limit:
        return None
    per_row = max(1, limit // rows)
    n = -(-t // per_row)
    return -(-t // n)  # (equal chunks: one compiled shape)


def spans(t: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk, t)) for s in range(0, t, chunk)]


def pre_attention(w: dict[str, torch.Tensor], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg):
    """q, k, v [B, c, heads, D] of a chunk ``x`` [B, c, H] (RoPE of its positions: ``cos``, ``sin`` [c, D])."""
    b, c, _ = x.shape
    h = rms_norm(x, w["input_layernorm.weight"], cfg.rms_norm_eps, cfg.norm_weight_fp32)
    q = _linear(h, w, "self_attn.q_proj").view(b, c, cfg.num_heads, cfg.head_dim)
    k = _linear(h, w, "self_attn.k_proj").view(b, c, cfg.num_kv_heads, cfg.head_dim)
    v = _linear(h, w, "self_attn.v_proj").view(b, c, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, w["self_attn.q_norm.weight"], cfg.rms_norm_eps)
        k = rms_norm(k, w["self_attn.k_norm.weight"], cfg.rms_norm_eps)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v


def post_attention(w: dict[str, torch.Tensor], x: torch.Tensor, a: torch.Tensor, cfg) -> torch.Tensor:
    """The layer's output for a chunk: its input ``x`` [B, c, H] and attention output ``a`` [B, c, Hq * D]."""
    x = x + _linear(a, w, "self_attn.o_proj")
    h = rms_norm(x, w["post_attention_layernorm.weight"], cfg.rms_norm_eps, cfg.norm_weight_fp32)
    if "mlp.gate_proj.weight" not in w:
        return x + moe_ffn(w, h, cfg.moe, None)
    return x + _linear(F.silu(_linear(h, w, "mlp.gate_proj")) * _linear(h, w, "mlp.up_proj"), w, "mlp.down_proj")


def _qkv(w, x, rope, cfg, chunk, pre):
    """q, k, v of the whole row [B, T, heads, D], computed chunk by chunk (no graph)."""
    b, t, _ = x.shape
    q = x.new_empty(b, t, cfg.num_heads, cfg.head_dim)
    k = x.new_empty(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = torch.empty_like(k)
    with torch.no_grad():
        for s, e in spans(t, chunk):
            q[:, s:e], k[:, s:e], v[:, s:e] = pre(w, x[:, s:e], rope[0][s:e], rope[1][s:e], cfg)
    return q, k, v


_EXPAND: dict = {}  # (dtype, heads, kv heads, head dim) -> whether the fused kernels need k, v expanded to q's heads


def _fused(q, k, v, sinks, window):
    """The attention on CUDA through the fused kernels only (flash, cuDNN, memory-efficient): the math kernel's
    [T, T] scores of a long row would not fit, so it is never chosen silently. Where none of them takes grouped
    KV heads, k and v are expanded to q's heads (a hidden-wide tensor, not an s-squared one)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    key = (q.dtype, q.shape[1], k.shape[1], q.shape[-1])
    with sdpa_kernel(fused):
        if not _EXPAND.get(key, False):
            try:
                out = attention(q, k, v, sinks, window)
                _EXPAND[key] = False
                return out
            except RuntimeError:
                if k.shape[1] == q.shape[1]:
                    raise
                _EXPAND[key] = True
        groups = q.shape[1] // k.shape[1]
        return attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), sinks, window)


def _attend(q, k, v, sinks, window, cfg):
    """The attention over the whole row, [B, T, Hq * D] (no [T, T] scores on CUDA: ``_fused``; gpt-oss's sinks and
    windows through flex attention there, ``trainer.model.attention``)."""
    b, t = q.shape[:2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    plain = sinks is None and (window is None or window >= t)
    a = _fused(q, k, v, sinks, window) if q.is_cuda and plain else attention(q, k, v, sinks, window)
    return a.transpose(1, 2).reshape(b, t, cfg.q_size)


def forward(w: dict[str, torch.Tensor], x: torch.Tensor, rope, cfg, window: int | None, chunk: int,
            parts=(pre_attention, post_attention), keep: bool = False):
    """The decoder layer over ``x`` [B, T, H] in chunks of ``chunk`` tokens (no gradient). ``parts``: the
    (pre, post) functions to run (compiled or these). ``keep``: (output, the attention's graph) instead: the
    ``kept`` of a ``backward`` that runs neither the q/k/v nor the attention's forward again."""
    pre, post = parts
    t = x.shape[1]
    with torch.no_grad():
        q, k, v = _qkv(w, x, rope, cfg, chunk, pre)
    if keep:  # (sinks: a leaf of the graph, for their gradient)
        sinks = w["self_attn.sinks"].detach().requires_grad_() if "self_attn.sinks" in w else None
        q, k, v = q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
        with torch.enable_grad():
            a = _attend(q, k, v, sinks, window, cfg)
        kept = (q, k, v, a, sinks)
        a = a.detach()
    else:
        with torch.no_grad():
            a = _attend(q, k, v, w.get("self_attn.sinks"), window, cfg)
    del q, k, v
    with torch.no_grad():
        y = torch.empty_like(x)
        for s, e in spans(t, chunk):
            y[:, s:e] = post(w, x[:, s:e], a[:, s:e], cfg)
    return (y, kept) if keep else y


def kept_skips(w: dict[str, torch.Tensor], x: torch.Tensor, rope, cfg, window: int | None, chunk: int,
               pre=pre_attention) -> None:
    """What a kept layer's backward does not run again (no gradient): q, k, v of the whole row and the
    attention's forward (the planner times it: the recompute a kept layer over a row cut into chunks saves)."""
    with torch.no_grad():
        q, k, v = _qkv(w, x, rope, cfg, chunk, pre)
        _attend(q, k, v, w.get("self_attn.sinks"), window, cfg)


def _add(acc: dict, names: list[str], grads) -> None:
    for n, g in zip(names, grads):
        if g is None:
            continue
        if n in acc:
            acc[n].add_(g)
        else:
            acc[n] = g.float()


def backward(w: dict[str, torch.Tensor], x: torch.Tensor, gy: torch.Tensor, rope, cfg, window: int | None,
             chunk: int, parts=(pre_attention, post_attention), kept: tuple | None = None):
    """Recompute the layer over ``x`` in chunks and backpropagate ``gy``: (input gradient, the weights'
    gradients in fp32 in ``w``'s order). The input gradient is written over ``gy`` chunk by chunk, once each chunk
    of it has been used (a row-long tensor fewer at the attention's backward): ``gy`` is the caller's no more.
    ``kept``: the attention's graph of ``forward(keep=True)`` (q, k, v, its output, the sinks' leaf), taken instead
    of computing them again (the same values: the same gradients, bit for bit)."""
    pre, post = parts
    t = x.shape[1]
    names = list(w)
    leaves = {n: p.detach().requires_grad_() for n, p in w.items()}
    acc: dict = {}
    sinks = leaves.get("self_attn.sinks")
    if kept is not None:
        q, k, v, a, sinks = kept
    else:
        q, k, v = _qkv(w, x, rope, cfg, chunk, pre)
        q, k, v = q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
        with torch.enable_grad():
            a = _attend(q, k, v, sinks, window, cfg)
    a_in = a.detach()
    ga = torch.empty_like(a_in)
    gx = gy  # (each chunk's input gradient over its own output gradient, once that is used)
    for s, e in spans(t, chunk):
        xc = x[:, s:e].detach().requires_grad_()
        ac = a_in[:, s:e].requires_grad_()
        with torch.enable_grad():
            yc = post(leaves, xc, ac, cfg)
            got = torch.autograd.grad(yc, [xc, ac, *leaves.values()], gy[:, s:e], allow_unused=True)
        gx[:, s:e], ga[:, s:e] = got[0], got[1]
        _add(acc, names, got[2:])
        del yc, got
    extra = [sinks] if sinks is not None else []
    got = torch.autograd.grad(a, [q, k, v, *extra], ga)
    del a, ga, a_in
    gq, gk, gv = got[:3]
    if extra:
        _add(acc, ["self_attn.sinks"], got[3:])
    del q, k, v, got
    for s, e in spans(t, chunk):
        xc = x[:, s:e].detach().requires_grad_()
        with torch.enable_grad():
            outs = pre(leaves, xc, rope[0][s:e], rope[1][s:e], cfg)
            got = torch.autograd.grad(outs, [xc, *leaves.values()], [gq[:, s:e], gk[:, s:e], gv[:, s:e]],
                                      allow_unused=True)
        gx[:, s:e] += got[0]
        _add(acc, names, got[1:])
        del outs, got
    return gx, [acc[n] if n in acc else torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                for n, p in w.items()]


def router_refusal(chunk: int) -> str:
    """Why a load-balancing loss cannot run over rows cut into chunks of ``chunk`` tokens (one line)."""
    return (f"a load-balancing loss (moe_aux_loss_coef) over rows cut into sequence chunks ({chunk:,} tokens a "
            "row) is not supported yet: set moe_aux_loss_coef: 0, a larger tiermem_seq_chunk, or a lower cutoff_len")
