"""``tf32`` with Hugging Face's meaning (``TrainingArguments.tf32``): ``true`` lets CUDA's fp32 matmuls and cuDNN
use TF32 (``torch.backends.cuda.matmul.allow_tf32`` and ``torch.backends.cudnn.allow_tf32``), ``false`` forbids
it, unset leaves torch's defaults (fp32 matmuls in full fp32). Set for the run, before anything is computed or
compiled (the plan's timing of a layer included), and put back as they were at its end; a note where it cannot
change anything (no CUDA, a GPU older than Ampere, bf16 compute)."""

from __future__ import annotations

import contextlib

import torch


def flags() -> tuple[bool, bool]:
    """(torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) as they are now."""
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


def set_flags(matmul: bool, cudnn: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = matmul
    torch.backends.cudnn.allow_tf32 = cudnn


def notes(cfg) -> list[str]:
    """Why ``tf32: true`` changes nothing in this run, if it does not."""
    if not cfg.tf32:
        return []
    if not torch.cuda.is_available():
        return ["note: tf32: true has no effect here: there is no CUDA (the CPU computes fp32 matmuls in fp32)"]
    if torch.cuda.get_device_capability() < (8, 0):
        return ["note: tf32: true has no effect on this GPU: TF32 needs compute capability 8.0 (Ampere) or newer"]
    if cfg.bf16:
        return ["note: tf32: true changes little with bf16: true: the layers compute in bf16 (TF32 applies to fp32 "
                "matmuls only)"]
    return []


@contextlib.contextmanager
def tf32_mode(cfg, say):
    """The run's TF32 setting, from its config (``tf32``), for the duration of the ``with``."""
    if cfg.tf32 is None:
        yield
        return
    before = flags()
    set_flags(bool(cfg.tf32), bool(cfg.tf32))
    for line in notes(cfg):
        say(line)
    try:
        yield
    finally:
        set_flags(*before)
