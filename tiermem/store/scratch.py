"""Room in a tier for bytes that are not state: a training step's boundary activations (issue 39).

A step's boundary activations (each layer's input, kept for the backward's recompute) have a known size, a known
lifetime (from the forward leaving a layer to that layer's backward) and a known next use; where HBM is short the
plan puts some of them in the host tier (the pinned DRAM arena), sized into the arena with the state. The trainer
reserves an extent there for each, writes it as the forward leaves the layer and reads it back ahead of the
layer's backward, through the mover's lanes (the link's accounting: ``<device>-><host>`` and back), and frees it.

    place = store.reserve("dram", nbytes)       # an extent of the tier's allocator (BudgetError: no room)
    fut = store.put(tensor, place)              # the GPU tensor's bytes to the place, after its producer
    fut = store.get(place, out)                 # ... back into ``out`` (on the GPU), after its last use
    store.unreserve(place)                      # the extent freed (once ``get`` is done)

``stats()`` counts what is reserved as the kind ``activations`` of its tier.
"""

from __future__ import annotations

import concurrent.futures as cf

import torch

from tiermem.errors import BudgetError
from tiermem.sizes import format_size
from tiermem.store.views import event_now
from tiermem.tiers.extents import OutOfSpace
from tiermem.transfer.mover import Location

KIND = "activations"


class Scratch:
    """The store's methods for scratch room (a mixin of ``Store``: its ``tier``, ``mover``, ``_reserved`` and
    ``_reserved_lock``)."""

    def reserve(self, tier: str, nbytes: int) -> Location:
        """An extent of ``nbytes`` in ``tier`` (a memory tier) for bytes that are not state; BudgetError (one line)
        when the tier has no room."""
        t = self.tier(tier)
        if t is None:
            raise BudgetError(f"cannot keep activations on {tier}: that tier is not configured")
        try:
            extent = t.allocate(nbytes)
        except OutOfSpace:
            raise BudgetError(f"{tier} has no room for a boundary activation of {format_size(nbytes)} (the plan "
                              f"sized it for the step it planned): raise tiers.{tier}.budget") from None
        with self._reserved_lock:
            self._reserved[tier] = self._reserved.get(tier, 0) + extent.nbytes
        return Location(tier, extent, nbytes)

    def unreserve(self, place: Location) -> None:
        """Free an extent ``reserve`` gave (nothing may still copy to or from it)."""
        self.tier(place.tier).free(place.extent)
        with self._reserved_lock:
            self._reserved[place.tier] -= place.extent.nbytes

    def reserved(self) -> dict[str, int]:
        """Bytes reserved now, by tier."""
        with self._reserved_lock:
            return {t: n for t, n in self._reserved.items() if n}

    def put(self, tensor: torch.Tensor, place: Location) -> cf.Future:
        """Copy ``tensor``'s bytes (contiguous) to ``place``, once the work queued so far on its stream has run."""
        return self.mover.copy(tensor, place, event_now(tensor))

    def get(self, place: Location, out: torch.Tensor) -> cf.Future:
        """Copy ``place``'s bytes into ``out`` (contiguous), once the work queued so far on its stream has run (its
        memory may have been another tensor's)."""
        return self.mover.copy(place, out, event_now(out))
