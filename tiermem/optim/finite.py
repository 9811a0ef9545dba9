"""Whether an update's new weights are finite: the check the GPU worker makes where it has just written a group's
compute copy, and the error that stops a run whose update made a weight inf or NaN."""

from __future__ import annotations

import torch

from tiermem.errors import UserError
from tiermem.specs import Group


class NonFiniteUpdate(UserError):
    """An update made some of a group's new weights inf or NaN: the run stops, and they are neither saved nor
    exported."""

    def __init__(self, step: int, group: Group):
        super().__init__(f"update {step} made weights of group {group} inf or NaN (from a finite loss and gradient "
                         "norm): the run stops, they are neither saved nor exported, the last checkpoint is intact; "
                         "lower learning_rate (or weight_decay), or raise adam_epsilon")
        self.step, self.group = step, group


def weights_norm(tensors) -> torch.Tensor:
    """The L2 norm of ``tensors`` together (one multi-tensor kernel on their device, not waited for): inf or NaN when
    an element is, and also when the squares of weights beyond ~1e19 overflow (``all_finite`` tells those apart)."""
    return torch.stack(torch._foreach_norm(tensors)).float().norm()


def all_finite(tensors) -> bool:
    """Whether every element of ``tensors`` is finite (exact, and slower: a non-finite ``weights_norm``'s check)."""
    return all(bool(torch.isfinite(t).all()) for t in tensors)
