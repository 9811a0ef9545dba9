"""Supervised examples as LLaMA-Factory builds them: per turn, the prompt's labels are -100 and the
response's are its tokens (every turn is trained); ``cutoff_len`` cuts each turn's prompt and response in
proportion (``infer_seqlen``); ``train_on_prompt`` trains the prompts too; ``mask_history`` trains only
the last turn and, when cutting, keeps the last turns first."""

from __future__ import annotations

from trainer.data.templates import Template, encode_turns

IGNORE = -100


def infer_seqlen(source_len: int, target_len: int, cutoff_len: int) -> tuple[int, int]:
    """The lengths a (prompt, response) pair is cut to so both fit in ``cutoff_len``."""
    if target_len * 2 < cutoff_len:  # the response is short: cut the prompt
        max_target = cutoff_len
    elif source_len * 2 < cutoff_len:  # the prompt is short: cut the response
        max_target = cutoff_len - source_len
    else:  # both long: share in proportion
        max_target = int(cutoff_len * (target_len / (source_len + target_len)))
    new_target = min(max_target, target_len)
    new_source = min(max(cutoff_len - new_target, 0), source_len)
    return new_source, new_target


def encode_example(template: Template, tok, messages: list[dict], system: str, cutoff_len: int,
                   train_on_prompt: bool = False, mask_history: bool = False) -> tuple[list[int], list[int]]:
    pairs = encode_turns(template, tok, messages, system)
    if mask_history:
        pairs = pairs[::-1]  # the last turns first: they are kept when the example is cut
    input_ids: list[int] = []
    labels: list[int] = []
    total = 0
    for turn, (source, target) in enumerate(pairs):
        if total >= cutoff_len:
            break
        s_len, t_len = infer_seqlen(len(source), len(target), cutoff_len - total)
        source, target = source[:s_len], target[:t_len]
        total += s_len + t_len
        source_labels = list(source) if train_on_prompt else [IGNORE] * s_len
        target_labels = [IGNORE] * t_len if (mask_history and turn != 0) else list(target)
        if mask_history:
            input_ids = source + target + input_ids
            labels = source_labels + target_labels + labels
        else:
            input_ids += source + target
            labels += source_labels + target_labels
    return input_ids, labels
