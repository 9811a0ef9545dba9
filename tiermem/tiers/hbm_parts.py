"""A service's HBM for a run of several ranks: one block on each rank's GPU, one device tier over them.

Each rank of a run attached to one service (``trainer.parallel.dp_service``) keeps the state of the groups it owns
that the plan puts in HBM in its own GPU's memory, as an embedded run's ranks do; the service owns those blocks
(``tiermem.tiers.hbm_share``), so a rank that dies leaves them intact. The service's store sees them as one device
tier whose extents carry their part in their offset: part ``r`` (rank ``r``'s GPU) starts at ``r * PART_SPAN``.
A group's tensors are allocated in its owner's part (``allocate_for``); rank ``r``'s trainer maps its own part
only, at that base (``GpuTier.map_shared``), and its store leaves the other parts' tensors out.

    parts = Parts(blocks, sizes, owners)          # the service's (ServiceHbm.parts), one block a rank
    tier = PartedGpuTier(parts)                   # GpuTier.make lays the device tier on them
    tier.allocate_for(group, nbytes)              # in the group's owner's part
    desc = tier.describe_part(r)                  # what rank r maps (its block's export and base)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiermem.sizes import format_size
from tiermem.tiers.base import DEVICE
from tiermem.tiers.extents import Extent, ExtentAllocator, OutOfSpace
from tiermem.tiers.gpu import ALIGN

PART_SPAN = 1 << 44  # offsets a part may use (16 TiB: any GPU's memory), well within JSON's exact integers


def part_of(offset: int) -> int:
    """The part (rank) an extent of a parted device tier lives in."""
    return offset // PART_SPAN


def base_of(part: int) -> int:
    return part * PART_SPAN


@dataclass
class Parts:
    """What a service lays a run's parted device tier on: ``blocks[r]``, the block on rank r's GPU (an
    ``OwnedBlock``, or None where rank r keeps nothing in HBM), of which the part uses ``sizes[r]`` bytes;
    ``owners``: group -> the rank that owns it."""

    blocks: list
    sizes: list
    owners: dict


class PartedAllocator:
    """One ``ExtentAllocator`` a part, each over its part's offsets; the figures summed over them."""

    def __init__(self, capacities: list[int]):
        self.parts = [ExtentAllocator(c, ALIGN, base=base_of(r)) for r, c in enumerate(capacities)]
        self.capacity = sum(a.capacity for a in self.parts)

    def of(self, extent: Extent) -> ExtentAllocator:
        r = part_of(extent.offset)
        if not 0 <= r < len(self.parts):
            raise ValueError(f"extent at {extent.offset} lies in no part of this tier")
        return self.parts[r]

    def allocate(self, nbytes: int, part: int = 0) -> Extent:
        return self.parts[part].allocate(nbytes)

    def reserve(self, extent: Extent) -> None:
        self.of(extent).reserve(extent)

    def free(self, extent: Extent) -> None:
        self.of(extent).free(extent)

    def used_bytes(self) -> int:
        return sum(a.used_bytes() for a in self.parts)

    def free_bytes(self) -> int:
        return sum(a.free_bytes() for a in self.parts)

    def largest_free(self) -> int:
        return max((a.largest_free() for a in self.parts), default=0)

    def fragmentation(self) -> float:
        return max((a.fragmentation() for a in self.parts), default=0.0)


class PartedGpuTier:
    """The service's device tier of a run of several ranks (see the module): no streaming slots (the service
    streams nothing; each trainer has its own)."""

    role = DEVICE
    optional = False
    alignment = ALIGN

    def __init__(self, parts: Parts):
        self.owners = dict(parts.owners)
        self._blocks = list(parts.blocks)
        live = [b for b in self._blocks if b is not None]
        if not live:
            raise ValueError("a parted device tier needs a block on one rank's GPU at least")
        self.device = live[0].device
        self.allocator = PartedAllocator([n if b is not None else 0 for b, n in zip(self._blocks, parts.sizes)])
        self.capacity = self.allocator.capacity
        self.slot_wait_seconds = 0.0

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def owner(self) -> bool:
        return True

    def part_bytes(self) -> list[int]:
        """Each part's capacity, rank by rank (a run's record keeps them: a restarted service makes them again)."""
        return [a.capacity for a in self.allocator.parts]

    def allocate(self, nbytes: int) -> Extent:
        raise RuntimeError("a parted device tier allocates in a group's owner's part: allocate_for(group, nbytes)")

    def allocate_for(self, group, nbytes: int) -> Extent:
        r = self.owners.get(group)
        if r is None or self._blocks[r] is None:
            raise OutOfSpace(f"no part of the HBM holds group {group!r} (rank {r})")
        try:
            return self.allocator.allocate(nbytes, r)
        except OutOfSpace:
            raise OutOfSpace(f"rank {r}'s HBM is full: no room for {format_size(nbytes)}") from None

    def free(self, extent: Extent) -> None:
        self.allocator.free(extent)

    def view(self, extent: Extent, nbytes: int | None = None) -> torch.Tensor:
        n = extent.nbytes if nbytes is None else nbytes
        r = part_of(extent.offset)
        at = extent.offset - base_of(r)
        return self._blocks[r].tensor[at: at + n]

    def part_views(self) -> list[tuple[int, torch.Tensor]]:
        """(rank, its whole block) for each part that holds one (a clean stop writes them, the next start reads)."""
        return [(r, b.tensor[: a.capacity]) for r, (b, a) in enumerate(zip(self._blocks, self.allocator.parts))
                if b is not None]

    def describe_part(self, rank: int) -> dict | None:
        """What rank ``rank``'s trainer maps: its block's export and the part's base (None: it keeps nothing)."""
        b = self._blocks[rank] if rank < len(self._blocks) else None
        return None if b is None else {**b.export(), "bytes": self.allocator.parts[rank].capacity,
                                       "base": base_of(rank)}

    def sync(self) -> None:
        if self.is_cuda:
            for b in self._blocks:
                if b is not None:
                    torch.cuda.current_stream(b.device).synchronize()

    @property
    def n_slots(self) -> int:
        return 0

    def slots_free(self) -> int:
        return 0

    def acquire_slot(self, timeout: float | None = None):
        raise RuntimeError("the service's parted GPU tier has no streaming slots")

    def stats(self) -> dict:
        return {"device": ", ".join(str(b.device) for b in self._blocks if b is not None), "slots": 0,
                "slots_free": 0, "slot_bytes": 0, "parts": self.part_bytes()}

    def close(self, remove: bool = True) -> None:
        self._blocks = []  # (the blocks are their owner's to close: the service keeps them across its runs)
