"""``tiermem serve``: the store as a service that trainers attach to.

The service owns the DRAM arena (a shared file), the NVMe file, the catalog and the optimizer state. A
trainer attaches over the control socket (``tiermem.service.protocol``), maps the arena and the NVMe file
itself, fetches weights and writes gradients through them, and commits each step; from the commit on
the update is the service's to finish even if the trainer dies. An update is split as in an embedded
run: the trainer's own GPU worker updates ``gpu_share`` of the groups (on the GPU that made their
gradients, writing the new state out of place to places the service hands out, then asking it to
journal and switch: ``alloc``/``flip``), the service's CPU AdamW the rest (out of place too, or in
place behind the undo copy of ``tiermem.service.journal`` where it cannot: NVMe-resident state, no room).
When the trainer leaves mid-update the service updates what it still owed (its own GPU worker, out of
place). The service pushes each group's new version to its trainer.

Requests (JSON, ``op``):
  hello {run, label, specs, optim, rank, world}  attach; creates the run or rejoins it; layout and the
                                                   trainer's groups in the reply (and ``resume``: the
                                                   checkpoint to resume from, when the run's state was lost)
  init {run}                                       the trainer has loaded the weights
  commit {run, step, lr, grad_scale}               step's gradients are home: journal, then update
  alloc {run, step, group}                         places for an owed group's new master and moments
  flip {run, step, group, places}                  they are written: journal, switch, publish the version
  layout {run, names?}                             where tensors live now (before a save or an export)
  progress {run, live, store}                      the trainer's figures, for top and stats
  finish {run}                                     the run is done and exported: free its state
  stats {}                                         the snapshot ``tiermem top --socket`` shows

The service holds the store's lock (``tiermem.service.owner``) from before it touches any of the store's files
until it exits: a second service on the same store is refused. One run at a time; one trainer per run
(the protocol carries rank/world for data parallel later).
SIGHUP re-reads the config and migrates optimizer state between tiers at the next commit; SIGTERM and
SIGINT stop cleanly (the in-flight update finishes; the run's state stays for the next start).
"""

from __future__ import annotations

import concurrent.futures as cf
import getpass
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from tiermem.config import MOMENTS, StoreConfig, load_store_config
from tiermem.errors import ConfigError, UserError
from tiermem.optim import AdamWConfig, StoreAdamW
from tiermem.plan.placement import default_budgets, make_plan
from tiermem.plan.resolve import resolve_auto
from tiermem.schema import to_plain
from tiermem.service import protocol
from tiermem.service.journal import Journal, RunState, UndoGuard, make_private, state_dir, undo_bytes, write_atomic
from tiermem.service.owner import Ownership
from tiermem.store.catalog import TensorSpec
from tiermem.store.layout import create_store, layout_of, reopen_store, spec_from_json, spec_to_json
from tiermem.store.stats import snapshot
from tiermem.tiers.dram import on_disk
from tiermem.tiers.extents import Extent, OutOfSpace
from tiermem.tiers.nvme import check_directory
from tiermem.transfer.mover import Location

log = logging.getLogger(__name__)
MOVABLE = ("master", *MOMENTS)  # kinds only the service touches between steps


class RequestError(Exception):
    """A request the service refuses; the message goes back to the client."""


def service_config(path: str) -> StoreConfig:
    """The service's tiermem config, checked for what a service needs."""
    cfg = load_store_config(path, path)
    if cfg.tiers.dram.path == "anonymous":
        raise ConfigError(f"{path}: the service's arena must be a shared file: set tiers.dram.path to a tmpfs "
                          "directory such as /dev/shm")
    if isinstance(cfg.placement, dict) and "gpu" in cfg.placement.values():
        raise ConfigError(f"{path}: placement on gpu is not possible in service mode (the state must outlive the "
                          "trainer's GPU memory); place every kind on dram or nvme")
    if cfg.name is None:
        cfg.name = f"tiermem-{getpass.getuser()}"
    return cfg


def _planning(cfg: StoreConfig) -> StoreConfig:
    """The config the service plans and builds its own store with (``tiermem.plan.resolve``): no GPU slots or
    resident groups; the GPU (when the config names one and there is CUDA) only for the optimizer's GPU
    worker; every ``auto`` decided."""
    return resolve_auto(cfg, role="service")


def gpu_share(plan_cfg: StoreConfig) -> float:
    """The share of groups the trainer's GPU worker updates while the service's CPU AdamW updates the rest
    (resolved in ``plan_cfg``)."""
    return plan_cfg.optimizer.gpu_share


def _no_room(in_place: int, taken: int) -> str:
    """The finish line's note on group updates a fragmented arena had no room for out of place (slower)."""
    out = f"; {in_place} group updates went in place for want of room in the arena" if in_place else ""
    if taken:
        out += f"; {taken} of the trainer's were handed to the service for want of room"
    return out


def _spare(specs: list[TensorSpec], plan, kinds: tuple[str, ...], tier: str) -> int:
    """Room for the new state of the groups being written out of place on ``tier`` (twice the largest:
    one per worker)."""
    per: dict = {}
    for (g, k), t in plan.where.items():
        if k in kinds and t == tier:
            per[g] = per.get(g, 0) + plan.group_bytes[(g, k)]
    return 2 * max(per.values(), default=0)


@dataclass
class Client:
    sock: socket.socket
    pid: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, obj: dict) -> None:
        with self.lock:
            protocol.send(self.sock, obj)


@dataclass
class Run:
    record: dict
    specs: list[TensorSpec]
    store: object
    journal: Journal
    optimizer: StoreAdamW
    guard: UndoGuard
    trainer: Client | None = None
    live: dict = field(default_factory=dict)
    trainer_store: dict = field(default_factory=dict)
    error: str | None = None
    pending: cf.Future | None = None  # the last update, journaled as updated (or failed)
    # the committed update's groups the trainer's GPU worker owes (the service redoes them if it leaves),
    # whether the service's own part of it is done, and the places handed out for the trainer's writes
    owed: set = field(default_factory=set)
    taken: set = field(default_factory=set)  # owed groups the service found no room for and updates itself
    taken_count: int = 0  # ... how many so far
    own_done: bool = True
    grants: dict = field(default_factory=dict)  # group -> (step, {name: (tier, Extent)})
    mu: threading.Lock = field(default_factory=threading.Lock)  # owed, own_done, pending's completion
    updates: int = 0  # updates run by this service process, and where their time went
    update_seconds: dict = field(default_factory=dict)

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.result()

    @property
    def state(self) -> RunState:
        return self.journal.state


class Service:
    def __init__(self, config_path: str, socket_path: str | None, fresh: bool = False, say=print):
        self.config_path, self.say = config_path, say
        self.cfg = service_config(config_path)
        self.plan_cfg = _planning(self.cfg)
        if self.plan_cfg.tiers.dram.pin == "true" and on_disk(Path(self.cfg.tiers.dram.path)):
            raise ConfigError(f"{config_path}: tiers.dram.path {self.cfg.tiers.dram.path} is on a disk filesystem: "
                              "the GPU cannot pin an arena there; set it to a tmpfs such as /dev/shm")
        nv = self.cfg.tiers.nvme
        if nv is not None and nv.budget:  # the NVMe file is sized to the budget: say so now, not at attach
            file = Path(nv.path) / f"{self.cfg.store_name()}.nvme"
            check_directory(Path(nv.path), nv.budget - (file.stat().st_size if file.is_file() else 0))
        self.dir = state_dir(self.cfg)
        try:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"cannot create the service's state directory {self.dir}: {os.strerror(e.errno)}") from None
        name = self.cfg.store_name()
        # the store's files are this service's before anything of them is read, written or deleted
        self.owner = Ownership.take(name, (self.dir, self.cfg.tiers.dram.path),
                                    {"name": name, "config": str(Path(config_path).resolve()),
                                     "state_dir": str(self.dir.resolve())})
        self.record_path = self.dir / f"{name}.run.json"
        self.journal_path = self.dir / f"{name}.journal"
        self.lock = threading.RLock()
        self.run: Run | None = None
        self.lost: dict | None = None  # a run whose state is gone: {run, checkpoint, step} for its trainer
        self.pending_config: StoreConfig | None = None
        self._listener: socket.socket | None = None
        self._stopping = False
        try:
            self.socket_path = Path(socket_path) if socket_path else protocol.default_socket()
            if fresh:
                self._discard_recorded()
            self._recover()
        except BaseException:
            self.owner.release()
            raise

    def release(self) -> None:
        """Give up the store's files (the service is stopped, or never started)."""
        self.owner.release()

    # -- runs ------------------------------------------------------------------------------------------
    def _discard_recorded(self) -> None:
        name, t = self.cfg.store_name(), self.cfg.tiers
        for p in (Path(t.dram.path) / f"{name}.arena", self.record_path, self.journal_path,
                  (Path(t.nvme.path) / f"{name}.nvme") if t.nvme is not None else None):
            if p is not None and p.exists():
                p.unlink()
                self.say(f"discarded {p}")

    def _recover(self) -> None:
        if not self.record_path.is_file():
            return
        make_private(self.record_path)
        record = json.loads(self.record_path.read_text())
        recorded = record.get("arena_dir", self.cfg.tiers.dram.path)
        if Path(recorded).resolve() != Path(self.cfg.tiers.dram.path).resolve():
            raise UserError(f"the run this service holds has its arena in {recorded}, but the config's "
                            f"tiers.dram.path is {self.cfg.tiers.dram.path}; put the path back, or start with "
                            "--fresh to discard the run")
        arena = Path(recorded) / f"{self.cfg.store_name()}.arena"
        journal = Journal(self.journal_path)
        state = journal.state
        if not arena.is_file():
            found, says = _newest_checkpoint(record)
            self.say(f"the state of run {record['label'].get('output_dir', record['run'])} (step {state.committed}) is "
                     f"gone: its arena {arena} no longer exists (the machine restarted?). {says}")
            if found is not None:  # told to the run's trainer when it attaches
                self.lost = {"run": record["run"], "checkpoint": str(found), "step": state.committed}
            journal.close()
            self._discard_recorded()
            return
        if state.finished or not state.initialized:  # nothing left worth keeping
            journal.close()
            self._discard_recorded()
            return
        specs = [spec_from_json(s) for s in record["specs"]]
        store = reopen_store(self.plan_cfg, specs, state.layout(record), record["nvme_capacity"])
        run = self._make_run(record, specs, store, journal)
        st = run.state
        if record["undo"] is not None:
            store.dram.allocator.reserve(Extent(*record["undo"]))
        for g, v in st.versions.items():
            store.catalog.bump(g, to=v)
        if st.inflight is not None and st.inflight[1] > st.versions.get(st.inflight[0], 0):
            run.guard.restore(st.inflight[0])
            self.say(f"put back group {st.inflight[0]} as it was before update {st.inflight[1]} (cut short)")
        if st.committed > st.updated:
            todo = {g for g in run.optimizer.groups if st.versions.get(g, 0) < st.committed}
            self.say(f"finishing update {st.committed} of {len(todo)} groups")
            run.optimizer.step(st.committed, st.commit_args["lr"], st.commit_args["grad_scale"], only=todo).result()
            run.journal.append("updated", step=st.committed)
        store.keep_files = False
        self.run = run
        self.say(f"recovered run {record['label'].get('output_dir', record['run'])}: step {st.committed} committed "
                 "and updated")

    def _make_run(self, record: dict, specs: list[TensorSpec], store, journal: Journal | None = None) -> Run:
        journal = journal or Journal(self.journal_path)
        o = record["optim"]
        undo = Extent(*record["undo"]) if record["undo"] is not None else None
        guard = UndoGuard(store, journal, undo, o["has_master"], record.get("epoch", 0))
        # (offer_params False: the trainer is another process, nothing to hand over on the GPU)
        optimizer = StoreAdamW(store, o["groups"], o["decay"],
                               AdamWConfig(o["beta1"], o["beta2"], o["eps"], o["weight_decay"]),
                               has_master=o["has_master"], gpu_share=record["gpu_share"], guard=guard,
                               offer_params=False)
        return Run(record, specs, store, journal, optimizer, guard)

    def _new_run(self, msg: dict) -> Run:
        try:
            specs = [spec_from_json(s) for s in _field(msg, "specs", list)]
        except ValueError as e:
            raise RequestError(f"bad tensor spec: {e}") from None
        names = {s.name for s in specs}
        if len(names) != len(specs):
            raise RequestError("duplicate tensor names in the specs")
        o = _field(msg, "optim", dict)
        try:
            optim = {"beta1": float(o["beta1"]), "beta2": float(o["beta2"]), "eps": float(o["eps"]),
                     "weight_decay": float(o["weight_decay"]), "has_master": bool(o["has_master"]),
                     "decay": {str(k): bool(v) for k, v in dict(o["decay"]).items()}, "groups": list(o["groups"])}
        except (KeyError, TypeError, ValueError):
            raise RequestError("bad optim settings: need beta1, beta2, eps, weight_decay, has_master, decay, groups") \
                from None
        groups = {s.group for s in specs}
        if not all(_key(g) for g in optim["groups"]) or set(optim["groups"]) != groups:
            raise RequestError("optim.groups must list every group of the specs once")
        budgets = dict(default_budgets(self.cfg), gpu=0)
        plan = make_plan(specs, self.plan_cfg, ("param",), budgets)
        share = gpu_share(self.plan_cfg)
        undo = undo_bytes(specs, optim["has_master"])  # any group may have to go in place (no room elsewhere)
        moved = ("master" if optim["has_master"] else "param", *MOMENTS)
        spare = {t: _spare(specs, plan, moved, t) for t in ("dram", "nvme")}  # both workers write out of place
        for p in (self.record_path, self.journal_path):
            p.unlink(missing_ok=True)
        store = create_store(self.plan_cfg, specs, plan, undo + spare["dram"], spare["nvme"])
        try:
            ext = store.dram.allocate(undo) if undo else None
            record = {"format": 1, "run": msg["run"], "label": dict(msg.get("label") or {}), "created": time.time(),
                      "specs": [spec_to_json(s) for s in specs], "layout": layout_of(store), "epoch": 0,
                      "arena_dir": self.cfg.tiers.dram.path, "config": str(Path(self.config_path).resolve()),
                      "undo": [ext.offset, ext.nbytes] if ext else None, "optim": optim, "gpu_share": share,
                      "nvme_capacity": store.nvme.capacity if store.nvme is not None else 0}
            write_atomic(self.record_path, record)
            return self._make_run(record, specs, store)
        except BaseException:
            store.close()
            raise

    def _close_run(self, keep: bool) -> None:
        run, self.run = self.run, None
        if run is None:
            return
        run.wait()
        run.optimizer.close()
        run.journal.close()
        run.store.keep_files = keep
        run.store.close()
        if not keep:
            for p in (self.record_path, self.journal_path):
                p.unlink(missing_ok=True)

    # -- requests ---------------------------------------------------------------------------------------
    def dispatch(self, client: Client, msg: dict) -> dict:
        op, mid = msg.get("op"), msg.get("id")
        if not (mid is None or _key(mid)):
            return {"id": None, "ok": False, "error": "'id' must be a number or a string of at most 64 characters"}
        try:
            if not isinstance(op, str):
                raise RequestError("'op' must be a string naming the request")
            handler = {"hello": self._hello, "init": self._init, "commit": self._commit, "layout": self._layout,
                       "progress": self._progress, "finish": self._finish, "stats": self._stats,
                       "alloc": self._alloc, "flip": self._flip, "stop": self._stop}.get(op)
            if handler is None:
                raise RequestError(f"unknown op {op[:40]!r}")
            return {"id": mid, "ok": True, **handler(client, msg)}
        except (RequestError, UserError) as e:
            return {"id": mid, "ok": False, "error": str(e)}
        except Exception as e:  # noqa: BLE001 - a request must never take the service down
            log.error("request %s failed:\n%s", op, traceback.format_exc())
            return {"id": mid, "ok": False, "error": f"internal error: {type(e).__name__}: {e}"}

    def _attached(self, client: Client, msg: dict) -> Run:
        run = self.run
        if run is None:
            raise RequestError("no run is attached: send hello first")
        if msg.get("run") != run.record["run"]:
            raise RequestError(f"this message is for run {str(msg.get('run'))[:16]!r} but the service holds run "
                               f"{run.record['run'][:16]!r}")
        if run.trainer is not client:
            raise RequestError("this connection is not the run's trainer: send hello first")
        return run

    def _hello(self, client: Client, msg: dict) -> dict:
        run_id = _field(msg, "run", str)
        if not 0 < len(run_id) <= 128:
            raise RequestError("bad run id")
        label = msg.get("label")
        if label is not None and not (isinstance(label, dict) and len(label) <= 16 and
                                      all(isinstance(v, str) and len(v) <= 4096 for v in label.values())):
            raise RequestError("'label' must be an object of strings (model, output_dir)")
        if msg.get("world", 1) != 1 or msg.get("rank", 0) != 0:
            raise RequestError("several trainers on one run (data parallel) are not supported yet: world must be 1")
        with self.lock:
            run = self.run
            if run is not None and run.record["run"] != run_id:
                label = run.record["label"]
                raise RequestError(
                    f"the service holds another run ({label.get('model', '?')} -> {label.get('output_dir', '?')}, "
                    f"step {run.state.committed}); let it finish, or restart the service with --fresh to discard it")
            if run is not None and run.trainer is not None:
                raise RequestError(f"run {label_of(run)} already has a trainer attached (pid {run.trainer.pid}); "
                                   "one trainer per run for now")
            if run is None:
                run = self.run = self._new_run(msg)
                self.say(f"new run {label_of(run)}: {len(run.specs)} tensors")
            client.pid = msg.get("pid") if isinstance(msg.get("pid"), int) else 0
            run.trainer, run.error = client, None
            run.store.catalog.on_bump = lambda g, v, c=client, r=run: self._tell(c, {
                "ev": "version", "group": g, "version": v, "layout": layout_of(r.store, g)})
            st, cfg, nvme = run.state, self.cfg, run.store.nvme
            self.say(f"trainer pid {client.pid} attached to run {label_of(run)} at step {st.committed}")
            lost = self.lost if self.lost is not None and self.lost["run"] == run_id and not st.initialized else None
            return {"initialized": st.initialized, "resume": lost, "committed": st.committed, "updated": st.updated,
                    "versions": [[g, run.store.catalog.version(g)] for g in run.optimizer.groups],
                    "layout": layout_of(run.store), "specs": run.record["specs"],
                    "arena": {"name": cfg.store_name(), "dir": cfg.tiers.dram.path},
                    "nvme": None if nvme is None else {
                        "dir": cfg.tiers.nvme.path, "capacity": nvme.capacity, "backend": cfg.tiers.nvme.backend,
                        "threads": cfg.tiers.nvme.threads, "io_chunk": cfg.tiers.nvme.io_chunk,
                        "direct": cfg.tiers.nvme.direct},
                    "config": to_plain(cfg), "gpu_share": run.record["gpu_share"],
                    "trainer_groups": [g for g in run.optimizer.groups if g in run.optimizer.on_gpu]}

    def _tell(self, client: Client, event: dict) -> None:
        try:
            client.send(event)
        except OSError:
            pass  # the trainer is gone; it learns the versions again when it attaches

    def _init(self, client: Client, msg: dict) -> dict:
        """The trainer has written the weights (and, resuming from a checkpoint at ``step``, the moments)."""
        run = self._attached(client, msg)
        step = _field(msg, "step", int)
        if run.state.initialized or step < 0:
            raise RequestError("init of a run already initialized, or at a negative step")
        groups = run.optimizer.groups
        for kind in ("param", "master") + (MOMENTS if step else ()):
            for g in groups:
                run.store.mark_valid(g, kind)
        for g in groups:
            run.store.catalog.bump(g, to=step)
        run.journal.append("init", sync=True, step=step, groups=groups)
        if self.lost is not None and self.lost["run"] == run.record["run"]:
            self.lost = None  # its trainer has loaded the checkpoint (or chose to start over)
        return {}

    def _commit(self, client: Client, msg: dict) -> dict:
        run = self._attached(client, msg)
        step = _field(msg, "step", int)
        lr = _finite(msg, "lr")
        scale = None if msg.get("grad_scale") is None else _finite(msg, "grad_scale")
        with self.lock:
            st = run.state
            if not st.initialized:
                raise RequestError("commit before init: load the weights first")
            if step != st.committed + 1:
                raise RequestError(f"out of order: commit of step {step} but the next step is {st.committed + 1}")
            if run.error:
                raise RequestError(f"the optimizer failed: {run.error}; fix the cause and restart the service: "
                                   "it recovers the last committed step")
            run.wait()  # the last update is whole (its last journal line may still be on its way)
            moved = self._replace(run) if self.pending_config is not None else False
            run.journal.compact()
            for g in run.optimizer.groups:
                run.store.mark_valid(g, "grad")
            run.journal.append("commit", sync=True, step=step, lr=lr, grad_scale=scale)
            opt = run.optimizer
            with run.mu:
                run.owed = set(opt.on_gpu)  # the trainer's GPU worker updates these (alloc, flip)
                run.own_done = False
                run.pending = cf.Future()
            fut = opt.step(step, lr, scale, only=set(opt.groups) - run.owed)
            fut.add_done_callback(lambda f, run=run, step=step: self._updated(run, step, f))
        return {"layout": layout_of(run.store)} if moved else {}

    def _updated(self, run: Run, step: int, fut) -> None:
        """The service's part of update ``step`` ended."""
        if fut.exception() is not None:
            self._failed(run, step, fut.exception())
            return
        seconds, split = run.optimizer.update_figures()
        run.updates += 1
        for k, v in {"total": seconds, **split}.items():
            run.update_seconds[k] = run.update_seconds.get(k, 0.0) + v
        with run.mu:
            run.own_done = True
            self._maybe_updated(run, step)

    def _failed(self, run: Run, step: int, err: BaseException) -> None:
        run.error = f"{type(err).__name__}: {err}"
        self.say(f"update {step} failed: {run.error}")
        if run.trainer is not None:
            self._tell(run.trainer, {"ev": "failed", "error": run.error})
        with run.mu:
            if run.pending is not None and not run.pending.done():
                run.pending.set_result(None)

    def _maybe_updated(self, run: Run, step: int) -> None:
        """Journal update ``step`` whole once both its parts are (call with ``run.mu`` held)."""
        if run.own_done and not run.owed and not run.taken and run.pending is not None and not run.pending.done():
            run.journal.append("updated", step=step)
            run.pending.set_result(None)

    # -- the trainer's share of an update ---------------------------------------------------------------
    def _owed(self, client: Client, msg: dict) -> tuple[Run, object, int]:
        run = self._attached(client, msg)
        step, g = _field(msg, "step", int), msg.get("group")
        if not _key(g) or step != run.state.committed or g not in run.owed:
            raise RequestError(f"group {str(g)[:40]!r} is not owed by the trainer for update {step}")
        return run, g, step

    def _alloc(self, client: Client, msg: dict) -> dict:
        """Places for the new master weights and moments of a group the trainer updates out of place. With
        no room for them (a fragmented arena) the service takes the group: its CPU worker updates it in
        place behind the undo copy, and the reply says so (places: null)."""
        with self.lock:
            run, g, step = self._owed(client, msg)
            store, old = run.store, run.grants.pop(g, None)
            if old is not None:
                self._free_grant(run, old)
            names = run.optimizer.state_names(g)
            try:
                places = store.allocate_elsewhere(names)
            except OutOfSpace:
                self._take_over(run, g, step)
                return {"places": None}
            run.grants[g] = (step, {n: (store.catalog[n].tier, places[n]) for n in names})
            return {"places": {n: [ext.offset, ext.nbytes] for n, ext in places.items()}}

    def _take_over(self, run: Run, g, step: int) -> None:
        """The service updates owed group ``g`` on its CPU worker (call with the lock held)."""
        st = run.state
        with run.mu:
            run.owed.discard(g)
            run.taken.add(g)
            run.taken_count += 1
        fut = run.optimizer.update_on_cpu([g], step, st.commit_args["lr"], st.commit_args["grad_scale"])

        def done(f, run=run, g=g):
            if f.exception() is not None:
                self._failed(run, step, f.exception())
                return
            with run.mu:
                run.taken.discard(g)
                self._maybe_updated(run, step)

        fut.add_done_callback(done)

    def _flip(self, client: Client, msg: dict) -> dict:
        """The trainer wrote a group's update where ``alloc`` said: journal it, make it the home, publish."""
        with self.lock:
            run, g, step = self._owed(client, msg)
            step_of, places = run.grants.get(g, (None, {}))
            given = msg.get("places")
            if step_of != step or not isinstance(given, dict) or \
                    {n: [ext.offset, ext.nbytes] for n, (_, ext) in places.items()} != given:
                raise RequestError(f"flip of group {str(g)[:40]!r} to places the service did not allocate")
            del run.grants[g]
            run.guard.flip(g, step, {n: ext for n, (_, ext) in places.items()})
            run.store.catalog.bump(g, to=step)
            with run.mu:
                run.owed.discard(g)
                self._maybe_updated(run, step)
        return {}

    def _free_grant(self, run: Run, grant) -> None:
        for tier, ext in grant[1].values():
            run.store.tier(tier).free(ext)

    def _detach(self, run: Run) -> None:
        """The run's trainer is gone (call with the lock held)."""
        run.trainer = None
        run.store.catalog.on_bump = None
        run.live["phase"] = "no trainer attached"
        self._trainer_left(run)

    def _trainer_left(self, run: Run) -> None:
        """The trainer is gone (call with the lock held): its unfinished share of the committed update is
        the service's now."""
        for grant in run.grants.values():
            self._free_grant(run, grant)
        run.grants = {}
        if not run.owed or run.error:
            return
        st, todo = run.state, set(run.owed)
        self.say(f"finishing update {st.committed} of {len(todo)} groups the trainer left")
        fut = run.optimizer.step(st.committed, st.commit_args["lr"], st.commit_args["grad_scale"], only=todo)

        def redone(f, run=run, step=st.committed):
            if f.exception() is not None:
                self._failed(run, step, f.exception())
                return
            with run.mu:
                run.owed.clear()
                self._maybe_updated(run, step)

        fut.add_done_callback(redone)

    def _layout(self, client: Client, msg: dict) -> dict:
        run = self._attached(client, msg)
        layout = layout_of(run.store)
        names = msg.get("names")
        if names is None:
            return {"layout": layout}
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise RequestError("'names' must be a list of tensor names")
        unknown = [str(n)[:80] for n in names if n not in layout]
        if unknown:
            raise RequestError(f"unknown tensor names: {', '.join(unknown[:5])}")
        return {"layout": {n: layout[n] for n in names}}

    def _progress(self, client: Client, msg: dict) -> dict:
        run = self._attached(client, msg)
        live = _object(msg, "live", {"optimizer": {"split": {}}})
        store = _object(msg, "store", {"tiers": {"gpu": {}}, "links": {}, "waits_s": {}})
        run.live, run.trainer_store = live, store
        return {}

    def _finish(self, client: Client, msg: dict) -> dict:
        run = self._attached(client, msg)
        with self.lock:
            run.wait()
            if run.state.updated != run.state.committed:
                raise RequestError("finish before the last update completed")
            run.journal.append("finished", sync=True)
            n = max(run.updates, 1)
            split = ", ".join(f"{k} {v / n:.3f}" for k, v in run.update_seconds.items() if k != "total" and v)
            self.say(f"run {label_of(run)} finished at step {run.state.committed}; its state is freed. "
                     f"{run.updates} updates here, {run.update_seconds.get('total', 0.0) / n:.3f} s each ({split})"
                     + _no_room(run.optimizer.no_room, run.taken_count))
            self._close_run(keep=False)
        return {}

    def _stop(self, client: Client, msg: dict) -> dict:
        """The trainer stops without committing another step (a step it refused to apply, an error): say
        why; the run stays at its last committed step for a rerun."""
        run = self._attached(client, msg)
        reason = " ".join(_field(msg, "reason", str)[:400].split())
        self.say(f"trainer pid {client.pid} stopped run {label_of(run)}: {reason}; the run stays at step "
                 f"{run.state.committed}")
        return {"committed": run.state.committed}

    def _stats(self, client: Client, msg: dict) -> dict:
        return {"snapshot": self.snapshot()}

    # -- stats --------------------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """What ``tiermem top --socket`` shows: the service's store (tiers, NVMe link, optimizer) merged with
        the attached trainer's (GPU tier, PCIe links, waits) and its progress."""
        run = self.run
        if run is None:
            return {"pid": os.getpid(), "service": {"socket": str(self.socket_path), "run": None},
                    "store": {"store": self.cfg.store_name(), "tiers": {}, "links": {}, "waits_s": {}},
                    "run": {"phase": "idle: no run attached"}}
        snap = snapshot(run.store)
        snap["tiers"].pop("gpu", None)
        ts = run.trainer_store
        if ts.get("tiers", {}).get("gpu"):
            snap["tiers"] = {"gpu": ts["tiers"]["gpu"], **snap["tiers"]}
        links = {k: v for k, v in (ts.get("links") or {}).items() if "gpu" in k}
        links.update({k: v for k, v in snap["links"].items() if "nvme" in k})
        snap["links"], snap["waits_s"] = links, ts.get("waits_s", {})
        st = run.state
        versions = [run.store.catalog.version(g) for g in run.optimizer.groups]
        live = dict(run.live)
        if run.trainer is None:
            live["phase"] = "no trainer attached"
        theirs = dict(live.get("optimizer") or {})  # the trainer's: the whole update as it saw it, its GPU share
        split = {k: v for k, v in (theirs.get("split") or {}).items() if k.startswith("trainer_")}
        split.update({f"service_{k}": v for k, v in run.optimizer.last_split.items()})
        live["optimizer"] = dict(theirs, committed=st.committed, updated=st.updated,
                                 lag_groups=sum(v < st.committed for v in versions), gpu_share=run.record["gpu_share"],
                                 cpu_groups=self.plan_cfg.optimizer.cpu_groups,
                                 last_update_s=theirs.get("last_update_s") or run.optimizer.last_step_seconds,
                                 split=split)
        return {"pid": os.getpid(), "store": snap, "run": live,
                "service": {"socket": str(self.socket_path), "run": run.record["run"], "label": run.record["label"],
                            "trainer_pid": run.trainer.pid if run.trainer else None, "error": run.error}}

    # -- live re-placement ---------------------------------------------------------------------------------
    def reload(self) -> None:
        """SIGHUP: read the config again; placement and budget changes apply at the next commit."""
        try:
            cfg = service_config(self.config_path)
        except UserError as e:
            self.say(f"SIGHUP: config not reloaded: {e}")
            return
        if cfg.store_name() != self.cfg.store_name() or cfg.tiers.dram.path != self.cfg.tiers.dram.path:
            self.say("SIGHUP: the store's name and arena directory cannot change while it runs; not reloaded")
            return
        with self.lock:
            self.pending_config = cfg
        self.say("SIGHUP: config reloaded; re-placement happens before the next update")

    def _replace(self, run: Run) -> bool:
        """Move optimizer state between tiers to follow the reloaded config (called by commit once the last
        update is whole, before the next starts); True when something moved."""
        cfg, self.pending_config = self.pending_config, None
        self.cfg, self.plan_cfg = cfg, _planning(cfg)
        budgets = dict(default_budgets(cfg), gpu=0)
        try:
            plan = make_plan(run.specs, self.plan_cfg, ("param",), budgets)
        except UserError as e:
            self.say(f"re-placement skipped: {e}")
            return False
        store, moves, refused = run.store, [], set()
        for e in store.catalog.entries():
            want = plan.where[(e.spec.group, e.spec.kind)]
            if want == e.tier:
                continue
            if e.spec.kind not in MOVABLE:
                refused.add(e.spec.kind)
                continue
            if store.tier(want) is None:
                refused.add(f"{e.spec.kind} (this run has no {want} tier: set tiers.{want}.budget to reserve one)")
                continue
            moves.append((e, want))
        if refused:
            self.say(f"re-placement of {', '.join(sorted(refused))} needs a new run; left in place")
        done, olds = [], []
        try:
            for e, want in moves:
                ext = store.tier(want).allocate(e.spec.nbytes)
                done.append((e, want, ext))
                store.mover.copy(store.location(e), Location(want, ext, e.spec.nbytes)).result()
        except Exception as err:  # noqa: BLE001 - no room, I/O: keep the old placement
            for _, want, ext in done:
                store.tier(want).free(ext)
            self.say(f"re-placement stopped: {err}; nothing moved")
            return False
        for e, want, ext in done:
            olds.append((e.tier, e.extent))
            e.tier, e.extent = want, ext
        run.record["layout"] = layout_of(store)
        run.record["epoch"] = run.guard.epoch = run.record.get("epoch", 0) + 1  # older journaled moves are void
        write_atomic(self.record_path, run.record)  # the new places are recorded before the old are reused
        for tier, ext in olds:
            store.tier(tier).free(ext)
        if moves:
            moved = {}
            for e, want in moves:
                moved.setdefault((e.spec.kind, want), 0)
                moved[(e.spec.kind, want)] += 1
            self.say("re-placed: " + ", ".join(f"{k} of {n} tensors -> {t}" for (k, t), n in moved.items()))
        return bool(moves)

    # -- serving ------------------------------------------------------------------------------------------
    def listen(self) -> None:
        path = self.socket_path
        protocol.make_way(path)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            s.bind(str(path))
        except OSError as e:
            s.close()
            raise UserError(f"cannot listen on {path}: {os.strerror(e.errno)}") from None
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        s.listen(16)
        self._listener = s
        threading.Thread(target=self._accept, name="tiermem-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="tiermem-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        client = Client(conn)
        try:
            uid = protocol.peer_uid(conn)
            if not protocol.peer_allowed(uid):
                client.send({"id": None, "ok": False, "error": f"refused: uid {uid} is not the service's user"})
                return
            while not self._stopping:
                try:
                    msg = protocol.recv(conn)
                except protocol.ProtocolError as e:
                    client.send({"id": None, "ok": False, "error": f"bad message: {e}"})
                    return
                if msg is None:
                    return
                client.send(self.dispatch(client, msg))
        except OSError:
            pass
        finally:
            with self.lock:
                run = self.run
                if run is not None and run.trainer is client:
                    self._detach(run)
                    self.say(f"trainer pid {client.pid} detached from run {label_of(run)} (step "
                             f"{run.state.committed} committed)")
                    if not run.state.initialized:  # nothing of value yet: do not block other runs
                        self._close_run(keep=False)
            conn.close()

    def shutdown(self) -> None:
        """Stop: no new requests, the in-flight update finishes, the run's state stays for the next start."""
        self._stopping = True
        if self._listener is not None:
            self._listener.close()
            self.socket_path.unlink(missing_ok=True)
        with self.lock:
            run = self.run
            if run is not None:
                if run.trainer is not None:
                    try:
                        run.trainer.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    self.say(f"trainer pid {run.trainer.pid} detached")
                    self._detach(run)  # what it still owed of the update in flight is the service's to finish
                self._close_run(keep=True)
                self.say(f"stopped; run {label_of(run)} kept at step {run.state.committed} for the next "
                         "`tiermem serve` with this config")


def label_of(run: Run) -> str:
    return str(run.record["label"].get("output_dir") or run.record["run"][:16])


def _field(msg: dict, key: str, types):
    value = msg.get(key)
    if not isinstance(value, types) or isinstance(value, bool):
        raise RequestError(f"'{key}' is missing or of the wrong type")
    return value


def _key(value) -> bool:
    """Whether ``value`` may name a group or a request: a number or a short string."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, str) and len(value) <= 64)


def _finite(msg: dict, key: str) -> float:
    value = _field(msg, key, (int, float))
    try:
        value = float(value)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        raise RequestError(f"'{key}' must be a finite number")
    return value


def _object(msg: dict, key: str, inner: dict) -> dict:
    """``msg[key]``, an object ({} when absent) whose keys named in ``inner`` are objects too (or absent), as
    deep as ``inner`` says: what the service reads of a trainer's figures."""
    def check(value, where: str, shape: dict) -> None:
        if not isinstance(value, dict):
            raise RequestError(f"'{where}' must be an object")
        for k, sub in shape.items():
            if value.get(k) is not None:
                check(value[k], f"{where}.{k}", sub)

    value = {} if msg.get(key) is None else msg[key]
    check(value, key, inner)
    return dict(value)


def _newest_checkpoint(record: dict) -> tuple[Path | None, str]:
    """The newest complete checkpoint in the run's output_dir (None when there is none), and what to say."""
    out = record.get("label", {}).get("output_dir")
    if not out or not Path(out).is_dir():
        return None, "No checkpoint of it is known."
    found = sorted((int(p.name.split("-")[1]), p) for p in Path(out).glob("checkpoint-*")
                   if p.name.split("-")[1].isdigit() and (p / "checkpoint.json").is_file())
    if not found:
        return None, f"It has no checkpoint in {out}: start it again."
    return found[-1][1], f"Newest checkpoint: {found[-1][1]} (rerun the trainer: it resumes from there)."


def serve(config_path: str, socket_path: str | None, fresh: bool) -> int:
    """Run the service in the foreground until SIGTERM or SIGINT."""
    say = lambda text: print(f"tiermem serve: {text}", flush=True)
    # blocked before any thread starts, so that every thread inherits it and sigwait below takes them
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
    service = None
    try:
        service = Service(config_path, socket_path, fresh, say)
        service.listen()
    except BaseException:
        if service is not None:
            service.release()
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        raise
    say(f"listening on {service.socket_path}")
    while True:
        sig = signal.sigwait({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
        if sig == signal.SIGHUP:
            service.reload()
            continue
        say(f"{signal.Signals(sig).name}: stopping")
        service.shutdown()
        service.release()
        sys.stdout.flush()
        return 0


__all__ = ["Service", "serve", "service_config"]

