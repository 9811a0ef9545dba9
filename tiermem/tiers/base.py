"""What a tier is to the rest of tiermem: the ``Tier`` protocol the store, the mover, the planner, the cost
model and ``tiermem top`` program against, and the roles a tier plays.

A tier is an address space of extents (``allocate``/``free``, an ``ExtentAllocator``) with a role that says
how the rest of tiermem reaches its bytes:

- ``DEVICE``: the compute device's own memory (HBM). Its tensors are computed on where they are: no copy.
  It also holds the streaming slots that the store fetches groups into. A store has one.
- ``HOST``: host memory the CPU computes on (the pinned DRAM arena). Its bytes reach the device over the
  PCIe link (the machine's ``h2d``/``d2h``). The first configured one is the store's *staging* tier: block
  storage is read into it and written from it.
- ``STORAGE``: block storage (NVMe files). No memory view: its bytes are read into memory of another tier
  and written from it (``pread``/``pwrite``), staged through the host tier on their way to the device unless
  the tier reads and writes device memory itself (``direct_to_gpu``). Its reads and writes are one resource of
  the cost model (``resource``) at the rates ``rates(machine)`` gives.

The class of a tier carries what is known before one exists (the planner's and the config's questions):
its role, its config section (``Config``, a dataclass read under ``tiers.<name>``), whether that section
may be absent (``optional``), how to make one (``make``), its default budget, and (storage) its cost model
figures. ``tiermem.tiers.registry`` maps each tier's name to its class.
"""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from tiermem.tiers.extents import Extent, ExtentAllocator

if TYPE_CHECKING:  # (the roles are read without torch: `tiermem top` names a snapshot's tiers by them)
    import torch

DEVICE = "device"
HOST = "host"
STORAGE = "storage"
ROLES = (DEVICE, HOST, STORAGE)
MEMORY = (DEVICE, HOST)  # roles whose bytes have a memory view (``view``)


def host_sync(stream) -> None:
    """Wait for ``stream``'s work with the calling thread asleep, not spinning on a core (which the CPU
    optimizer's threads need)."""
    import torch

    ev = torch.cuda.Event(blocking=True)
    ev.record(stream)
    ev.synchronize()


@dataclass(frozen=True)
class Making:
    """What making a store's tier needs besides its config section and capacity."""

    store_name: str  # names the tier's files (the arena, the NVMe file)
    device: torch.device  # the device the store computes on
    pin: bool = False  # register host memory with CUDA
    slot_bytes: int = 0  # (the device tier) bytes of one streaming slot
    n_slots: int = 0  # (the device tier) streaming slots
    owner: dict | None = None  # (the host tier) who makes the store, recorded in its arena's header (a service)
    # (the device tier) the block to lay it on, one another process maps: a service's HBM (an ``OwnedBlock`` of
    # tiermem.tiers.hbm_share, which the service keeps across its runs)
    block: Any = None


@dataclass(frozen=True)
class DiskRates:
    """A storage tier in the cost model: bytes a second it reads and writes, each alone, and ``both``: the
    time the same bytes take one direction after the other at those rates, over the time both ways at once
    take (1: one direction at a time; 2: both at their full rates)."""

    read: float
    write: float
    both: float


class Tier(Protocol):
    """Every tier (see the module). ``make`` builds one for a store; ``close`` gives its resources back
    (``remove`` False: its files stay, for another process or a later one)."""

    role: ClassVar[str]
    optional: ClassVar[bool]  # the config section may be absent; a store makes it only when state lives there
    Config: ClassVar[type]  # the config section under tiers.<name>
    allocator: ExtentAllocator
    capacity: int

    @classmethod
    def make(cls, section: Any, capacity: int, at: Making) -> Tier: ...

    @classmethod
    def default_budget(cls, section: Any, device: torch.device, host_memory) -> int | None:
        """Its budget when ``section.budget`` is unset, from what the machine has (``host_memory()``: bytes of
        host memory available)."""

    @classmethod
    def check_section(cls, section: Any, where: str) -> None:
        """Raise a ConfigError for a section that cannot work (checked when the config is read)."""

    def allocate(self, nbytes: int) -> Extent: ...

    def free(self, extent: Extent) -> None: ...

    def stats(self) -> dict:
        """What ``tiermem stats`` shows of it besides its allocator's figures (JSON)."""

    def close(self, remove: bool = True) -> None: ...


class MemoryTier(Tier, Protocol):
    """A ``DEVICE`` or ``HOST`` tier: its bytes are memory tensors can view."""

    owner: bool  # this process allocates in it (False: mapped from another process, which alone does)

    def view(self, extent: Extent, nbytes: int | None = None) -> torch.Tensor: ...


class DeviceTier(MemoryTier, Protocol):
    """The ``DEVICE`` tier: the compute device's memory and the pool of streaming slots."""

    alignment: ClassVar[int]  # of every extent (a slot's tensors are laid out at it)
    device: torch.device
    is_cuda: bool
    n_slots: int
    slot_bytes: int

    def acquire_slot(self, timeout: float | None = None): ...

    def release_slot(self, slot) -> None: ...

    def slots_free(self) -> int: ...

    def sync(self) -> None: ...


class StorageTier(Tier, Protocol):
    """A ``STORAGE`` tier: read into memory and written from it, asynchronously."""

    resource: ClassVar[str]  # the cost model's resource its reads and writes take
    label: ClassVar[str]  # how people call it ("NVMe"): the plan's and top's rows
    direct_to_gpu: bool  # reads into and writes from device memory itself (else staged through the host tier)

    @classmethod
    def rates(cls, machine) -> DiskRates:
        """Its figures in the cost model, from the machine's (``tiermem.plan.machine.Machine``)."""

    def pread(self, buf: torch.Tensor, extent: Extent) -> cf.Future: ...

    def pwrite(self, buf: torch.Tensor, extent: Extent) -> cf.Future: ...

    def discard(self, extents: list[Extent]) -> int:
        """Free ``extents`` for good, giving their bytes back to the filesystem where it can; the bytes given
        back."""
