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

A run of several ranks of one host (``trainer.parallel.dp_service``): every rank attaches, rank 0 first (the run's
trainer: it loads, commits, finishes); each says which groups it owns, and its GPU worker takes those of the
trainers' share; the versions go to every rank. A rank done says ``leave``; a rank lost otherwise detaches
the whole run (the service finishes what the trainers owed, as for one trainer). State the plan keeps in HBM lives
on its group's owner's GPU, in the service's block there; each rank maps its own (``tiermem.service.ranks``).

Requests (JSON, ``op``):
  hello {run, label, specs, optim, rank, world,    attach; creates the run or rejoins it (rank 0), or joins
         owns, owners}                             rank 0's (another rank; rank 0 of several says every
                                                   group's owner); layout and the groups of the
                                                   trainers' share this rank takes in the reply (and
                                                   ``resume``: the checkpoint to resume from, when the run's
                                                   state was lost)
  init {run}                                       the trainer has loaded the weights
  commit {run, step, lr, grad_scale, grant?}       step's gradients are home: journal, then update; places
                                                   for the groups in ``grant`` (as alloc), in the reply
  alloc {run, step, group}                         places for an owed group's new master and moments
  flip {run, step, group, places, next?}           they are written: journal, switch, publish the version;
                                                   then as alloc for group ``next``, if given
  layout {run, names?}                             where tensors live now (before a save or an export)
  progress {run, live, store}                      the trainer's figures, for top and stats
  finish {run}                                     the run is done and exported: free its state
  leave {run}                                      a rank other than 0 is done: its going away is no loss
  stats {}                                         the snapshot ``tiermem top --socket`` shows

The service holds the store's lock (``tiermem.service.owner``) from before it touches any of the store's files
until it exits: a second service on the same store is refused. One run at a time; one trainer per run (of
several ranks: one per rank).
SIGHUP re-reads the config and migrates optimizer state between tiers at the next commit; SIGTERM and
SIGINT stop cleanly (the in-flight update finishes; the run's state stays for the next start).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

from tiermem.config import StoreConfig
from tiermem.errors import UserError
from tiermem.faults import HOOKS
from tiermem.optim import OptimSettings
from tiermem.plan.placement import default_budgets, make_plan
from tiermem.plan.resolve import compute_device
from tiermem.schema import to_plain
from tiermem.service import protocol
from tiermem.service.config import (
    DISK_FIELD,
    check_arena_pinnable,
    check_disk_room,
    gpu_share,
    planning_config,
    service_config,
    shared_disk,
)
from tiermem.service.discarding import Discarding
from tiermem.service.hbm import DURABILITY, Mirrors, ServiceHbm, hbm_groups, lost_with_service, mirror_bytes, on_device
from tiermem.service.journal import Journal, UndoGuard, state_dir, undo_bytes, write_atomic
from tiermem.service.listening import Listening
from tiermem.service.monitor import Monitoring
from tiermem.service.owner import Ownership
from tiermem.service.planning import check_hbm_plan, plan_run, service_machine
from tiermem.service.ranks import check_owns, check_rejoin, hbm_of, owners_of
from tiermem.service.recovery import Recovery
from tiermem.service.replace import Replacement
from tiermem.service.requests import RequestError, field_of, is_key, object_of
from tiermem.service.runs import Client, Run, kept_line, label_of, no_room_note, room_for_new_state
from tiermem.service.updates import UpdateRequests
from tiermem.specs import MOMENTS, TensorSpec
from tiermem.store.layout import create_store, layout_of, shared_description, spec_from_json, spec_to_json
from tiermem.store.stats import run_problem, store_problem
from tiermem.tiers import registry
from tiermem.tiers.base import DEVICE, HOST
from tiermem.tiers.extents import Extent

log = logging.getLogger(__name__)


class Service(UpdateRequests, Replacement, Recovery, Monitoring, Listening, Discarding):
    def __init__(self, config_path: str, socket_path: str | None, fresh: bool = False, say=print):
        self.config_path, self.say = config_path, say
        self.cfg = service_config(config_path)
        self.plan_cfg = planning_config(self.cfg)
        check_arena_pinnable(self.cfg, self.plan_cfg, config_path)
        check_disk_room(self.cfg)  # (the storage tier's files are sized to its budget: said now, not at attach)
        self.dir = state_dir(self.cfg)
        try:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"cannot create the service's state directory {self.dir}: {os.strerror(e.errno)}") from None
        name = self.cfg.store_name()
        # the store's files are this service's before anything of them is read, written or deleted
        self.owner = Ownership.take(name, (self.dir, self.cfg.tiers.host_tier.path),
                                    {"name": name, "config": str(Path(config_path).resolve()),
                                     "state_dir": str(self.dir.resolve())})
        self.record_path = self.dir / f"{name}.run.json"
        self.journal_path = self.dir / f"{name}.journal"
        self.lock = threading.RLock()
        self.run: Run | None = None
        self.lost: dict | None = None  # a run whose state is gone: {run, checkpoint, step} for its trainer
        self.pending_config: StoreConfig | None = None
        self.machine = None  # the planner's figures of this machine (service_machine), once a run is planned
        self.hbm = ServiceHbm(compute_device(self.plan_cfg))  # the HBM block its runs keep state in
        self._listener: socket.socket | None = None
        self._stopping = False
        self._peers: dict[int, Client] = {}  # every open connection, by id (protocol.pulse)
        self._peers_lock = threading.Lock()
        try:
            self.socket_path = Path(socket_path) if socket_path else protocol.default_socket()
            if fresh:
                self._discard_recorded()
            self._recover()
        except BaseException:
            self.owner.release()
            raise

    def _machine(self):
        """The machine's figures for the planner, measured once (when the first run is planned)."""
        if self.machine is None:
            self.machine = service_machine(self.plan_cfg)
        return self.machine

    def release(self) -> None:
        """Give up the store's files and its HBM (the service is stopped, or never started)."""
        self.owner.release()
        self.hbm.close()

    def arena_owner(self) -> dict:
        """What the header of this service's arena says of it: where its run is recorded (``tiermem arenas`` finds
        a run to recover there, without the lock file beside the arena), its config and its socket."""
        return {"kind": "service", "state_dir": str(self.dir.resolve()),
                "config": str(Path(self.config_path).resolve()), "socket": str(self.socket_path)}

    # -- runs ------------------------------------------------------------------------------------------
    def _make_run(self, record: dict, specs: list[TensorSpec], store, journal: Journal | None = None,
                  mirrors: Mirrors | None = None) -> Run:
        journal = journal or Journal(self.journal_path)
        settings = OptimSettings.from_json(record["optim"])
        undo = Extent(*record["undo"]) if record["undo"] is not None else None
        guard = UndoGuard(store, journal, undo, settings.has_master, record.get("epoch", 0), mirrors,
                          in_place=lost_with_service(record))
        # (offer_params False: the trainer is another process, nothing to hand over on the GPU)
        on_gpu = record.get("plan", {}).get("gpu_updates")  # (the planner's split, when it planned the run)
        optimizer = settings.optimizer(store, gpu_share=record["gpu_share"], guard=guard, offer_params=False,
                                       **({"on_gpu": on_gpu} if on_gpu is not None else {}))
        optimizer.resplit(optimizer.on_gpu | hbm_groups(store))  # (a group with state in HBM is the GPU worker's)
        cpu = len(set(optimizer.groups) - optimizer.on_gpu)
        if guard.in_place and cpu:
            self.say(f"the service's CPU worker updates its {cpu} group{'s' if cpu != 1 else ''} in place: a crash of "
                     "the service loses the state kept in HBM, and the run then resumes from its newest checkpoint "
                     "(durability: checkpoint)")
        return Run(record, specs, store, journal, optimizer, guard)

    def _new_run(self, msg: dict) -> Run:
        try:
            specs = [spec_from_json(s) for s in field_of(msg, "specs", list)]
        except ValueError as e:
            raise RequestError(f"bad tensor spec: {e}") from None
        names = {s.name for s in specs}
        if len(names) != len(specs):
            raise RequestError("duplicate tensor names in the specs")
        try:
            optim = OptimSettings.from_json(field_of(msg, "optim", dict))
        except ValueError as e:
            raise RequestError(str(e)) from None
        groups = {s.group for s in specs}
        if not all(is_key(g) for g in optim.groups) or set(optim.groups) != groups:
            raise RequestError("optim.groups must list every group of the specs once")
        world = msg.get("world", 1)
        owners = owners_of(msg, optim.groups, world) if world > 1 else None  # (several ranks: whose HBM holds what)
        planned = plan_run(specs, self.plan_cfg, self.cfg, msg.get("plan"), self._machine, owners=owners)
        if planned is not None:  # the trainer sent its step: the planner's placement, split and passes
            plan, share, told = planned
            self.say(f"planned for {plan.machine.source}: predicted step {plan.prediction.step:.2f}s, {plan.passes} "
                     f"pass{'es' if plan.passes > 1 else ''} a step, the trainer's GPU worker updating {share:.0%} of "
                     "the groups")
        else:  # (no workload sent, or every kind pinned: the fixed rule)
            plan, told = make_plan(specs, self.plan_cfg, ("param",), default_budgets(self.cfg), owners), None
            share = gpu_share(self.plan_cfg)
        check_hbm_plan(plan.where, owners)
        undo = undo_bytes(specs, optim.has_master)  # any group may have to go in place (no room elsewhere)
        moved = ("master" if optim.has_master else "param", *MOMENTS)
        # both workers write out of place
        host, disk, device = registry.primary(HOST), shared_disk(), registry.primary(DEVICE)
        # (several ranks: each rank's GPU worker writes its groups' new state in the arena; in HBM, in its own part)
        spare = {t: room_for_new_state(specs, plan, moved, t, 2 if t == device else world + 1, slack=t == device)
                 for t in (host, disk, device)}
        step = self.cfg.durability == "step"
        copies = mirror_bytes(specs, plan.where, device) if step else 0
        for p in (self.record_path, self.journal_path, self.hbm_file()):
            p.unlink(missing_ok=True)
        store, parts = create_store(self.plan_cfg, specs, plan, undo + spare[host] + copies, spare[disk],
                                    self.arena_owner(), spare[device], self.hbm, owners, world)
        try:
            ext = store.tiers.host.allocate(undo) if undo else None
            mirrors = Mirrors.allocate(store, specs) if step else None
            record = {"format": 1, "run": msg["run"], "label": dict(msg.get("label") or {}), "created": time.time(),
                      "specs": [spec_to_json(s) for s in specs], "layout": layout_of(store), "epoch": 0,
                      "arena_dir": self.cfg.tiers.host_tier.path, "config": str(Path(self.config_path).resolve()),
                      "undo": [ext.offset, ext.nbytes] if ext else None, "optim": optim.to_json(), "gpu_share": share,
                      "nvme_capacity": store.tiers[disk].capacity if disk in store.tiers else 0,
                      "hbm_capacity": store.tiers.device.capacity if on_device(store) else 0,
                      "durability": self.cfg.durability, "mirrors": mirrors.to_json() if mirrors else None,
                      "world": world}
            if owners is not None and on_device(store):  # (each rank's part of the HBM, on its GPU)
                record.update(hbm_parts=parts, owners=[[g, owners[g]] for g in optim.groups])
            if told is not None:
                record["plan"] = told
            write_atomic(self.record_path, record)
            run = self._make_run(record, specs, store, mirrors=mirrors)
            if told is not None and told["gpu_updates"] is not None and world == 1 and (
                    compute_device(self.plan_cfg).type == "cuda" or HOOKS.split_on_cpu):
                run.plan = plan  # (split again once its CPU worker's rate is measured: tiermem.service.updates)
            return run
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
        if not (mid is None or is_key(mid)):
            return {"id": None, "ok": False, "error": "'id' must be a number or a string of at most 64 characters"}
        try:
            if not isinstance(op, str):
                raise RequestError("'op' must be a string naming the request")
            handler = {"hello": self._hello, "init": self._init, "commit": self._commit, "layout": self._layout,
                       "progress": self._progress, "finish": self._finish, "stats": self._stats,
                       "alloc": self._alloc, "flip": self._flip, "stop": self._stop, "leave": self._leave}.get(op)
            if handler is None:
                raise RequestError(f"unknown op {op[:40]!r}")
            return {"id": mid, "ok": True, **handler(client, msg)}
        except (RequestError, UserError) as e:
            return {"id": mid, "ok": False, "error": str(e)}
        except Exception as e:  # noqa: BLE001 - a request must never take the service down
            log.error("request %s failed:\n%s", op, traceback.format_exc())
            return {"id": mid, "ok": False, "error": f"internal error: {type(e).__name__}: {e}"}

    def _attached(self, client: Client, msg: dict, any_rank: bool = False) -> Run:
        """The run a request of ``client`` is for: its trainer's (rank 0's), or with ``any_rank`` any of its
        ranks' (a run of several: the others take their share of the GPU updates and follow the layout)."""
        run = self.run
        if run is None:
            raise RequestError("no run is attached: send hello first")
        if msg.get("run") != run.record["run"]:
            raise RequestError(f"this message is for run {str(msg.get('run'))[:16]!r} but the service holds run "
                               f"{run.record['run'][:16]!r}")
        if run.trainer is client or (any_rank and client in run.peers.values()):
            return run
        if client in run.peers.values():
            raise RequestError(f"rank {client.rank} asks what only rank 0, the run's trainer, may")
        raise RequestError("this connection is not the run's trainer: send hello first")

    def _hello(self, client: Client, msg: dict) -> dict:
        run_id = field_of(msg, "run", str)
        if not 0 < len(run_id) <= 128:
            raise RequestError("bad run id")
        label = msg.get("label")
        if label is not None and not (isinstance(label, dict) and len(label) <= 16 and
                                      all(isinstance(v, str) and len(v) <= 4096 for v in label.values())):
            raise RequestError("'label' must be an object of strings (model, output_dir)")
        world, rank = msg.get("world", 1), msg.get("rank", 0)
        if not (type(world) is int and type(rank) is int and 1 <= world <= 1024 and 0 <= rank < world):
            raise RequestError("'world' and 'rank' must be whole numbers, 0 <= rank < world <= 1024")
        owns, fresh = msg.get("owns"), msg.get("fresh", False)
        if world > 1 and not (isinstance(owns, list) and all(is_key(g) for g in owns)):
            raise RequestError("a rank of several must say which groups it owns ('owns': a list of groups)")
        if type(fresh) is not bool:
            raise RequestError("'fresh' must be true or false")
        with self.lock:
            replaced = self._discard_for(run_id) if fresh and rank == 0 else None
            run = self.run
            if run is not None and run.record["run"] != run_id:
                label = run.record["label"]
                raise RequestError(
                    f"the service holds another run ({label.get('model', '?')} -> {label.get('output_dir', '?')}, "
                    f"step {run.state.committed}); let it finish, or restart the service with --fresh to discard it")
            client.pid = msg.get("pid") if isinstance(msg.get("pid"), int) else 0
            on_gpu = [g for g in run.optimizer.groups if g in run.optimizer.on_gpu] if run is not None else []
            if rank > 0:  # (a run of several: rank 0 attached first)
                if run is None or run.trainer is None or run.world != world:
                    raise RequestError(f"rank {rank} of {world} attached before rank 0 of the same world")
                if rank in run.peers:
                    raise RequestError(f"run {label_of(run)} already has rank {rank} attached (pid "
                                       f"{run.peers[rank].pid})")
                check_owns(run.record, rank, owns)
                client.rank, client.groups = rank, frozenset(g for g in on_gpu if g in owns)
                run.peers[rank] = client
                self.say(f"rank {rank} (pid {client.pid}) attached to run {label_of(run)}")
            else:
                if run is not None and run.trainer is not None:
                    raise RequestError(f"run {label_of(run)} already has a trainer attached (pid {run.trainer.pid});"
                                       " one trainer per run")
                if run is not None and run.error:  # (its update never comes: a trainer would wait for it for good)
                    raise RequestError(f"update {run.state.committed} of run {label_of(run)} failed in the service: "
                                       f"{run.error}; fix the cause and restart the service: it recovers the last "
                                       "committed step")
                if run is not None:
                    check_rejoin(run.record, world, msg)
                if run is None:
                    run = self.run = self._new_run(msg)
                    self.say(f"new run {label_of(run)}: {len(run.specs)} tensors")
                    on_gpu = [g for g in run.optimizer.groups if g in run.optimizer.on_gpu]
                client.groups = frozenset(g for g in on_gpu if world == 1 or g in owns)
                run.trainer, run.peers, run.world = client, {}, world
                run.next_split = None  # (a split told to the trainer before: this one keeps the run's as it is)
                run.store.catalog.on_bump = lambda g, v, r=run: self._tell_all(r, {
                    "ev": "version", "group": g, "version": v, "layout": layout_of(r.store, g)})
                self.say(f"trainer pid {client.pid} attached to run {label_of(run)} at step {run.state.committed}"
                         + (f" (rank 0 of {world})" if world > 1 else ""))
            st, cfg, disk = run.state, self.cfg, shared_disk()
            lost = self.lost if self.lost is not None and self.lost["run"] == run_id and not st.initialized else None
            return {"initialized": st.initialized, "resume": lost, "committed": st.committed, "updated": st.updated,
                    "versions": [[g, run.store.catalog.version(g)] for g in run.optimizer.groups],
                    "layout": layout_of(run.store), "specs": run.record["specs"],
                    "arena": {"name": cfg.store_name(), "dir": cfg.tiers.host_tier.path},
                    DISK_FIELD: shared_description(run.store.tiers.get(disk), cfg.tiers[disk]),
                    "hbm": hbm_of(run.store, cfg.tiers.device_tier, rank) if on_device(run.store) else None,
                    "config": to_plain(cfg), "gpu_share": run.record["gpu_share"], "plan": run.record.get("plan"),
                    "trainer_groups": [g for g in run.optimizer.groups if g in client.groups], "replaced": replaced}

    def _leave(self, client: Client, msg: dict) -> dict:
        """A rank other than 0 is done (its last update is whole): its going away is no loss to the run."""
        run = self._attached(client, msg, any_rank=True)
        if run.trainer is client:
            raise RequestError("rank 0 ends a run with finish (or stop), not leave")
        client.done = True
        return {}

    def _tell_all(self, run: Run, event: dict) -> None:
        for c in run.clients():
            self._tell(c, event)

    def _tell(self, client: Client, event: dict) -> None:
        try:
            client.send(event)
        except OSError:
            pass  # the trainer is gone; it learns the versions again when it attaches

    def _init(self, client: Client, msg: dict) -> dict:
        """The trainer has written the weights (and, resuming from a checkpoint at ``step``, the moments)."""
        run = self._attached(client, msg)
        step = field_of(msg, "step", int)
        if run.state.initialized or step < 0:
            raise RequestError("init of a run already initialized, or at a negative step")
        groups = run.optimizer.groups
        for kind in ("param", "master") + (MOMENTS if step else ()):
            for g in groups:
                run.store.mark_valid(g, kind)
        for g in groups:
            run.store.catalog.bump(g, to=step)
            if run.guard.mirrors is not None:  # (durability: step: the loaded state in HBM, copied to DRAM)
                run.guard.mirrors.write(g, step)
        run.journal.append("init", sync=True, step=step, groups=groups)
        if self.lost is not None and self.lost["run"] == run.record["run"]:
            self.lost = None  # its trainer has loaded the checkpoint (or chose to start over)
        return {}

    def _detach(self, run: Run) -> None:
        """The run's trainer is gone (call with the lock held); of a run of several, the other ranks too (they
        cannot go on without it: their next request is refused)."""
        run.trainer, run.peers = None, {}
        run.store.catalog.on_bump = None
        run.live["phase"] = "no trainer attached"
        self._trainer_left(run)

    def _layout(self, client: Client, msg: dict) -> dict:
        run = self._attached(client, msg, any_rank=True)
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
        live = object_of(msg, "live", {"optimizer": {"split": {}}})
        store = object_of(msg, "store", {"tiers": {registry.primary(DEVICE): {}}, "links": {}, "waits_s": {}})
        problem = run_problem(live, "live") or store_problem(store)  # (kept, they are shown by top and stats)
        if problem is not None:
            raise RequestError(f"bad progress: {problem}")
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
                     + no_room_note(run.optimizer.no_room, run.taken_count))
            self._close_run(keep=False)
        return {}

    def _stop(self, client: Client, msg: dict) -> dict:
        """The trainer stops without committing another step (a step it refused to apply, an error): say
        why; the run stays at its last committed step for a rerun."""
        run = self._attached(client, msg)
        reason = " ".join(field_of(msg, "reason", str)[:400].split())
        self.say(f"trainer pid {client.pid} stopped run {label_of(run)}: {reason}; the run stays at step "
                 f"{run.state.committed}")
        return {"committed": run.state.committed}

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
                    for c in run.clients():
                        try:
                            c.sock.shutdown(socket.SHUT_RDWR)
                        except OSError:
                            pass
                    self.say(f"trainer pid {run.trainer.pid} detached" + (f" (and its {len(run.peers)} other ranks)"
                                                                         if run.peers else ""))
                    self._detach(run)  # what it still owed of the update in flight is the service's to finish
                run.wait()
                self._save_hbm(run)
                self._close_run(keep=True)
                self.say(f"stopped; run {label_of(run)} kept at step {run.state.committed}: "
                         + kept_line(self.cfg, self.config_path, self.socket_path, self.hbm_file()))


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
    say(f"listening on {service.socket_path}; {DURABILITY[service.cfg.durability]}")
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

