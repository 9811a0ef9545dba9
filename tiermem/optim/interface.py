"""What the trainer's executor, the checkpoint saver and the service call an optimizer.

Two implementations: ``StoreAdamW`` (the store's own AdamW: an embedded run, the service's runs, the
trainer's GPU worker when attached) and ``tiermem.service.client.RemoteOptimizer`` (an attached trainer's: a
step is committed to the service, which updates the groups its CPU takes; the trainer's own GPU worker,
a ``StoreAdamW``, the rest); with several ranks the trainer's own (``trainer.parallel.dp.OwnerOptimizer``,
``trainer.parallel.dp_service.RankRemoteOptimizer``). Everything an implementation needs is given to its
constructor; what is set later are the checkpoint gates (``set_gate``, ``set_part_gate``), since the savers that
own them are made after.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from typing import Protocol

from tiermem.specs import Group

# gate(group, update) blocks until update number ``update`` may change the group's state (a checkpoint being
# written reads it first); returns the seconds it waited
Gate = Callable[[Group, int], float]


class Optimizer(Protocol):
    groups: list[Group]  # the groups it updates, in update order
    gpu_share: float  # the share of the streamed groups updated on the GPU
    last_step_seconds: float  # the last finished update, from its start to its last group's new version
    last_split: dict[str, float]  # ... and where its time went

    def step(self, step: int, lr: float, grad_scale: float | None = None) -> cf.Future:
        """Start update number ``step`` (1-based) of every group, the gradients having been handed to the
        store (divided by ``grad_scale`` when clipping); each group's version becomes ``step`` when its new
        compute copy is home."""

    def wait(self) -> None:
        """Until every group holds the last update; raises the optimizer's failure."""

    def check(self) -> None:
        """Raise the optimizer's failure, if it had one (cheap: called while waiting for versions)."""

    def close(self) -> None:
        """Stop the workers (after the update in flight)."""

    def grads_on_gpu(self, group: Group) -> bool:
        """True when the group's gradient, made on the GPU, should be offered there (``store.offer``)."""

    def grads_home(self, group: Group) -> bool:
        """True when the group's gradient must go home to the store."""

    def set_gate(self, gate: Gate | None) -> None:
        """Make every group's update wait for ``gate`` first (a checkpoint saver's)."""

    def set_part_gate(self, gate: Gate | None) -> None:
        """This process also writes its part of each checkpoint (several ranks: the state its HBM holds, which no
        other process reads): every group's update waits for ``gate`` too."""

    def expect_save(self, step: int) -> None:
        """Another process saves checkpoint-``step`` (several ranks: the lead's saver): update ``step + 1`` of each
        group this optimizer updates waits until that saver has read the group. (A saver in this process gates
        the updates through ``set_gate``: nothing more to do.)"""

    def wait_all(self, step: int) -> None:
        """Until every group, this optimizer's or another rank's, holds update ``step`` whole (before the export);
        raises the optimizer's failure."""

    def resplit(self, on_gpu) -> None:
        """From the next step on, the GPU worker updates the groups in ``on_gpu``, the CPU worker the others (the
        split the first steps' measures chose); called between steps."""
