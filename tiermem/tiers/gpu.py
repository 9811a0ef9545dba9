"""The GPU tier: one block of HBM holding resident groups and a pool of fixed-size streaming slots.

A slot holds one group's tensors of one kind while the trainer computes with them. ``acquire_slot``
blocks until one is free; ``release_slot`` records an event on the caller's stream so the next copy into
the slot waits for the last kernel that read it. Without CUDA (``device: cpu``) the same pool is backed
by host memory, so the tests run the same code paths on the CPU.

A service's store lays its tier on a block of its own that another process may map (``Making.block``:
``tiermem.tiers.hbm_share``), and its trainer's tier maps it (``map_shared``) below streaming slots of its own: offsets
below the mapped block's size are the service's block, the slots lie above it. A run of several ranks attached to
one service keeps each rank's state in HBM on its own GPU (``tiermem.tiers.hbm_parts``): the service's tier holds
one block a rank, and rank r's tier maps its part at that part's base, its slots above it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch

from tiermem.errors import BudgetError, ConfigError
from tiermem.schema import setting
from tiermem.sizes import align_up, format_size, size_or_auto
from tiermem.tiers.base import DEVICE, Making, host_sync
from tiermem.tiers.extents import Extent, ExtentAllocator, OutOfSpace
from tiermem.tiers.hbm_share import MappedBlock, OwnedBlock

ALIGN = 512


class GpuTierFull(BudgetError, OutOfSpace):
    """No room left in the GPU tier: a user's budget error, and to the store (an out-of-place update's new places)
    the allocator's ``OutOfSpace``."""


def _device(value: Any, where: str) -> str:
    text = str(value).strip() if isinstance(value, str) else None
    if text in ("auto", "cpu", "cuda") or (text and text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise ConfigError(f"{where}: {value!r} is not a device tiermem computes on: auto, cuda, cuda:N or cpu")


def _slots(value: Any, where: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 64:
        return value
    raise ConfigError(f"{where}: expected a number of streaming slots from 1 to 64, got {value!r}")


@dataclass
class GpuTierConfig:
    """HBM for streamed layer slots, resident groups and a step's activations; the device the store computes on."""

    budget: int | None = setting(None, convert=size_or_auto, yaml_type="size | auto", help=(
        "hard limit for the HBM the planner gives to state, streaming slots and a step's activations together"),
        shown="all of the GPU's memory (a quarter of free host memory for the CPU stand-in)")
    device: str = setting("auto", convert=_device, yaml_type="auto | cuda | cuda:N | cpu", help=(
        "the device the store computes on: auto (CUDA when there is a GPU, else the CPU), cuda, cuda:N, or cpu "
        "(the CPU stand-in the tests use); a CUDA device the machine lacks is refused"))
    slots: int = setting(3, convert=_slots, yaml_type="integer (1-64)", help=(
        "streaming slots, each the size of the largest streamed group (the current, the next, the one being "
        "freed)"))


@dataclass
class Slot:
    index: int
    extent: Extent
    free_event: object | None = field(default=None, repr=False)  # torch.cuda.Event after release


class GpuTier:
    """The device tier (``tiermem.tiers.base``): configured under ``tiers.gpu``, always there."""

    role = DEVICE
    optional = False
    Config = GpuTierConfig
    alignment = ALIGN  # every extent's, a slot's tensors' too

    @classmethod
    def make(cls, section: GpuTierConfig, capacity: int, at: Making) -> GpuTier:
        from tiermem.tiers.hbm_parts import PartedGpuTier, Parts

        if isinstance(at.block, Parts):  # (a service's run of several ranks: a block on each rank's GPU)
            return PartedGpuTier(at.block)
        return cls(at.device, capacity, at.slot_bytes, at.n_slots, block=at.block if capacity > 0 else None)

    @classmethod
    def map_shared(cls, desc: dict, device: torch.device, slot_bytes: int, n_slots: int) -> GpuTier:
        """A trainer's tier: the service's block (``describe``; of several ranks, this rank's part of it, at the
        part's ``base``) mapped here, its streaming slots above it."""
        return cls(device, 0, slot_bytes, n_slots, mapped=MappedBlock(desc, device), base=int(desc.get("base", 0)))

    def describe(self, section: GpuTierConfig, chosen: bool = False) -> dict | None:
        """What another process needs to map this tier's block (one laid on a shared block; None otherwise)."""
        return self._block.export() if self._block is not None else None

    @classmethod
    def default_budget(cls, section: GpuTierConfig, device: torch.device, host_memory) -> int:
        """Half of the GPU's memory; the CPU stand-in (host memory): a quarter of what is available."""
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).total_memory // 2
        return psutil.virtual_memory().available // 4

    @classmethod
    def check_section(cls, section: GpuTierConfig, where: str) -> None:
        pass

    def __init__(self, device: torch.device, resident_bytes: int, slot_bytes: int, n_slots: int,
                 block: OwnedBlock | None = None, mapped: MappedBlock | None = None, base: int = 0):
        """``block``: a block of this process's another process may map, to lay the tier on (its owner closes it);
        ``mapped``: another process's block, mapped below this tier's own slots (which alone this process
        allocates); ``base``: the offset of the tier's first byte (a rank's part of a service's HBM)."""
        self.device, self.base = device, base
        self.slot_bytes = align_up(slot_bytes, ALIGN) if n_slots else 0
        self._mapped, self._block = mapped, block
        self._split = align_up(mapped.tensor.numel(), ALIGN) if mapped is not None else 0  # (the mapped block's)
        own = self.slot_bytes * n_slots + (0 if mapped is not None else align_up(resident_bytes, ALIGN))
        self.capacity = self._split + own
        try:
            if block is not None:
                if block.nbytes < own:
                    raise ValueError(f"a block of {block.nbytes} bytes cannot hold a GPU tier of {own}")
                self._buffer = block.tensor
            else:
                self._buffer = torch.empty(max(own, ALIGN), dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError:
            raise BudgetError(f"GPU tier: cannot allocate {format_size(own)} on {device}; "
                              "lower tiers.gpu.budget or place fewer groups on the GPU") from None
        self.allocator = ExtentAllocator(max(self.capacity, ALIGN), ALIGN, base=base)
        self._slots = [Slot(i, self._reserve_slot(base + self._split + i * self.slot_bytes)) for i in range(n_slots)]
        self._free = list(self._slots)
        self._cond = threading.Condition()
        self.slot_wait_seconds = 0.0

    def _reserve_slot(self, offset: int) -> Extent:
        ext = Extent(offset, self.slot_bytes)
        if self.slot_bytes:
            self.allocator.reserve(ext)
        return ext

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def owner(self) -> bool:
        """This process allocates the tier's resident places (False: a trainer over a service's block)."""
        return self._mapped is None

    def allocate(self, nbytes: int) -> Extent:
        if self._mapped is not None:
            raise RuntimeError("this GPU tier maps the service's HBM, which the service alone allocates in")
        try:
            return self.allocator.allocate(nbytes)
        except OutOfSpace:
            raise GpuTierFull(f"GPU tier is full: no room for {format_size(nbytes)} "
                              f"({format_size(self.allocator.free_bytes())} free); raise tiers.gpu.budget") from None

    def free(self, extent: Extent) -> None:
        self.allocator.free(extent)

    def view(self, extent: Extent, nbytes: int | None = None) -> torch.Tensor:
        n = extent.nbytes if nbytes is None else nbytes
        at = extent.offset - self.base
        if at < 0:
            raise ValueError(f"extent at {extent.offset} lies in another rank's part of the service's HBM")
        if at < self._split:
            return self._mapped.tensor[at: at + n]
        at -= self._split
        return self._buffer[at: at + n]

    def sync(self) -> None:
        """Wait, asleep, until the kernels the calling thread queued on this device have run (no-op on the
        CPU stand-in)."""
        if self.is_cuda:
            host_sync(torch.cuda.current_stream(self.device))

    @property
    def n_slots(self) -> int:
        return len(self._slots)

    def slots_free(self) -> int:
        with self._cond:
            return len(self._free)

    def acquire_slot(self, timeout: float | None = None) -> Slot:
        if not self._slots:
            raise RuntimeError("GPU tier has no streaming slots")
        t0 = time.perf_counter()
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, timeout):
                raise TimeoutError("no GPU slot became free")
            slot = self._free.pop(0)
        self.slot_wait_seconds += time.perf_counter() - t0
        return slot

    def release_slot(self, slot: Slot) -> None:
        if self.is_cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            slot.free_event = ev
        with self._cond:
            self._free.append(slot)
            self._cond.notify()

    def stats(self) -> dict:
        return {"device": str(self.device), "slots": self.n_slots, "slots_free": self.slots_free(),
                "slot_bytes": self.slot_bytes}

    def close(self, remove: bool = True) -> None:
        self._buffer = self._block = None  # (a block laid on is its owner's to close)
        if self._mapped is not None:
            self._mapped.close()
