"""The state a service keeps in HBM, and what a crash of the service may lose of it.

The service's HBM is a block of its own (``tiermem.tiers.hbm_share``) that its trainer maps: a trainer's crash
loses nothing there (the block is the service's; updates are out of place, journaled by the flip, as in DRAM). A
crash of the service takes the block with it; its config's ``durability`` says what then:

- ``checkpoint`` (the default): nothing is copied during a step. The restarted service finds the run's HBM gone,
  names the run's newest checkpoint (as for an arena lost to a reboot) and its trainer resumes from there. So
  the service's CPU worker need not be crash-safe: it updates in place (``lost_with_service``).
- ``step``: each tensor the run keeps in HBM (but the gradient) has two copies in the arena, version v of a group
  in copy v % 2; a group's new state is copied there before its update is journaled (the flip, or the CPU
  worker's ``done``), so the copy of every journaled version is whole and the other copy holds the one before.
  The gradients live in DRAM (placement pins them there: the redo of an update cut short needs them). The
  restarted service makes a new block, puts each group's copy of its journaled version back and finishes the
  committed update, as it does for state in DRAM.

A run of several ranks keeps each rank's groups' state in a block on that rank's GPU (``ServiceHbm.parts``,
``tiermem.tiers.hbm_parts``); all of the above holds for each block.

The block is the service's for its whole life, one for all its runs (``ServiceHbm``): torch counts the processes that
opened a shared CUDA block and keeps a freed one allocated until they have all let go, which a killed trainer never
does; a block per run would then stay allocated after each such run. A run that needs more replaces it.

A service stopped cleanly (SIGTERM, Ctrl-C) loses nothing under either setting: once the update in flight is whole
it writes its whole block to a file beside the arena (``<name>.hbm``), which the next start reads back into its new
block and removes.

    mirrors = Mirrors.allocate(store, specs)       # a new run with durability: step
    mirrors.write(group, version, new_places)      # before the group's update is journaled
    mirrors.restore(versions)                      # a restarted service, over its new block
    save_block(store, path) / load_block(store, path)   # a clean stop, and the next start
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tiermem.faults import HOOKS
from tiermem.sizes import align_up
from tiermem.specs import Group, TensorSpec
from tiermem.tiers.extents import Extent
from tiermem.tiers.hbm_parts import Parts
from tiermem.tiers.hbm_share import OwnedBlock

CHUNK = 256 << 20  # bytes of the block copied through host memory at a time (save_block, load_block)

DURABILITY = {
    "checkpoint": "durability: checkpoint (a crash of the service loses the state it keeps in HBM: the run then "
                  "resumes from its last checkpoint)",
    "step": "durability: step (the state kept in HBM is written through to DRAM within each step: a crash of the "
            "service loses no step)",
}


class ServiceHbm:
    """The service's HBM blocks, kept across its runs (see the module): ``hbm(nbytes)`` hands out its block (one
    rank: on the config's device), zeroed (a new run's moments start at zero), made anew when a run needs more than
    it holds; ``parts(sizes, owners)`` a run of several ranks' (``tiermem.tiers.hbm_parts``): rank r's on its
    GPU (cuda:r, as the ranks compute on cuda:LOCAL_RANK; the CPU stand-in's in host memory, one a rank)."""

    def __init__(self, device: torch.device):
        self.device, self.blocks = device, {}

    @property
    def block(self) -> OwnedBlock | None:
        """The block of a run of one rank (or rank 0's)."""
        return self.blocks.get(self._key(self.device, 0))

    @staticmethod
    def _key(device: torch.device, rank: int) -> str:
        """One block a GPU (the CPU stand-in: one a rank)."""
        return f"cuda:{device.index or 0}" if device.type == "cuda" else f"{device}/{rank}"

    def __call__(self, nbytes: int, device: torch.device | None = None, rank: int = 0) -> OwnedBlock:
        device = self.device if device is None else device
        nbytes, key = align_up(nbytes, 4096), self._key(device, rank)
        block = self.blocks.get(key)
        if block is None or block.nbytes < nbytes:
            if block is not None:
                block.close()
            block = self.blocks[key] = OwnedBlock(nbytes, device)
        else:
            block.tensor.zero_()
        return block

    def rank_device(self, rank: int) -> torch.device:
        """The GPU rank ``rank`` of several computes on (the CPU stand-in: the CPU)."""
        return torch.device("cuda", rank) if self.device.type == "cuda" else self.device

    def parts(self, sizes: list[int], owners: dict) -> Parts:
        """Blocks for a run of several ranks: ``sizes[r]`` bytes on rank r's GPU (none where it is 0)."""
        sizes = [align_up(n, 4096) for n in sizes]
        blocks = [self(n, self.rank_device(r), r) if n else None for r, n in enumerate(sizes)]
        return Parts(blocks, sizes, owners)

    def close(self) -> None:
        for block in self.blocks.values():
            block.close()
        self.blocks = {}


def lost_with_service(record: dict) -> bool:
    """Whether a crash of the service loses the run's whole state (its recovery names the newest checkpoint and
    discards the arena): state kept in HBM under ``durability: checkpoint``, unless a clean stop saved the block.
    Then nothing the service alone changes needs to survive its crash: its CPU worker updates in place, with no
    undo copy and no new places (a trainer's crash still loses nothing: the trainer's own updates stay out of
    place)."""
    return bool(record.get("hbm_capacity")) and record.get("durability", "checkpoint") != "step"


def durability_of(record: dict, in_hbm) -> str:
    """What ``tiermem top`` says of a run's durability (its record's; a run with nothing in HBM loses no step)."""
    if not in_hbm:
        return "durability: no state in HBM (a crash of the service loses no step)"
    return {"checkpoint": "durability: checkpoint (a crash of the service: HBM back from the last checkpoint)",
            "step": "durability: step (HBM written through to DRAM each step)"}[record.get("durability", "checkpoint")]


def on_device(store) -> list:
    """The catalog entries that live in the store's device tier."""
    dev = store.tiers.device_name
    return [e for e in store.catalog.entries() if e.tier == dev]


def mirrored(specs: list[TensorSpec], where: dict, device: str) -> list[TensorSpec]:
    """The specs ``durability: step`` keeps copies of: those on the device tier, gradients aside."""
    return [s for s in specs if where[(s.group, s.kind)] == device and s.kind != "grad"]


def mirror_bytes(specs: list[TensorSpec], where: dict, device: str) -> int:
    """Arena bytes the two copies take."""
    return 2 * sum(align_up(s.nbytes, 4096) for s in mirrored(specs, where, device))


class Mirrors:
    """The arena's copies of the state a run keeps in HBM (``durability: step``; see the module)."""

    def __init__(self, store, places: dict[str, list]):
        self.store = store
        self.places = {name: [Extent(int(o), int(n)) for o, n in two] for name, two in places.items()}
        self.by_group: dict[Group, list[str]] = {}
        for name in self.places:
            self.by_group.setdefault(store.catalog[name].spec.group, []).append(name)

    @classmethod
    def allocate(cls, store, specs: list[TensorSpec]) -> Mirrors:
        """Two copies of every tensor of ``specs`` that lives in HBM (but the gradients), in the arena."""
        host, dev = store.tiers.host, store.tiers.device_name
        places = {}
        for s in specs:
            e = store.catalog[s.name]
            if e.tier == dev and s.kind != "grad":
                places[s.name] = [[x.offset, x.nbytes] for x in (host.allocate(s.nbytes), host.allocate(s.nbytes))]
        return cls(store, places)

    def to_json(self) -> dict:
        return {name: [[x.offset, x.nbytes] for x in two] for name, two in self.places.items()}

    def reserve(self) -> None:
        """Mark the copies' places taken in a reopened arena's allocator."""
        for two in self.places.values():
            for x in two:
                self.store.tiers.host.allocator.reserve(x)

    def write(self, g: Group, version: int, new: dict | None = None) -> None:
        """Copy group ``g``'s tensors in HBM (those of ``new`` at their new places) into copy ``version % 2``;
        returns once the bytes are there."""
        names = self.by_group.get(g)
        if not names:
            return
        host, cat, devices = self.store.tiers.host, self.store.catalog, set()
        for n, name in enumerate(names):
            if n == 1:
                HOOKS.point("mirror", version, g)  # test hook: the copy half written
            e = cat[name]
            src = self.store.tiers.device.view(new.get(name, e.extent) if new else e.extent, e.spec.nbytes)
            host.view(self.places[name][version % 2], e.spec.nbytes).copy_(src, non_blocking=src.is_cuda)
            if src.is_cuda:
                devices.add(src.device)  # (a run of several ranks: the group's owner's GPU)
        for d in devices:
            torch.cuda.current_stream(d).synchronize()

    def restore(self, versions: dict) -> None:
        """Put each group's copy of its journaled version (``versions``: group -> update) back in HBM."""
        host, cat = self.store.tiers.host, self.store.catalog
        dev = self.store.tiers.device
        for name, two in self.places.items():
            e = cat[name]
            src = host.view(two[versions.get(e.spec.group, 0) % 2], e.spec.nbytes)
            dev.view(e.extent, e.spec.nbytes).copy_(src)
        dev.sync()


def hbm_groups(store) -> set:
    """The groups with weights, moments or compute copy in the store's device tier: its GPU worker's to update (the
    CPU does not compute on HBM)."""
    return {e.spec.group for e in on_device(store) if e.spec.kind != "grad"}



def _blocks(store) -> list[torch.Tensor]:
    """The store's HBM, block by block: its one block, or each rank's part of a run of several."""
    dev = store.tiers.device
    if hasattr(dev, "part_views"):
        return [t for _, t in dev.part_views()]
    return [dev.view(Extent(0, dev.capacity))]


def save_block(store, path: Path) -> None:
    """Write the store's whole HBM (each rank's part in turn) to ``path`` (a clean stop), atomically: a new name,
    then renamed."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for block in _blocks(store):
            for at in range(0, block.numel(), CHUNK):
                f.write(block[at: at + CHUNK].cpu().numpy().tobytes())
    os.replace(tmp, path)


def load_block(store, path: Path) -> None:
    """Read ``path`` (``save_block``'s) into the store's new HBM, then remove it."""
    blocks = _blocks(store)
    total = sum(b.numel() for b in blocks)
    if path.stat().st_size != total:
        raise ValueError(f"{path} holds {path.stat().st_size} bytes, the run's HBM {total}")
    with open(path, "rb") as f:
        for block in blocks:
            for at in range(0, block.numel(), CHUNK):
                piece = f.read(min(CHUNK, block.numel() - at))
                block[at: at + len(piece)].copy_(torch.frombuffer(bytearray(piece), dtype=torch.uint8))
    store.tiers.device.sync()
    path.unlink()
