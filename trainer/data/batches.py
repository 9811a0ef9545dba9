"""Which rows make up each optimizer step, and micro-batch tensors.

An epoch visits the rows in a shuffled order (``torch.randperm`` seeded with ``seed + epoch``), cut into
micro-batches of ``per_device_train_batch_size`` rows (the last may be smaller). An optimizer step takes
``gradient_accumulation_steps`` micro-batches; the last step of an epoch takes what is left. A
micro-batch is right-padded to its longest row; padded positions get label -100.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def epoch_order(n_rows: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(n_rows, generator=g).tolist()


@dataclass
class StepPlan:
    n_rows: int
    batch_size: int
    accum: int
    seed: int

    @property
    def batches_per_epoch(self) -> int:
        return math.ceil(self.n_rows / self.batch_size)

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.batches_per_epoch / self.accum)

    def total_steps(self, num_train_epochs: float, max_steps: int) -> int:
        if max_steps > 0:
            return max_steps
        return max(1, math.ceil(num_train_epochs * self.steps_per_epoch))

    def rows_of_step(self, step: int) -> list[list[int]]:
        """Row indices of each micro-batch of optimizer step ``step`` (0-based)."""
        epoch, k = divmod(step, self.steps_per_epoch)
        order = epoch_order(self.n_rows, self.seed, epoch)
        first = k * self.accum
        last = min(first + self.accum, self.batches_per_epoch)
        return [order[b * self.batch_size: (b + 1) * self.batch_size] for b in range(first, last)]

    def epoch_of(self, steps_done: int) -> float:
        return steps_done / self.steps_per_epoch


def collate(input_ids: list[list[int]], labels: list[list[int] | None], pad_id: int):
    """(input_ids [B, T], labels [B, T], tokens, mask [B, T]): int64 tensors right-padded to the longest row,
    the number of real (non-padding) tokens, and which positions are real (bool)."""
    t = max(len(r) for r in input_ids)
    ids = torch.full((len(input_ids), t), pad_id, dtype=torch.long)
    lab = torch.full((len(input_ids), t), -100, dtype=torch.long)
    for i, (r, lr) in enumerate(zip(input_ids, labels)):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        lab[i, : len(r)] = torch.tensor(r if lr is None else lr, dtype=torch.long)
    mask = torch.arange(t).unsqueeze(0) < torch.tensor([len(r) for r in input_ids]).unsqueeze(1)
    return ids, lab, sum(len(r) for r in input_ids), mask
