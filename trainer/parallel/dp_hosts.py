"""Several hosts (a first slice): a store per host, each holding every group, kept in step through
torch.distributed.

Within a host the ranks share one store and its counters (``trainer.parallel.dp_session``); across hosts an owner's
update lands only in its own host's store. So, from the trainer's thread of every rank, in the same order:

- after each step, every group's new compute copy goes from its owner to the other hosts (a broadcast from the
  owner; each other host's first rank writes it into its arena and bumps its host's counter): the next forward
  on every host reads the new weights;
- before rank 0 saves a checkpoint (and before the export), the master weights and moments of the groups owned
  on other hosts go to rank 0's host, whose store the checkpoint is written from.

This costs the overlap of an update with the next forward (the owner's update of every group must be done
before the step's compute copies are sent) and keeps all the optimizer state on every host (only the owners'
copies current); docs/architecture.md ("Many hosts") says what the full design does instead.
"""

from __future__ import annotations

import math

import torch

from tiermem.config import MOMENTS


class HostSync:
    def __init__(self, world, session, has_master: bool):
        self.world, self.session = world, session
        self.store, self.host, self.owner = session.store, session.host, session.owner
        self.groups = list(self.host.groups)
        self.state_kinds = ("master" if has_master else "param", *MOMENTS)
        # the lead's saver's gate (rank 0 holds it, and writes what other hosts send into host 0's store): another
        # host's update of a group lands here only once a checkpoint being written has read the group (else the
        # checkpoint could hold the next update's weights of the groups owned elsewhere)
        self.saver_gate = None

    def node(self, rank: int) -> int:
        return rank // self.world.local_size

    @property
    def here(self) -> int:
        return self.node(self.world.rank)

    def compute_copies(self, version: int) -> None:
        """Every group's compute copy of update ``version`` on every host."""
        self._share(version, ("param",), lambda src_node: True)

    def to_lead(self, version: int) -> None:
        """The state of update ``version`` of the groups owned on other hosts, in rank 0's host's store."""
        self._share(version, self.state_kinds, lambda src_node: src_node != 0)

    def _share(self, version: int, kinds, needed) -> None:
        import torch.distributed as dist

        store, world = self.store, self.world
        for g in self.groups:
            src = self.owner[g]
            if not needed(self.node(src)):
                continue
            names = [n for k in kinds for n in store.names(g, k)]
            sizes = [store.spec(n).nbytes for n in names]
            if world.rank == src:
                self.session.optimizer.wait_group(g, version)
                buf = torch.cat([self.store.read(n).result().reshape(-1).view(torch.uint8) for n in names])
            else:
                buf = torch.empty(sum(sizes), dtype=torch.uint8)
            world.call(dist.broadcast, buf, src=src, group=world.cpu_group)
            takes = self.node(src) != self.here and world.local_rank == 0 and (kinds == ("param",) or self.here == 0)
            if not takes:
                continue
            if self.saver_gate is not None:
                self.saver_gate(g, version)
            off, writes = 0, []
            for n, size in zip(names, sizes):
                spec = store.spec(n)
                t = buf[off: off + size].view(spec.dtype).view(spec.shape) if math.prod(spec.shape) else buf[:0]
                writes.append(self.store.write(n, t))
                off += size
            for w in writes:
                w.result()
            self.host.publish_state(g, version)  # (this host's ranks follow it: their forward, the saver)
