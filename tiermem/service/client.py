"""A trainer's side of the service: attach, a store over the service's memory, and the optimizer as a
stand-in that commits steps to the service (and updates the groups the service leaves to this
process's GPU worker).

    attached = attach(socket_path, run_id, label, specs, optim)
    attached.store        # a Store over the service's arena and NVMe file, with this process's GPU slots
    attached.optimizer    # step(n, lr, grad_scale) waits for the gradients to be home, then commits n
    attached.committed    # the service's last committed step: where training continues

A reader thread takes the service's replies and its pushed events: each group's new version is applied
to the local catalog, so the prefetcher waits for updates exactly as in an embedded run.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from tiermem.config import load_store_config
from tiermem.errors import UserError
from tiermem.faults import HOOKS
from tiermem.futures import done_future
from tiermem.optim import Gate, OptimSettings
from tiermem.plan.resolve import compute_device
from tiermem.service import protocol
from tiermem.service.config import DISK_FIELD
from tiermem.specs import Group, TensorSpec
from tiermem.store.layout import apply_layout, attach_store, spec_from_json, spec_to_json
from tiermem.tiers import registry
from tiermem.tiers.base import DEVICE
from tiermem.tiers.extents import Extent
from tiermem.tiers.hbm_parts import part_of


class ServiceLost(UserError):
    """The service went away (killed, stopped, restarted) while the trainer was attached."""

    exit_code = 1


class ServiceSilent(ServiceLost):
    """The service said nothing for the client's timeout: it is stopped (SIGSTOP, a debugger) or stuck."""

    exit_code = 2


class ServiceClient:
    def __init__(self, path, timeout: float | None = None):
        """A connection to the service at ``path``; ``timeout``: seconds of silence from it after which every wait
        on it ends with one line (protocol.service_timeout: TIERMEM_SERVICE_TIMEOUT, default 30)."""
        self.path = path
        self.timeout = protocol.service_timeout(timeout)
        self.silent = False
        self.sock = protocol.connect(path)
        self.sock.settimeout(self.timeout)  # (a live service pulses every second, busy or not)
        self._lock = threading.Lock()
        self._replies: queue.Queue = queue.Queue()
        self._id = 0
        self.catalog = None
        self._early: list = []  # (layout, group, version) events pushed before the catalog existed
        self._bind_lock = threading.Lock()
        self.lost = False
        self.error: str | None = None
        self.on_version = None
        self._reader = threading.Thread(target=self._read, name="tiermem-client", daemon=True)
        self._reader.start()

    def request(self, op: str, **fields) -> dict:
        with self._lock:
            if self.lost:
                raise self._lost()
            self._id += 1
            try:
                protocol.send(self.sock, {"op": op, "id": self._id, **fields})
            except TimeoutError:  # (its receive buffer full: it does not read)
                self.silent = True
                raise self._lost() from None
            except OSError:
                raise self._lost() from None
            reply = self._replies.get()
        if reply is None:
            raise self._lost()
        if not reply.get("ok"):
            raise UserError(f"the tiermem service refused {op}: {reply.get('error')}")
        return reply

    def _lost(self) -> ServiceLost:
        if self.silent:
            return ServiceSilent(f"the tiermem service at {self.path} does not answer: nothing from it in "
                                 f"{self.timeout:g} s (is it stopped, by SIGSTOP or a debugger, or stuck?); "
                                 "TIERMEM_SERVICE_TIMEOUT sets how long to wait")
        return ServiceLost(f"lost the tiermem service at {self.path}; start it again (`tiermem serve` with the "
                           "same config) and rerun this command: training continues from the last committed step")

    def _read(self) -> None:
        while True:
            try:
                msg = protocol.recv(self.sock)
            except TimeoutError:
                self.silent, msg = True, None
            except (OSError, protocol.ProtocolError):
                msg = None
            if msg is None:
                self.lost = True
                self._replies.put(None)
                if self.catalog is not None:  # wake anyone waiting on a version
                    for g in self.catalog.groups():
                        self.catalog.bump(g, to=self.catalog.version(g))
                return
            if "ev" not in msg:
                self._replies.put(msg)
            elif msg["ev"] == "version":
                self._version(msg.get("layout") or {}, msg["group"], int(msg["version"]))
            elif msg["ev"] == "failed":
                self.error = str(msg.get("error"))

    def _version(self, layout: dict, g: Group, v: int) -> None:
        """A group's new version, and where its tensors live now (an out-of-place update moved them)."""
        with self._bind_lock:
            cat = self.catalog
            if cat is None:
                self._early.append((layout, g, v))
                return
            apply_layout(cat, layout)
            if v > cat.version(g):
                cat.bump(g, to=v)
        if self.on_version is not None:
            self.on_version(g, v)

    def bind(self, catalog, versions) -> None:
        """Follow the service's versions in ``catalog`` from now on (pairs [group, version] to start); the
        events that arrived before are applied in their order, over the layout the catalog was built from."""
        with self._bind_lock:
            for g, v in versions:
                if int(v) > catalog.version(g):
                    catalog.bump(g, to=int(v))
            for layout, g, v in self._early:
                apply_layout(catalog, layout)
                if v > catalog.version(g):
                    catalog.bump(g, to=v)
            self._early = []
            self.catalog = catalog

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class RemoteGuard:
    """The crash-safety hooks of the trainer's own GPU worker: the service allocates the places an
    update is written to out of place and, on ``flip``, journals them and makes them the homes."""

    def __init__(self, client: ServiceClient, store, run_id: str):
        self.client, self.store, self.run = client, store, run_id

    def allocate(self, g: Group, step: int, names: list[str]) -> dict[str, Extent] | None:
        """Places for the group's new state; None when the service found no room and updates it itself."""
        return self.places(g, names, self.client.request("alloc", run=self.run, step=step, group=g)["places"])

    def flip(self, g: Group, step: int, new: dict[str, Extent], ahead: tuple | None = None) -> dict | None:
        """Journal group g's new places and make them its homes; with ``ahead`` ((group, names)), then
        ``allocate`` that group, in the same round trip: its places (None: no room)."""
        HOOKS.point("update", step, g)  # test hook: the new state is written, not yet journaled
        reply = self.client.request("flip", run=self.run, step=step, group=g,
                                    places={name: [ext.offset, ext.nbytes] for name, ext in new.items()},
                                    **({"next": ahead[0]} if ahead is not None else {}))
        for name, ext in new.items():
            self.store.switch(name, ext, free=False)
        return self.places(ahead[0], ahead[1], reply["places"]) if ahead is not None else None

    @staticmethod
    def places(g: Group, names: list[str], places: dict | None) -> dict[str, Extent] | None:
        if places is None:
            return None
        if set(places) != set(names):
            raise RuntimeError(f"the service allocated places for other tensors of group {g!r}")
        return {name: Extent(int(off), int(n)) for name, (off, n) in places.items()}


class RemoteOptimizer:
    """What the executor and the saver call an optimizer, when the service owns the optimizer state.

    A commit makes a step the service's to finish. The service's CPU AdamW updates its share of the
    groups; the rest (``local``: the trainer's own GPU worker, as in an embedded run) are updated here,
    on the GPU that made their gradients, written out of place to places the service allocates and
    journaled through it; if this trainer dies first, the service updates them itself."""

    def __init__(self, client: ServiceClient, store, groups: list[Group], run_id: str, committed: int,
                 local=None, gpu_share: float = 0.0):
        self.client, self.store, self.groups, self.run = client, store, list(groups), run_id
        self.committed, self.local, self.gpu_share = committed, local, gpu_share
        self.mine = set(local.on_gpu) if local is not None else set()
        self._split_next = False  # the service split the updates again: this process's GPU worker takes ``mine``
        self.notes: list[str] = []  # lines for the trainer to print (``take_notes``)
        self.gate: Gate | None = None  # a checkpoint saver's: commits wait until it has read the state
        self.last_step_seconds = 0.0
        self.last_split: dict = {}
        self.moved = False  # the last commit's re-placement moved optimizer state
        self._t_commit = 0.0
        client.on_version = self._on_version

    def set_gate(self, gate: Gate | None) -> None:
        """Commits wait until ``gate`` lets each group's update go (a checkpoint saver's)."""
        self.gate = gate

    def set_part_gate(self, gate: Gate | None) -> None:
        """Not of one trainer: it saves the whole checkpoint (a rank of several: ``RankRemoteOptimizer``)."""
        raise UserError("a checkpoint part is written by a rank of several; one trainer saves the whole checkpoint")

    def expect_save(self, step: int) -> None:
        """Nothing to hold: the commit of update ``step + 1`` waits for this process's saver (``set_gate``)."""

    def wait_all(self, step: int) -> None:
        """Until every group holds update ``step`` (the versions come from the service)."""
        self.wait()

    def resplit(self, on_gpu) -> None:
        """Not with a service: the service splits each committed update between itself and the trainers."""
        raise UserError("splitting an attached run's updates again is not supported yet: the service splits them")

    def refresh_layout(self) -> None:
        """Take the service's current places for every tensor (a commit's re-placement moved optimizer state)."""
        apply_layout(self.store.catalog, self.client.request("layout", run=self.run)["layout"])

    def _on_version(self, g: Group, v: int) -> None:
        if g == self.groups[-1] and v == self.committed and self._t_commit:
            self.last_step_seconds = time.perf_counter() - self._t_commit  # commit to the last group's version
            self.last_split = {}
            if self.local is not None and self.local.last_split:
                self.last_split = {f"trainer_{k}": v for k, v in self.local.last_split.items() if v}

    def grads_on_gpu(self, g: Group) -> bool:
        """Offered on the GPU to this process's GPU worker, unless the gradient's home is in the service's HBM: the
        step then sums it there (as an embedded run sums a group living in HBM) and the worker reads it from home."""
        return g in self.mine and not self.store.in_device_memory(g, "grad")

    def grads_home(self, g: Group) -> bool:
        return True  # all of them: the service redoes a dead trainer's update from the gradients at home

    def check(self) -> None:
        if self.client.error:
            raise RuntimeError(f"the service's optimizer failed: {self.client.error}")
        if self.client.lost:
            raise self.client._lost()
        if self.local is not None:
            if isinstance(self.local.failure, UserError):  # the service refused: its one line says why
                raise self.local.failure
            self.local.check()

    def step(self, step: int, lr: float, grad_scale: float | None = None):
        """Commit ``step``: once every gradient is home, the service journals it and updates its groups;
        this process's GPU worker updates the others."""
        self.check()
        self.store.flush("grad")  # home before the GPU worker unscales its copies in place
        HOOKS.point("commit", step)
        if self.gate is not None:
            for g in self.groups:
                self.gate(g, step)
        self._t_commit = time.perf_counter()
        if self._split_next:  # (told with the last commit's reply; this step's backward kept to it)
            self.local.resplit(self.mine)
            self._split_next = False
        # the places of the first groups this process's GPU worker writes out of place come with the reply: the
        # update's start, which the next forward waits for, makes no round trip of its own
        first = self.local.first_out_of_place(self.mine) if self.local is not None and self.mine else []
        reply = self.client.request("commit", run=self.run, step=step, lr=lr, grad_scale=grad_scale,
                                    **({"grant": first} if first else {}))
        self.moved = bool(reply.get("layout"))
        if self.moved:  # re-placement moved optimizer state before this update
            apply_layout(self.store.catalog, reply["layout"])
        self.committed = step
        HOOKS.point("optimizer", step)
        if first:
            guard = self.local.guard
            self.local.grant_ahead(step, {g: guard.places(g, self.local.state_names(g), p)
                                          for g, p in zip(first, reply["places"])})
        mine = set(self.mine)
        if reply.get("next_split") is not None and self.local is not None:
            # the service measured its CPU worker and split the updates again, from the next one on: the next
            # backward keeps those groups' gradients on this GPU (``grads_on_gpu``)
            self.mine, self._split_next = set(reply["next_split"]), True
            self.notes.append(f"plan: the service measured its CPU worker and split the updates again: from update "
                              f"{step + 1} this trainer's GPU updates {len(self.mine)} of {len(self.groups)} groups, "
                              "the service the others")
        if mine:
            return self.local.step(step, lr, grad_scale, only=mine)
        return done_future()

    def take_notes(self) -> list[str]:
        """The lines for the trainer to print since the last call (a split of the updates found again)."""
        out, self.notes = self.notes, []
        return out

    def wait(self) -> None:
        """Until every group holds the last committed update."""
        if self.local is not None:
            self.local.wait()
        cat = self.store.catalog
        while True:
            self.check()
            if all(cat.version(g) >= self.committed for g in self.groups):
                return
            seen = cat.bump_count()
            if all(cat.version(g) >= self.committed for g in self.groups):
                return
            cat.wait_any_bump(seen, timeout=0.5)

    def close(self) -> None:
        if self.local is not None:
            self.local.close()


@dataclass
class Attached:
    client: ServiceClient
    store: object
    optimizer: RemoteOptimizer
    run: str
    initialized: bool
    committed: int
    resume: dict | None = None  # the service lost this run's state: {checkpoint, step} to resume from
    plan: dict | None = None  # the service's plan of the run (tiermem.service.planning), when it planned it
    replaced: int | None = None  # asked to start afresh: the step of this run's state the service discarded
    remote: set = field(default_factory=set)  # several ranks: names in the other ranks' HBM (not in this store)
    own_hbm: set = field(default_factory=set)  # ... and in this rank's (it loads them, writes its checkpoint part)

    def request(self, op: str, **fields) -> dict:
        return self.client.request(op, run=self.run, **fields)

    def refresh_layout(self) -> None:
        """Take the service's current places for every tensor (re-placement moves optimizer state)."""
        apply_layout(self.store.catalog, self.request("layout")["layout"])

    def leave(self) -> None:
        """A rank other than 0 is done (its share of the last update is whole)."""
        if not self.client.lost:
            self.request("leave")

    def progress(self, snap: dict) -> None:
        if not self.client.lost:
            self.request("progress", live=snap.get("run", {}), store=snap.get("store", {}))

    def close(self) -> None:
        self.client.close()
        self.store.close()


def attach(path, run_id: str, label: dict, specs: list[TensorSpec], optim: OptimSettings,
           plan: dict | None = None, rank: int = 0, world: int = 1, owns: list | None = None,
           local_rank: int = 0, optimizer_type: type | None = None, fresh: bool = False,
           owners: dict | None = None) -> Attached:
    """Attach to the service at ``path`` for run ``run_id`` (created there if the service holds no run; with
    ``plan``, {workload, hbm_room, keep}, the service plans it). A rank of several (``rank`` of ``world``, rank 0
    first) says which groups it ``owns``: of each update's groups the service leaves to the trainers' GPU
    workers, it takes those; rank 0 says every group's owner (``owners``): the service keeps a group's state in HBM
    on its owner's GPU, and each rank maps its own part (its store leaves the others' out: ``Attached.remote``).
    ``fresh`` (overwrite_output_dir): a run the service holds for this run id, with no trainer attached, is
    discarded and this one starts anew (``Attached.replaced``: the step it was at).

    The trainer computes on the service config's device tier's ``device`` (the CPU when there is no CUDA); a rank of
    several on CUDA, on ``cuda:local_rank``."""
    client = ServiceClient(path)
    try:
        reply = client.request("hello", run=run_id, label=label, specs=[spec_to_json(s) for s in specs],
                               optim=optim.to_json(), pid=os.getpid(), rank=rank, world=world,
                               **({"owns": list(owns)} if owns is not None else {}),
                               **({"owners": [[g, r] for g, r in owners.items()]} if owners is not None else {}),
                               **({"plan": plan} if plan is not None else {}),
                               **({"fresh": True} if fresh else {}))
        cfg = load_store_config(reply["config"], "the service's config")
        device = compute_device(cfg)
        if world > 1 and device.type == "cuda":
            device = torch.device("cuda", local_rank)
        theirs = [spec_from_json(s) for s in reply["specs"]]
        if {s.name: s for s in theirs} != {s.name: s for s in specs}:
            raise UserError("the service's run holds other tensors than this model's; restart the service with "
                            "--fresh to discard its run")
        remote = other_parts(reply["layout"], rank) if world > 1 else set()
        store = attach_store(cfg, [s for s in theirs if s.name not in remote], reply["layout"], reply["arena"],
                             reply[DISK_FIELD], device, cfg.tiers.device_tier.slots, device_desc=reply.get("hbm"))
    except BaseException:
        client.close()
        raise
    client.bind(store.catalog, reply["versions"])
    local = None
    mine = reply.get("trainer_groups") or []
    if mine:
        # the service said which groups this trainer's GPU updates; one it finds no room for, it takes itself
        local = optim.optimizer(store, on_gpu=mine, guard=RemoteGuard(client, store, run_id), cpu_takes_over=False)
    opt = (optimizer_type or RemoteOptimizer)(client, store, optim.groups, run_id, reply["committed"], local,
                                              float(reply.get("gpu_share", 0.0)))
    own = {n for n, (t, _, _) in reply["layout"].items() if t == registry.primary(DEVICE) and n not in remote}
    return Attached(client, store, opt, run_id, reply["initialized"], reply["committed"], reply.get("resume"),
                    reply.get("plan"), reply.get("replaced"), remote, own if world > 1 else set())


def other_parts(layout: dict, rank: int) -> set:
    """The names of the tensors other ranks keep in their part of the service's HBM (``tiermem.tiers.hbm_parts``):
    this rank's store leaves them out, as an embedded rank's does."""
    dev = registry.primary(DEVICE)
    return {n for n, (t, offset, _) in layout.items() if t == dev and part_of(int(offset)) != rank}
