"""Data parallelism within a step: which rank owns each group, which rows each rank takes, the gradients
reduced to their owners, the exact global norm, and the optimizer of the groups a rank owns.

- **Owners.** Every group (embed, each layer, head) has one owning rank, chosen by bytes of state (the largest
  group first, to the rank with the fewest bytes so far): the owner alone adds the group's gradient to the store
  and updates it, on its share of the host's CPU cores.
- **Rows.** A step takes the rows one process with ``per_device_train_batch_size x world size`` rows a
  micro-batch would take (the seeded order); rank r takes rows ``r*b .. (r+1)*b - 1`` of each micro-batch, as
  the Hugging Face Trainer shards a global batch. A rank may get no rows of a short last micro-batch.
- **Gradients.** As soon as a layer's backward over all of a rank's micro-batches is done, its gradient (one
  flat fp32 buffer) is reduced (summed) to the owner through torch.distributed, asynchronously: the next
  layer's backward runs meanwhile (two reductions in flight at most). The owner hands the sum to the store and
  takes its squared norm; the norm is summed over the ranks in one process's order (exact clipping).
- **Several passes.** When a rank's micro-batches' boundary activations do not fit its activation budget, a
  step runs as layer-major passes, as in one process; every rank runs the world's number of passes (a rank
  with fewer micro-batches reduces zeros in the passes it lacks). Each pass's gradient of a layer is reduced
  to its owner, which adds the sum of the earlier passes (kept in the group's gradient home, read back) and
  keeps the new sum there, or, on the last pass, hands it on as above.
"""

from __future__ import annotations

import collections
import math
import os

import torch

from tiermem.errors import UserError
from tiermem.specs import Group
from tiermem.store.shared import PeerLost
from trainer.parallel.dist import RankLost
from trainer.run.executor import squared_norm


def owners(groups: list[Group], specs, size: int) -> dict[Group, int]:
    """Each group's owning rank: groups by bytes of state, largest first, each to the least loaded rank."""
    nbytes: dict[Group, int] = collections.defaultdict(int)
    for s in specs:
        nbytes[s.group] += s.nbytes
    load = [0] * size
    out: dict[Group, int] = {}
    for g in sorted(groups, key=lambda g: (-nbytes[g], groups.index(g))):
        r = min(range(size), key=lambda r: (load[r], r))
        out[g] = r
        load[r] += nbytes[g]
    return out


def my_rows(micro_batches: list[list[int]], rank: int, per_device: int) -> list[list[int]]:
    """This rank's rows of each global micro-batch (the empty ones left out)."""
    out = [idx[rank * per_device: (rank + 1) * per_device] for idx in micro_batches]
    return [idx for idx in out if idx]


def optimizer_threads(local_size: int) -> int:
    """CPU AdamW threads of one rank: TIERMEM_OPTIM_THREADS, else its share of the host's cores (all but two of
    the share when it has more than four)."""
    env = os.environ.get("TIERMEM_OPTIM_THREADS")
    if env:
        return max(1, int(env))
    share = max(1, (os.cpu_count() or 1) // max(local_size, 1))
    return share - 2 if share > 4 else share


def reduction_bytes(specs) -> int:
    """HBM a rank's gradient reductions take at most: ``GradReducer.IN_FLIGHT`` + 1 flat fp32 buffers of the
    largest group (the planner leaves it beside the activations and slots)."""
    per_group: dict[Group, int] = collections.defaultdict(int)
    for s in specs:
        if s.kind == "param":
            per_group[s.group] += math.prod(s.shape)
    return (GradReducer.IN_FLIGHT + 1) * 4 * max(per_group.values(), default=0)


class GradReducer:
    """The executor's gradients of one step, reduced to their owners (see the module)."""

    IN_FLIGHT = 2

    def __init__(self, world, owner: dict[Group, int], store):
        """``store``: this rank's (the groups' names and shapes, the device the reductions run on)."""
        self.world, self.owner, self.store, self.device = world, owner, store, store.device
        self.hand = None  # hand(group, grads): the executor's, to the store (set by the executor)
        self.read_partial = None  # read_partial(group) -> ({name: buffer}, future): the sum of the earlier passes
        self.keep_partial = None  # keep_partial(group, grads): the sum so far to the group's gradient home
        self.wait = None  # wait(future): the executor's wait for a partial sum (counted as gradient_partials)
        self._pending: collections.deque = collections.deque()
        self._sq: dict[Group, torch.Tensor] = {}
        self._order: list[Group] = []

    def names(self, group: Group) -> list[str]:
        return self.store.names(group, "param")

    def reduce(self, group: Group, grads: dict[str, torch.Tensor] | None, first: bool = True,
               last: bool = True) -> None:
        """Start reducing ``group``'s gradient of this pass (None: this rank had no rows: zeros) to its owner;
        ``first``, ``last``: whether this is the step's first, last pass (the world's)."""
        import torch.distributed as dist

        names = self.names(group)
        if grads is None:
            n = sum(math.prod(self.store.spec(x).shape) for x in names)
            buf = torch.zeros(n, dtype=torch.float32, device=self.device)
        else:
            buf = torch.cat([grads[x].reshape(-1).float() for x in names])
        work = self.world.call(dist.reduce, buf, dst=self.owner[group], op=dist.ReduceOp.SUM, async_op=True)
        if last:
            self._order.append(group)
        self._pending.append((group, names, buf, work, first, last))
        while len(self._pending) > self.IN_FLIGHT:
            self._complete()

    def _complete(self) -> None:
        group, names, buf, work, first, last = self._pending.popleft()
        self.world.call(work.wait)
        if self.owner[group] != self.world.rank:
            return
        grads, off = {}, 0
        for x in names:
            shape = self.store.spec(x).shape
            k = math.prod(shape)
            grads[x] = buf[off: off + k].view(shape)
            off += k
        if not first:  # (read back while the GPU runs the backward queued meanwhile: one group's at a time)
            prev, fut = self.read_partial(group)
            self.wait(fut)
            for x in names:
                grads[x].add_(prev[x])
        if not last:
            self.keep_partial(group, grads)
            return
        self.hand(group, grads)
        self._sq[group] = squared_norm(list(grads.values()))

    def finish(self) -> float:
        """Wait for the step's reductions; the squared global norm (every owner's part, summed in the order the
        groups were reduced, as one process sums them)."""
        while self._pending:
            self._complete()
        zero = torch.zeros((), dtype=torch.float32, device=self.device)
        vec = torch.stack([self._sq.get(g, zero).float() for g in self._order]).cpu()
        parts = torch.tensor(self.world.sum(vec.tolist()), dtype=torch.float64).to(torch.float32)
        self._sq, self._order = {}, []
        return float(sum(parts[i] for i in range(len(parts))))

    def abandon(self) -> None:
        self._pending.clear()
        self._sq, self._order = {}, []


class OwnerOptimizer:
    """What the executor and the saver call an optimizer, on one rank: ``local`` (a ``StoreAdamW`` over the groups
    this rank owns) updates them; every other group's new version comes from its owner through the host's
    counters (``tiermem.store.shared``). A save of another rank waits through ``expect_save``."""

    def __init__(self, local, owned: set, host, world):
        self.local, self.owned, self.host, self.world = local, set(owned), host, world
        self._save_step: int | None = None
        self._gate = None
        self._part = None  # this rank's part of a checkpoint (its HBM's state): its gate

    @property
    def gpu_share(self) -> float:
        return self.local.gpu_share

    @property
    def last_step_seconds(self) -> float:
        return self.local.last_step_seconds

    @property
    def last_split(self) -> dict:
        return self.local.last_split

    @property
    def groups(self) -> list:
        return self.local.groups

    def step(self, step: int, lr: float, grad_scale: float | None = None):
        self.check()
        return self.local.step(step, lr, grad_scale)

    def wait(self) -> None:
        self.local.wait()
        self.check()

    def wait_group(self, g: Group, version: int) -> None:
        """Until this rank's group ``g`` holds update ``version`` whole."""
        while True:
            self.check()
            try:
                self.host.store.wait_version(g, version, timeout=0.2)
                return
            except TimeoutError:
                continue

    def wait_all(self, version: int) -> None:
        """Until every group, this rank's or another's, holds update ``version`` whole (before the export)."""
        store = self.host.store
        for g in self.host.groups:
            while True:
                self.check()
                try:
                    store.wait_version(g, version, timeout=0.2)
                    break
                except TimeoutError:
                    continue

    def check(self) -> None:
        try:
            self.host.check()
        except PeerLost as e:
            raise self.world.lost([e.local_rank]) from None
        if self.local.failure is not None:
            cause = self.local.failure
            if isinstance(cause, PeerLost):
                raise self.world.lost([cause.local_rank]) from None
            if isinstance(cause, RankLost):  # (from the worker)
                raise cause
            self.local.check()

    def close(self) -> None:
        self.local.close()

    def grads_on_gpu(self, g: Group) -> bool:
        return g in self.owned and self.local.grads_on_gpu(g)

    def grads_home(self, g: Group) -> bool:
        return g in self.owned and self.local.grads_home(g)

    def set_gate(self, gate) -> None:
        """The lead's saver's gate (its own groups: the saver is in this process)."""
        self._gate = gate
        self.local.set_gate(self._wait)

    def expect_save(self, step: int) -> None:
        """Another rank saves checkpoint-``step``: update ``step + 1`` of a group waits until it has read it."""
        self._save_step = step
        self.local.set_gate(self._wait)

    def set_part_gate(self, gate) -> None:
        """This rank writes its part of the checkpoints (``trainer.parallel.checkpoint_part``): its gate too."""
        self._part = gate
        self.local.set_gate(self._wait)

    def resplit(self, on_gpu) -> None:
        """Not with several ranks: each owner's split stays the plan's."""
        raise UserError("splitting the updates again mid-run is not supported yet with several ranks")

    def _wait(self, g: Group, update: int) -> float:
        waited = self._part(g, update) if self._part is not None else 0.0
        if self._gate is not None:
            return waited + self._gate(g, update)
        s = self._save_step
        if s is None or update <= s:
            return waited
        return waited + self.host.wait_saved(g, s)
