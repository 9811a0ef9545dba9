"""Tier memory as typed tensors: a group's tensors handed out as views (``GroupView``), the typed view of an
extent's bytes, and the spans that let one copy bring a group's tensors."""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass, field

import torch

from tiermem.futures import done_future
from tiermem.specs import Group, TensorSpec
from tiermem.store.catalog import Entry
from tiermem.tiers.extents import Extent
from tiermem.transfer.mover import Location


@dataclass
class GroupView:
    """One group's tensors of one kind, as typed views in some memory; ``release`` gives the memory back."""

    group: Group
    kind: str
    tensors: dict[str, torch.Tensor] = field(repr=False)  # may alias memory gone after release
    _release: object = field(default=None, repr=False)

    def release(self, write_back: bool = False) -> cf.Future:
        fn, self._release = self._release, None
        return fn(write_back) if fn is not None else done_future()


def span_of(entries: list[Entry], device: str | None) -> Location | None:
    """The place that holds ``entries`` end to end, in order (off HBM, the tier ``device``: one tier, each one
    starting where the last one's extent ends), so one copy brings them all; None when they are not laid out
    so."""
    first, tier = entries[0], entries[0].tier
    if tier == device or first.extent is None:
        return None
    end = first.extent.end
    for e in entries[1:]:
        if e.tier != tier or e.extent is None or e.extent.offset != end:
            return None
        end = e.extent.end
    last = entries[-1]
    n = last.extent.offset + last.spec.nbytes - first.extent.offset
    return Location(tier, Extent(first.extent.offset, n), n)


def typed(raw: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """A typed tensor over ``raw``'s bytes. It aliases the tier's memory without being an autograd view
    of the tier's buffer, so in-place writes elsewhere in the buffer do not bump its version counter."""
    t = raw[: spec.nbytes].view(spec.dtype)
    alias = torch.empty(0, dtype=spec.dtype, device=t.device)
    return alias.set_(t.untyped_storage(), t.storage_offset(), spec.shape)



def event_now(*tensors: torch.Tensor):
    """A CUDA event on the current stream when any tensor is on the GPU, so copies wait for its producer."""
    for t in tensors:
        if t.is_cuda:
            ev = torch.cuda.Event(blocking=True)
            ev.record(torch.cuda.current_stream(t.device))
            return ev
    return None


def mark_valid(entry: Entry, keep_alive: torch.Tensor) -> cf.Future:
    entry.valid = True
    return done_future()
