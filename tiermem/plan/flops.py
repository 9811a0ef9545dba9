"""The FLOPs of a training step a token, as every figure reports them: ``6·N`` (the matmuls of the N parameters
a token computes with, forward and backward: the usual count, which leaves attention out) and attention's.

A layer whose queries are ``q`` wide (heads x head_dim) computes, for each (query, key) pair, the score Q·Kᵀ
and the weighted sum P·V: 2·q FLOPs each in the forward, twice as many in the backward, 12·q a pair in all.
Causal attention over a row of ``s`` tokens: the query at position i attends to i + 1 keys, about s / 2 a
token (the s² term halved, as Megatron's and PaLM's MFU count it); within a sliding window of ``w`` < s
tokens, w - w² / (2s) a token (the first w queries see fewer). Recompute is not counted: a step's FLOPs are
the model's, not the schedule's.

    attention_flops_per_token([(4096, None)] * 32, 131072)    # the 8B shape's 32 layers at one 128k row
"""

from __future__ import annotations


def attended_keys(seq: int, window: int | None = None) -> float:
    """Keys a query attends to on average in a causal row of ``seq`` tokens (``window``: at most that many)."""
    if window is None or window >= seq:
        return seq / 2
    return window - window * window / (2 * seq)


def attention_flops_per_token(layers: list[tuple[int, int | None]], seq: int) -> float:
    """FLOPs of attention's two matmuls a token of a training step (forward and backward), summed over
    ``layers``: each layer's (query width, sliding window or None), at rows of ``seq`` tokens."""
    return sum(12.0 * q * attended_keys(seq, w) for q, w in layers)


def tflops(flops_per_token: float, tokens_per_s: float) -> float:
    """TFLOP/s of ``tokens_per_s`` tokens a second at ``flops_per_token``."""
    return flops_per_token * tokens_per_s / 1e12
