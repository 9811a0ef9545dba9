"""Learning-rate schedules as ``transformers.get_scheduler`` defines them, stepped once per optimizer
step: the lr of step k (0-based) is ``learning_rate * factor(k)``, so a linear warmup starts at 0."""

from __future__ import annotations

import math


def warmup_steps(total: int, warmup_steps: int, warmup_ratio: float) -> int:
    return warmup_steps if warmup_steps > 0 else math.ceil(total * warmup_ratio)


def lr_factor(kind: str, step: int, total: int, warmup: int) -> float:
    if kind == "constant":
        return 1.0
    if step < warmup:
        return step / max(1, warmup)
    if kind == "constant_with_warmup":
        return 1.0
    if kind == "linear":
        return max(0.0, (total - step) / max(1, total - warmup))
    if kind == "cosine":
        progress = (step - warmup) / max(1, total - warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    raise ValueError(f"unknown lr_scheduler_type {kind!r}")
