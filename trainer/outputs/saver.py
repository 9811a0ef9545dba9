"""Checkpoints written while training goes on (``checkpoint-N``: ``trainer.outputs.checkpoint`` has its layout).

A reader thread copies each group's state out of the store as soon as update N of the group is done and lets
update N+1 of that group go on (the optimizer waits only for that copy: ``ReleaseGate``); a writer thread streams
the copies to disk (bounded memory in between). Everything is written under ``.checkpoint-N.tmp-PID``, fsynced,
then renamed; a crash leaves the previous checkpoint as it was and nothing named like a checkpoint. Each
checkpoint records its run's lineage, and ``save_total_limit`` prunes that lineage's checkpoints only.
"""

from __future__ import annotations

import json
import math
import os
import queue
import shutil
import threading
import time
import uuid
from pathlib import Path

import psutil
import torch

from tiermem.config import MOMENTS
from tiermem.errors import StorageError
from tiermem.faults import HOOKS
from tiermem.specs import state_name
from tiermem.store.checkpoint import StateWriter, file_crc32c, fsync_dir, fsync_tree
from trainer.model.weights import all_weights, group_order
from trainer.outputs.checkpoint import (
    FORMAT,
    checkpoints,
    is_state_chunks,
    manifest_crc,
    part_name,
    part_tmp,
    signature,
    tokenizer_digest,
)
from trainer.outputs.weights_io import ModelWriter


class ReleaseGate:
    """The optimizer's gate of a save that reads the state group by group (``_step``: the update it saves, None
    when none; ``_released``: group -> an event set once the save has read it; ``paused``: seconds waited)."""

    _step: int | None
    _released: dict
    paused: float

    def gate(self, group, update: int) -> float:
        """Update ``update`` of ``group`` may run once the save has read the group's state (0 s when it need not
        wait); returns the seconds waited."""
        step, released = self._step, self._released
        if step is None or update <= step:
            return 0.0
        ev = released.get(group)
        if ev is None or ev.is_set():
            return 0.0
        t0 = time.perf_counter()
        ev.wait()
        dt = time.perf_counter() - t0
        self.paused += dt
        return dt


class Saver(ReleaseGate):
    """Writes checkpoints in the background while training goes on; one at a time."""

    def __init__(self, store, mcfg, out_dir: Path, model_dir: Path, dtype: torch.dtype, has_master: bool,
                 model_only: bool, total_limit: int | None, say, checksums: bool = True, lineage: str | None = None,
                 resumed: Path | None = None):
        """``checksums`` False writes a checkpoint without CRC32Cs (format 1: what the benchmark compares).
        ``lineage``: the run's (``lineage_for``), recorded in each checkpoint; ``save_total_limit`` prunes only the
        checkpoints of that lineage (and ``resumed``, the one the run resumed, when it records none)."""
        self.store, self.mcfg, self.out, self.model_dir = store, mcfg, Path(out_dir), Path(model_dir)
        self.checksums = checksums
        self.lineage = lineage or new_lineage()
        self.resumed = Path(resumed).resolve() if resumed is not None else None
        self.dtype, self.src = dtype, "master" if has_master else "param"
        self.model_only, self.total_limit, self.say = model_only, total_limit, say
        self.groups = group_order(mcfg)
        self.weights = {g: [w for w in all_weights(mcfg) if w.group == g] for g in self.groups}
        self._step: int | None = None
        self._stopping = False
        self._released: dict = {}
        self._threads: list[threading.Thread] = []
        self._error: BaseException | None = None
        self._abort = threading.Event()
        self.paused = 0.0  # seconds the optimizer waited on saves (the GPU may have waited on it in turn)
        # on_released(group, step): the save of ``step`` has read the group (the ranks that update other groups
        # than this process's wait for it)
        self.on_released = None
        # several ranks: the store names this process's store lacks (other ranks' HBM-resident state: the model's
        # files then take the compute copy, of the same values in the model's dtype), and wait_part(rank, step),
        # until rank ``rank`` has written its part of the state (``part_tmp``), for each rank in ``parts``
        self.remote: set = set()
        self.parts: list[int] = []
        self.wait_part = None
        self.last: dict = {}

    # -- a save ----------------------------------------------------------------------------------------
    def begin(self, step: int, states: dict[str, dict]) -> None:
        """Save the state after update ``step`` (which may still be running), with the JSON files ``states``
        (file name -> content: trainer_state.json, tiermem_state.json). "saved checkpoint-N" is said when the
        checkpoint is complete."""
        self.wait()
        self._error = None
        self._abort.clear()
        self._released = {g: threading.Event() for g in self.groups}
        self._step = step
        self._t0 = time.perf_counter()
        self._paused0 = self.paused
        self._budget_mib = max(1, int(min(8 << 30, psutil.virtual_memory().available // 4)) >> 20)
        q: queue.Queue = queue.Queue()
        room = threading.Semaphore(self._budget_mib)  # MiB of copies waiting for the writer
        tmp = self.out / f".checkpoint-{step}.tmp-{os.getpid()}"
        reader = threading.Thread(target=self._read, args=(step, q, room), name="tiermem-save-read", daemon=True)
        writer = threading.Thread(target=self._write, args=(step, tmp, q, room, states),
                                  name="tiermem-save-write", daemon=True)
        self._threads = [reader, writer]
        reader.start()
        writer.start()

    def _read(self, step: int, q: queue.Queue, room: threading.Semaphore) -> None:
        try:
            kinds = (self.src,) if self.model_only else (self.src, *MOMENTS)
            for g in self.groups:
                self._wait_version(g, step)
                for w in self.weights[g]:
                    if self._abort.is_set():
                        raise _Abandoned()
                    nbytes = math.prod(w.shape) * 4 * len(kinds)
                    mib = min(max(1, nbytes >> 20), self._budget_mib)
                    for _ in range(mib):
                        room.acquire()
                    row = {k: self.store.read(state_name(w.name, k)).result() for k in kinds
                           if state_name(w.name, k) not in self.remote}
                    if self.src not in row:  # (its owner writes its state; the model's files: the compute copy)
                        row["model"] = self.store.read(w.name).result()
                    q.put((w.name, row, mib))
                self._released[g].set()
                if self.on_released is not None:
                    self.on_released(g, step)
        except BaseException as e:  # noqa: BLE001 - reported by wait()
            self._error = self._error or e
        finally:
            for g, ev in self._released.items():
                ev.set()  # never leave the optimizer waiting
                if self.on_released is not None:
                    self.on_released(g, step)
            q.put(None)

    def _wait_version(self, g, step: int) -> None:
        while True:
            if self._abort.is_set():
                raise _Abandoned()
            try:
                self.store.wait_version(g, step, timeout=0.2)
                return
            except TimeoutError:
                continue

    def _write(self, step: int, tmp: Path, q: queue.Queue, room: threading.Semaphore, states: dict) -> None:
        slow = HOOKS.slow_save  # tests: make a kill land inside a save
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            model = ModelWriter(self.mcfg, tmp, self.dtype, self.model_dir, f"checkpoint-{step}")
            store_kind = {"master": self.src, **{k: k for k in MOMENTS}}
            layout = {k: [(w.name, w.shape) for w in all_weights(self.mcfg)
                          if state_name(w.name, store_kind[k]) not in self.remote] for k in ("master", *MOMENTS)}
            layout = {k: v for k, v in layout.items() if v}
            state = None if self.model_only else StateWriter(tmp / "state.zarr", layout, self.checksums)
            while True:
                item = q.get()
                if item is None:
                    break
                name, row, mib = item
                model.put(name, row.get("model", row.get(self.src)))
                if state is not None:
                    for k, sk in store_kind.items():
                        if sk in row:
                            state.put(k, name, row[sk])
                del row
                for _ in range(mib):
                    room.release()
                if slow:
                    time.sleep(slow)
            if self._error is not None:
                raise self._error
            model.close()
            if state is not None:
                state.close()
                for r in self.parts:  # (each rank's part, written and synced by that rank, moved in)
                    self.wait_part(r, step)
                    part = part_tmp(self.out, step, r)
                    os.replace(part / "state.zarr", tmp / part_name(r))
                    shutil.rmtree(part, ignore_errors=True)
            for name, content in states.items():
                (tmp / name).write_text(json.dumps(content, indent=1) + "\n")
            files = {}
            for p in sorted(tmp.rglob("*")):
                if p.is_file():  # (the state's shard files carry a CRC32C per shard in their metadata)
                    rel = str(p.relative_to(tmp))
                    files[rel] = {"size": p.stat().st_size}
                    if self.checksums and not is_state_chunks(rel):  # (the model's shards: as written)
                        files[rel]["crc32c"] = model.crc32c.get(rel) or file_crc32c(p)
            manifest = {"format": FORMAT if self.checksums else 1, "step": step, "model_only": self.model_only,
                        "model": signature(self.mcfg), "tokenizer": tokenizer_digest(self.model_dir), "files": files,
                        "lineage": self.lineage}
            if self.checksums:
                manifest["crc32c"] = manifest_crc(manifest)
            (tmp / "checkpoint.json").write_text(json.dumps(manifest) + "\n")
            fsync_tree(tmp)
            final = self.out / f"checkpoint-{step}"
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_dir(self.out)
            self._prune(step)
            seconds = time.perf_counter() - self._t0
            self.last = {"step": step, "seconds": seconds, "paused": self.paused - self._paused0,
                         "bytes": sum(f["size"] for f in files.values())}
            self._announce(step)
        except BaseException as e:  # noqa: BLE001 - reported by wait()
            self._error = self._error or e
            shutil.rmtree(tmp, ignore_errors=True)
            for r in self.parts:  # (a part written for a checkpoint that will not be)
                shutil.rmtree(part_tmp(self.out, step, r), ignore_errors=True)
            for ev in self._released.values():
                ev.set()

    def _prune(self, saved: int) -> None:
        """save_total_limit: remove this run's oldest checkpoints beyond the limit (never ``saved``, just written,
        nor another run's: an earlier run's checkpoint-N in the same output_dir, whatever its N)."""
        if not self.total_limit:
            return
        ours = [(n, p) for n, p in checkpoints(self.out)
                if lineage_of(p) == self.lineage or (self.resumed is not None and p.resolve() == self.resumed)]
        for n, p in ours[: -self.total_limit]:
            if n != saved:
                shutil.rmtree(p, ignore_errors=True)

    def settle(self) -> None:
        """Training is stopping on an error: a save whose state is all read out of the store is finished
        (it needs only the disk); one still reading is abandoned (its temporary folder removed), so the
        store can close under neither."""
        if not self._threads:
            return
        self._stopping = True  # a save completing now says so
        reader, writer = self._threads
        if reader.is_alive():
            self._abort.set()
        reader.join()
        writer.join()
        self._threads = []
        self._step, self._error = None, None
        self._stopping = False

    def wait(self) -> dict:
        """Finish the save in progress; raise its failure as a one-line error."""
        for t in self._threads:
            t.join()
        self._threads = []
        step, self._step = self._step, None
        if self._error is not None:
            e, self._error = self._error, None
            if isinstance(e, OSError):
                raise StorageError(f"saving checkpoint-{step} failed ({e}); the previous checkpoints are intact")
            raise e
        return self.last

    def _announce(self, step: int) -> None:
        """The line that says checkpoint-``step`` is complete (from the writer, as it completes)."""
        gb, when = self.last["bytes"] / 1e9, " before stopping" if self._stopping else ""
        self.say(f"saved checkpoint-{step}{when}: {gb:.2f} GB in {self.last['seconds']:.1f} s "
                 f"({gb / max(self.last['seconds'], 1e-9):.2f} GB/s); training paused {self.last['paused']:.2f} s")


def new_lineage() -> str:
    """A run's lineage: a fresh one for a run that starts from step 0."""
    return uuid.uuid4().hex


def lineage_of(path: Path) -> str | None:
    """The lineage a checkpoint records (None: none, or no readable manifest)."""
    try:
        manifest = json.loads((Path(path) / "checkpoint.json").read_text())
    except (OSError, ValueError):
        return None
    lineage = manifest.get("lineage") if isinstance(manifest, dict) else None
    return lineage if isinstance(lineage, str) else None


def lineage_for(out: Path, resume: Path | None, continues_at: int | None = None) -> str:
    """The lineage of a run writing checkpoints to ``out``: that of the checkpoint it resumes; of a service's run
    it continues at step ``continues_at``, that of its newest checkpoint in ``out`` up to that step (its earlier
    trainer's); else a new one."""
    if resume is not None:
        return lineage_of(resume) or new_lineage()
    if continues_at is not None:
        before = [p for n, p in checkpoints(out) if n <= continues_at]
        if before:
            return lineage_of(before[-1]) or new_lineage()
    return new_lineage()


class _Abandoned(Exception):
    """A save given up because training stopped while it still read the store."""
