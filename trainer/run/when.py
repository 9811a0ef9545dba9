"""When a run saves a checkpoint and evaluates, as the Hugging Face Trainer decides it: every N steps
(``save_strategy``/``eval_strategy: steps``), at the end of each epoch (``epoch``, the last, partial one
included), or never (``no``)."""

from __future__ import annotations


def saves(cfg) -> bool:
    """Whether the run writes checkpoints at all."""
    return cfg.save_strategy == "epoch" or (cfg.save_strategy == "steps" and bool(cfg.save_steps))


def _due(strategy: str, every: int | None, done: int, steps_per_epoch: int, total: int) -> bool:
    if strategy == "steps":
        return bool(every) and done % every == 0
    if strategy == "epoch":
        return done % steps_per_epoch == 0 or done == total
    return False


def save_due(cfg, done: int, steps_per_epoch: int, total: int) -> bool:
    """Whether checkpoint-``done`` is written once step ``done`` is taken."""
    return _due(cfg.save_strategy, cfg.save_steps, done, steps_per_epoch, total)


def eval_due(cfg, done: int, steps_per_epoch: int, total: int) -> bool:
    """Whether the evaluation loss is computed once step ``done`` is taken."""
    return _due(cfg.eval_strategy, cfg.eval_steps, done, steps_per_epoch, total)
