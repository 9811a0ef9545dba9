"""What the store, the planner and the optimizer share about the training state: the kinds of state, a
tensor's spec and the groups it is streamed in.

A tensor has a name, shape, dtype, kind (``param``, ``grad``, ``master``, ``exp_avg``, ``exp_avg_sq``) and a
group (a layer index, or a named shared group such as "embed"). A basic module: it sits below the store and
the planner, so neither imports the other for these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

KINDS = ("param", "grad", "master", "exp_avg", "exp_avg_sq")
MOMENTS = ("exp_avg", "exp_avg_sq")  # Adam's two moments, fp32

Group = int | str


def state_name(base: str, kind: str) -> str:
    """The store's name for one kind of state of a tensor: the base name for the compute copy
    (``param``), ``kind/base`` for the others (``grad/…``, ``master/…``, ``exp_avg/…``, ``exp_avg_sq/…``)."""
    return base if kind == "param" else f"{kind}/{base}"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str
    group: Group

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown kind {self.kind!r}; kinds are {', '.join(KINDS)}")
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize
