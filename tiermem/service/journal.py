"""The service's crash safety: the run record, the journal of steps, and the undo copy of the group
being updated.

- The **run record** (``<state dir>/<store name>.run.json``, replaced atomically, 0600) says which run the
  store holds: its identity, tensor specs, where each tensor lives, the optimizer's settings, the undo
  extent. Written when a run starts and after a re-placement.
- The **journal** (``<store name>.journal``, JSON lines appended with O_APPEND) says how far the run got:
  ``init`` (weights loaded), ``commit`` (step N's gradients are all in the store; with its lr and
  gradient scale), ``begin``/``done`` (group g's update N started / is home), ``updated`` (update N is
  complete), ``finished``. A ``state`` line summarises everything before it (written when compacting).
  Lines reach the page cache before the next action, so a ``kill -9`` of the service loses none; the
  commit line is fsynced too. Each line carries the CRC32C of its content (``crc``): a line cut by a
  crash ends the journal, a line whose bytes changed is refused (the run's state cannot be trusted).
- The **undo copy**: before group g's update N changes anything, its weights, moments and gradient (fused
  AdamW unscales it in place) are copied to one spare arena extent; ``begin`` is journaled after the copy,
  with the copy's checksum (the CRC32C of each 32 MiB, taken on several threads:
  tiermem.store.parallel_crc), checked before the copy is ever put back.
  A service killed between ``begin`` and ``done`` is restarted by putting the undo copy back and running
  the update of that group again.

The arena is a file on a tmpfs: it survives the service, not a reboot. Then the run record remains (in
the NVMe directory or ~/.local/state/tiermem) and the service names the run's newest checkpoint.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import crc32c
import torch

from tiermem.errors import StorageError
from tiermem.faults import HOOKS
from tiermem.sizes import align_up
from tiermem.specs import MOMENTS, Group
from tiermem.store.checkpoint import crc32c_of
from tiermem.store.parallel_crc import piece_crcs
from tiermem.tiers.base import STORAGE
from tiermem.tiers.extents import Extent, OutOfSpace

COMPACT_BYTES = 256 << 10


def state_dir(cfg) -> Path:
    """Where a service keeps its run record and journal: its storage tier's directory (the NVMe tier's: a
    persistent disk), else $XDG_STATE_HOME/tiermem (~/.local/state/tiermem)."""
    disk = next(iter(cfg.tiers.of_role(STORAGE)), None)
    if disk is not None:
        path = cfg.tiers[disk].path
        return Path(path[0] if isinstance(path, list) else path)  # (a striped tier's first directory)
    return default_state_dir()


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "tiermem"


def write_private(path: Path, text: str) -> None:
    """Replace ``path`` atomically by ``text`` in a file only its owner may read (0600), synced to disk.
    (The run record and the journal name the model, the output_dir and every tensor.)"""
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_atomic(path: Path, data: dict) -> None:
    write_private(path, json.dumps(data))


def make_private(path: Path) -> None:
    """Make a file an older version wrote readable by others 0600."""
    if path.is_file() and path.stat().st_mode & 0o077:
        os.chmod(path, 0o600)


@dataclass
class RunState:
    """How far the run got, as the journal tells it."""

    initialized: bool = False
    committed: int = 0
    updated: int = 0
    commit_args: dict = field(default_factory=dict)  # lr, grad_scale of the last commit
    versions: dict = field(default_factory=dict)  # group -> the last update that is home
    inflight: tuple | None = None  # (group, step) begun and not done
    undo_crc: str | list | None = None  # the undo copy's checksum, journaled with begin (a list: piece CRCs)
    finished: bool = False
    moves: dict = field(default_factory=dict)  # name -> [tier, offset, nbytes, epoch]: out-of-place updates

    def apply(self, rec: dict) -> None:
        op = rec["op"]
        if op == "state":
            self.__init__(rec["initialized"], rec["committed"], rec["updated"], rec["commit_args"],
                          {g: v for g, v in rec["versions"]}, tuple(rec["inflight"]) if rec["inflight"] else None,
                          rec.get("undo_crc"), rec["finished"], dict(rec.get("moves", {})))
        elif op == "init":  # weights loaded; a run resumed from a checkpoint starts at its step
            self.initialized = True
            self.committed = self.updated = rec["step"]
            self.versions = {g: rec["step"] for g in rec["groups"]}
        elif op == "commit":
            self.committed, self.commit_args = rec["step"], {"lr": rec["lr"], "grad_scale": rec["grad_scale"]}
        elif op == "begin":
            self.inflight = (rec["group"], rec["step"])
            self.undo_crc = rec.get("undo_crc")
        elif op == "done":  # (the GPU worker's out-of-place groups finish while the CPU worker has one begun)
            self.versions[rec["group"]] = rec["step"]
            if self.inflight is not None and self.inflight[0] == rec["group"]:
                self.inflight = None
            self.moves.update(rec.get("moves", {}))
        elif op == "updated":
            self.updated = rec["step"]
        elif op == "finished":
            self.finished = True

    def to_json(self) -> dict:
        return {"op": "state", "initialized": self.initialized, "committed": self.committed,
                "updated": self.updated, "commit_args": self.commit_args,
                "versions": [[g, v] for g, v in self.versions.items()],
                "inflight": list(self.inflight) if self.inflight else None, "finished": self.finished,
                "moves": self.moves, "undo_crc": self.undo_crc}

    def layout(self, record: dict) -> dict:
        """The run record's layout with the out-of-place updates of its epoch applied."""
        out = dict(record["layout"])
        for name, (tier, offset, nbytes, epoch) in self.moves.items():
            if epoch == record.get("epoch", 0):
                out[name] = [tier, offset, nbytes]
        return out


class JournalDamaged(StorageError):
    """A journal line whose bytes changed after it was written."""


def _line(rec: dict) -> bytes:
    """A journal line: the record with the CRC32C of its content."""
    body = json.dumps(rec)
    return (json.dumps({**rec, "crc": f"{crc32c.crc32c(body.encode()):08x}"}) + "\n").encode()


def _checked(rec: dict, path: Path, n: int) -> dict:
    """``rec`` without its ``crc``, which must match (lines an older version wrote have none)."""
    crc = rec.pop("crc", None)
    if crc is not None and crc != f"{crc32c.crc32c(json.dumps(rec).encode()):08x}":
        raise JournalDamaged(f"the service's journal {path} is damaged at line {n} (it does not match its checksum): "
                             "the run's state cannot be trusted; start the service with --fresh and resume the "
                             "trainer from its newest checkpoint")
    return rec


def read_state(path: Path) -> RunState:
    """How far the run of the journal at ``path`` got (a RunState of nothing when there is none)."""
    state = RunState()
    if path.is_file():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                break  # a line cut by a crash is the last one
            state.apply(_checked(rec, path, n))
    return state


def recoverable_run(directory: Path, name: str, arena_dir: Path) -> dict | None:
    """The run recorded in ``directory`` for store ``name`` with its arena in ``arena_dir``, when a service
    would recover it (weights loaded, not finished): ``{"config", "step"}`` (either may be None: not
    recorded, an unreadable journal); None when there is none."""
    try:
        record = json.loads((directory / f"{name}.run.json").read_text())
        arena = record.get("arena_dir")
    except (OSError, ValueError, AttributeError):
        return None
    if arena is not None and Path(str(arena)).resolve() != Path(arena_dir).resolve():
        return None
    try:
        state = read_state(directory / f"{name}.journal")
    except (OSError, ValueError, KeyError, TypeError, StorageError):  # kept: the service is the judge of that
        return {"config": record.get("config"), "step": None}
    if not state.initialized or state.finished:
        return None
    return {"config": record.get("config"), "step": state.committed}


class Journal:
    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self.state = read_state(path)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(self._fd, 0o600)  # one an older version wrote readable by others

    def append(self, op: str, sync: bool = False, **fields) -> None:
        rec = {"op": op, **fields}
        with self._lock:
            os.write(self._fd, _line(rec))
            if sync:
                os.fsync(self._fd)
            self.state.apply(rec)

    def compact(self) -> None:
        """Replace the journal by one ``state`` line once it has grown past COMPACT_BYTES."""
        with self._lock:
            if os.fstat(self._fd).st_size < COMPACT_BYTES:
                return
            write_private(self.path, _line(self.state.to_json()).decode())
            os.close(self._fd)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)

    def close(self) -> None:
        os.close(self._fd)


def undo_kinds(has_master: bool) -> tuple[str, ...]:
    """The kinds an update changes in place that its redo needs as they were: the weights, the moments and
    the gradient (fused AdamW unscales it in place). A bf16 compute copy is not kept: the redo rewrites it
    from the restored master."""
    return ("master" if has_master else "param", *MOMENTS, "grad")


def undo_bytes(specs, has_master: bool) -> int:
    per: dict = {}
    kinds = undo_kinds(has_master)
    for s in specs:
        if s.kind in kinds:
            per[s.group] = per.get(s.group, 0) + align_up(s.nbytes, 4096)
    return max(per.values(), default=4096)


class UndoGuard:
    """The optimizer's crash-safety hooks: ``begin`` (copy the group's old state aside, journal) before
    the CPU worker changes it in place; ``done`` (journal) once the group's new state is home; ``flip``
    (journal the new places, then switch to them) after the GPU worker wrote it out of place."""

    def __init__(self, store, journal: Journal, extent: Extent | None, has_master: bool, epoch: int = 0,
                 mirrors=None, in_place: bool = False):
        """``mirrors`` (``durability: step``, ``tiermem.service.hbm.Mirrors``): a group's new state in HBM is copied
        to DRAM before its update is journaled. ``in_place``: a crash of this process loses the run's state anyway
        (``tiermem.service.hbm.lost_with_service``): the CPU worker updates in place, without ``begin``."""
        self.store, self.journal, self.extent, self.epoch = store, journal, extent, epoch
        self.in_place = in_place
        self.mirrors = mirrors
        self.kinds = undo_kinds(has_master)
        self.slow = HOOKS.slow_update  # test hook: seconds per group

    def _pieces(self, g: Group):
        """(kind, entry, byte range in the undo extent) for the group's state, in catalog order."""
        off = 0
        for k in self.kinds:
            for e in self.store.catalog.group_entries(g, k):
                yield k, e, off
                off += align_up(e.spec.nbytes, 4096)

    def begin(self, g: Group, step: int, views) -> None:
        undo = self.store.tiers.host.view(self.extent)
        end = 0
        for k, e, off in self._pieces(g):
            src = views[k].tensors[e.spec.name].detach().reshape(-1).view(torch.uint8)
            undo[off: off + e.spec.nbytes].copy_(src.cpu())
            end = off + e.spec.nbytes
        self.journal.append("begin", group=g, step=step, undo_crc=piece_crcs(undo[:end].numpy()))
        if self.slow:
            time.sleep(self.slow)

    def done(self, g: Group, step: int) -> None:
        HOOKS.point("update", step, g)  # test hook: the update is home, not yet journaled
        if self.mirrors is not None:
            self.mirrors.write(g, step)
        self.journal.append("done", group=g, step=step)

    def allocate(self, g: Group, step: int, names: list[str]) -> dict | None:
        """New places for the group's new state, or None when there is no room (the CPU worker takes it)."""
        try:
            return self.store.allocate_elsewhere(names)
        except OutOfSpace:
            return None

    def flip(self, g: Group, step: int, new: dict, ahead: tuple | None = None) -> dict | None:
        """Journal group g's new places, then switch to them; with ``ahead`` ((group, names)), then ``allocate``
        that group's: its places (None: no room)."""
        if self.slow:
            time.sleep(self.slow)
        HOOKS.point("update", step, g)  # test hook: the new state is written, not yet journaled
        if self.mirrors is not None:
            self.mirrors.write(g, step, new)
        moves = {}
        for name, ext in new.items():
            moves[name] = [self.store.catalog[name].tier, ext.offset, ext.nbytes, self.epoch]
        self.journal.append("done", group=g, step=step, moves=moves)
        for name, ext in new.items():
            self.store.switch(name, ext)
        return self.allocate(ahead[0], step, ahead[1]) if ahead is not None else None

    def restore(self, g: Group, crc: str | list | None = None) -> None:
        """Put the undo copy of group g back (recovery of an update cut short), after checking it against
        ``crc`` (journaled with its begin: its pieces' CRCs, or one CRC32C from a journal of an earlier version)."""
        undo = self.store.tiers.host.view(self.extent)
        end = max((off + e.spec.nbytes for _, e, off in self._pieces(g)), default=0)
        data = undo[:end].numpy()
        if crc is not None and (piece_crcs(data) if isinstance(crc, list) else crc32c_of(data)) != crc:
            raise StorageError(f"the undo copy of group {g} in the arena does not match its checksum: the run's "
                               "state cannot be trusted; start the service with --fresh and resume the trainer "
                               "from its newest checkpoint")
        for _, e, off in self._pieces(g):
            raw = undo[off: off + e.spec.nbytes].clone()
            self.store.write(e.spec.name, raw.view(e.spec.dtype).reshape(e.spec.shape)).result()
