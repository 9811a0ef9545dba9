"""A model's FLOPs a token of a training step (``tiermem.plan.flops``): 6·N of its active parameters and its
attention's at rows of a given length, each layer at its own query width and window. One count for every
figure: the step lines, ``tiermem plan``, the planner's compute estimate and the benchmarks."""

from __future__ import annotations

from tiermem.plan.flops import attention_flops_per_token


def attention_layers(cfg) -> list[tuple[int, int | None]]:
    """Each decoder layer's (query width, sliding window or None). The generic path's layers are counted at
    hidden_size wide with the model's one window, if any (its layers' own shapes are transformers')."""
    if cfg.generic:
        return [(cfg.hidden_size, cfg.sliding_window)] * cfg.num_layers
    return [(cfg.q_size, cfg.window(i) or cfg.sliding_window) for i in range(cfg.num_layers)]


def flops_per_token(cfg, seq: int) -> tuple[float, float]:
    """(6·N_active, attention's) FLOPs a token of a training step at rows of ``seq`` tokens."""
    return 6.0 * cfg.num_params(active=True), attention_flops_per_token(attention_layers(cfg), seq)
