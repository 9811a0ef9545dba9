"""One rank's part of a checkpoint: the state its HBM holds, written by that rank (several ranks of a host).

The ranks of a host share one store, but a group's state may live in its owner's HBM (``trainer.parallel.dp_session``),
which no other process can read. The lead's ``Saver`` (``trainer.outputs.saver``) writes everything else; each
other rank holding such state writes its own part:

    part = PartSaver(store, mcfg, out_dir, rank, names, has_master, announce)
    part.begin(step)      # as the lead's saver begins: reads each group at update ``step``, writes, syncs
    part.gate(g, update)  # the optimizer's gate: update step + 1 of a group waits until it has been read
    part.wait()           # the part written (its failure raised here)

The part goes to ``.checkpoint-N.tmp-partR/state.zarr`` (a StateWriter's arrays: ``master`` and the moments, of
this rank's tensors only), fsynced; ``announce(step)`` then tells the lead (the host's counter), whose writer moves
it into its checkpoint as ``state-rankR.zarr`` before the manifest and the rename: a checkpoint is whole or absent.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

from tiermem.config import MOMENTS
from tiermem.faults import HOOKS
from tiermem.specs import state_name
from tiermem.store.checkpoint import StateWriter
from trainer.model.weights import all_weights, group_order
from trainer.outputs.checkpoint import part_tmp
from trainer.outputs.saver import ReleaseGate


class PartSaver(ReleaseGate):
    def __init__(self, store, mcfg, out_dir: Path, rank: int, names: set, has_master: bool, announce):
        """``names``: the store names of this rank's HBM-resident state (of any kind; only the kinds a checkpoint
        keeps are written: the master weights, or without them the weights, and the moments)."""
        self.store, self.out, self.rank, self.announce = store, Path(out_dir), rank, announce
        src = "master" if has_master else "param"
        self.store_kind = {"master": src, **{k: k for k in MOMENTS}}
        weights = all_weights(mcfg)
        self.layout = {k: [(w.name, w.shape) for w in weights if state_name(w.name, sk) in names]
                       for k, sk in self.store_kind.items()}
        self.layout = {k: v for k, v in self.layout.items() if v}
        held = {n for v in self.layout.values() for n, _ in v}
        self.groups = [g for g in group_order(mcfg) if any(w.group == g and w.name in held for w in weights)]
        self.weights = {g: [w for w in weights if w.group == g and w.name in held] for g in self.groups}
        self._step: int | None = None
        self._released: dict = {}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._abort = threading.Event()
        self.paused = 0.0

    @property
    def holds_state(self) -> bool:
        return bool(self.layout)

    def begin(self, step: int) -> None:
        self.wait()
        self._abort.clear()
        self._released = {g: threading.Event() for g in self.groups}
        self._step = step
        self._thread = threading.Thread(target=self._save, args=(step,), name="tiermem-save-part", daemon=True)
        self._thread.start()

    def _save(self, step: int) -> None:
        tmp = part_tmp(self.out, step, self.rank)
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            state = StateWriter(tmp / "state.zarr", self.layout)
            rows: dict = {k: {} for k in self.layout}
            order = {k: [n for n, _ in v] for k, v in self.layout.items()}
            nxt = dict.fromkeys(self.layout, 0)
            for g in self.groups:
                self._wait_version(g, step)
                for w in self.weights[g]:
                    for k in self.layout:
                        if w.name in order[k]:
                            rows[k][w.name] = self.store.read(state_name(w.name, self.store_kind[k])).result()
                self._released[g].set()
                for k, have in rows.items():  # (each kind's tensors in the layout's order, as soon as read)
                    while nxt[k] < len(order[k]) and order[k][nxt[k]] in have:
                        state.put(k, order[k][nxt[k]], have.pop(order[k][nxt[k]]))
                        nxt[k] += 1
            state.close()  # (every tensor came; fsynced)
            self.announce(step)
            HOOKS.point("part", step)  # (tests: a rank killed once its part is written)
        except BaseException as e:  # noqa: BLE001 - reported by wait()
            self._error = e
            shutil.rmtree(tmp, ignore_errors=True)
        finally:
            for ev in self._released.values():
                ev.set()  # never leave the optimizer waiting

    def _wait_version(self, g, step: int) -> None:
        while True:
            if self._abort.is_set():
                raise RuntimeError("the checkpoint's part was abandoned")
            try:
                self.store.wait_version(g, step, timeout=0.2)
                return
            except TimeoutError:
                continue

    def settle(self) -> None:
        """Training stops on an error: give up a part still being read."""
        if self._thread is not None:
            self._abort.set()
            self._thread.join()
            self._thread = None
            self._step, self._error = None, None

    def wait(self) -> None:
        """Finish the part in progress; raise its failure."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._step = None
        if self._error is not None:
            e, self._error = self._error, None
            raise e
