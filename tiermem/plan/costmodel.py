"""The cost model: one steady training step, simulated on the machine's figures, per resource.

    p = predict(layout, workload, machine, group_bytes, group_params)
    p.step, p.busy["h2d"], p.bound, p.waits

The step is the schedule of docs/architecture.md, as the trainer and the store run it: the previous step's update
starts when its backward ends (t = 0) and runs group by group in forward order, on the GPU worker (state
streamed to the GPU and back, or updated in place when it lives in HBM) or the CPU worker (state on a storage
tier staged into DRAM one group ahead); the forward of a group waits for its update and for its weights
(streamed through a few GPU slots unless they live in HBM); the loss; the backward with recompute in
reverse order, each group's gradient copied home when the CPU updates it; with several passes the partial
gradients go home and come back between passes. Every operation takes one resource for bytes / rate
seconds: ``gpu`` (the compute stream), ``gpu_adamw`` (the optimizer's stream), the PCIe link each way (``h2d``,
``d2h``), each storage tier's disk (its ``resource``: one resource that reads and writes, each at its rate alone
times the tier's ``both``, the gain of both directions at once: the NVMe tier's are the machine's figures, and the
H200 machine's virtio disk served one direction at a time in the 14B runs, 0.94) and the CPU's AdamW (``cpu``).
Where state lives is told by its tier's role (``tiermem.tiers.base``): the device tier's is computed on in place, a
host tier's crosses the link, a storage tier's its disk first. A resource serves the ready operation that became
ready first (a list schedule). The link's copies run at the machine's ``duplex`` share of its rate alone (both
directions copy through most of a step), and the compute is stretched by ``copy_drag`` of the time both directions
are busy (on the H200 machine: 0.92, and matmuls at 0.94 beside copies both ways; one direction costs them nothing).
Each pass after the first costs the GPU ``pass_cost`` more for every group whose gradient is summed outside HBM
(its partial sums go home and come back): the runs measured that beyond the link's time for those bytes.

Several ranks of a host (``Layout.mine``, ``ranks``): the rank updates the groups it owns, on its GPU and its
share of the host's cores; the peers (their GPUs, links and cores as one of their summed rates) update the rest,
whose new weights this rank's forward still waits for; the disk is the host's one.

The step's time is the later of the last backward's end and the busiest resource's total (a resource busier
than the step delays the next one: steady state). The bound is that resource, or the wait that stretched
the step (the next forward waiting for the update, or for weights).
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass, field

from tiermem.plan.machine import Machine
from tiermem.plan.machine_file import GPU  # (the resource of the GPU's compute, not the tier)
from tiermem.plan.workload import Workload
from tiermem.specs import Group
from tiermem.tiers import registry
from tiermem.tiers.base import DEVICE, HOST, STORAGE

# several ranks of a host: the other ranks' GPUs, links and CPU workers together, which update the groups this rank
# does not own (the disk is one, shared)
PEERS = ("peer_gpu_adamw", "peer_h2d", "peer_d2h", "peer_cpu")
SLOTS = 3
# a step of more passes is simulated as this many and one fewer, and extended: every pass after the first runs
# alike (the same weights fetched, the same partial gradients moved, the same share of the compute), so each
# figure grows by the last simulated pass's share for every pass beyond them. Exact for this model, and a step
# of hundreds of passes (the planner tries them; the compute-bound search meets thousands) simulated whole
# took a good part of a second each
SIM_PASSES = 8


@dataclass
class Layout:
    """What the cost model evaluates: each (group, kind)'s tier, which streamed groups the GPU worker
    updates (groups whose state lives in HBM always are), and the passes a step runs as."""

    where: dict  # (group, kind) -> tier
    gpu_updates: set
    passes: int = 1
    slots: int = SLOTS
    keep: frozenset = frozenset()  # layers whose forward keeps its activations: their backward skips the recompute
    # several ranks of a host (``ranks`` > 1): the groups whose update this rank runs (its GPU worker, its share of
    # the host's cores); the others' run on the peers' (None: every group, one process)
    mine: frozenset | None = None
    ranks: int = 1
    # the boundary activations 0..act_host-1 (layer i's input) live in the host tier: written out over the link as
    # the forward makes them, read back one layer ahead of their layer's backward
    act_host: int = 0
    # a service's durability: step: each update's new state of a group in HBM is copied to DRAM within the step
    write_through: bool = False


def rank_of(owners: dict | None, group_params: dict) -> dict:
    """``Layout``'s ``mine`` and ``ranks`` for a plan of several ranks (``owners``: group -> rank): the rank whose
    groups hold the most parameters to update (the slowest to update its share); {} for one process."""
    ranks = len(set(owners.values())) if owners else 1
    if ranks < 2:
        return {}
    load: dict = {}
    for g, r in owners.items():
        load[r] = load.get(r, 0) + group_params.get(g, 0)
    r = max(sorted(load), key=lambda r: load[r])
    return {"mine": frozenset(g for g, o in owners.items() if o == r), "ranks": ranks}


@dataclass
class Prediction:
    step: float  # seconds
    busy: dict[str, float]  # resource -> seconds busy in a step
    bytes: dict[str, float]  # link -> bytes moved in a step (h2d, d2h, and <disk>_read, <disk>_write of each disk)
    compute: float  # the GPU compute of the step
    wait_optimizer: float  # the compute stream idle, waiting for an update
    wait_transfer: float  # ... waiting for weights or partial gradients
    bound: str
    # seconds the disks (every storage tier's, the NVMe tier's alone by default) spend reading, writing (at once:
    # their busy seconds are the larger); named for the NVMe tier in the plan's JSON
    nvme_read: float = 0.0
    nvme_write: float = 0.0
    details: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"step_seconds": self.step, "busy_seconds": dict(self.busy), "bytes": dict(self.bytes),
                "compute_seconds": self.compute, "wait_optimizer_seconds": self.wait_optimizer,
                "wait_transfer_seconds": self.wait_transfer, "bound": self.bound,
                "nvme_read_seconds": self.nvme_read, "nvme_write_seconds": self.nvme_write}


def resources() -> tuple[str, ...]:
    """The resources a step takes: the GPU's compute and its optimizer's stream, the PCIe link each way (every
    host tier's: the link is one), each storage tier's disk (its ``resource``), and the CPU's AdamW."""
    disks = dict.fromkeys(registry.tier_type(t).resource for t in registry.of_role(STORAGE))
    return (GPU, "gpu_adamw", "h2d", "d2h", *disks, "cpu")


class _Sim:
    """Operations on resources with dependencies; ``run`` list-schedules them."""

    def __init__(self, resources: tuple[str, ...]):
        self.resources = resources + PEERS
        self.ops: list[tuple[str, float, list[int], str]] = []  # (resource, seconds, deps, tag)

    def op(self, resource: str, seconds: float, deps=(), tag: str = "") -> int:
        self.ops.append((resource, max(seconds, 0.0), [d for d in deps if d is not None], tag))
        return len(self.ops) - 1

    def run(self) -> tuple[list[float], list[float], dict[str, float]]:
        n = len(self.ops)
        start, end = [0.0] * n, [0.0] * n
        waiting = [len(d) for _, _, d, _ in self.ops]
        users: list[list[int]] = [[] for _ in range(n)]
        for i, (_, _, deps, _) in enumerate(self.ops):
            for d in deps:
                users[d].append(i)
        ready_at = [0.0] * n
        free = dict.fromkeys(self.resources, 0.0)
        busy = dict.fromkeys(self.resources, 0.0)
        queues: dict[str, list] = {r: [] for r in self.resources}
        for i in range(n):
            if not waiting[i]:
                heapq.heappush(queues[self.ops[i][0]], (0.0, i))
        done = 0
        while done < n:
            # the resource whose next operation starts first runs it
            best = None
            for r, q in queues.items():
                if q:
                    t = max(free[r], q[0][0])
                    if best is None or t < best[0]:
                        best = (t, r)
            if best is None:
                raise RuntimeError("cost model: a dependency cycle")
            t, r = best
            _, i = heapq.heappop(queues[r])
            start[i] = t
            end[i] = t + self.ops[i][1]
            free[r] = end[i]
            busy[r] += self.ops[i][1]
            done += 1
            for u in users[i]:
                ready_at[u] = max(ready_at[u], end[i])
                waiting[u] -= 1
                if not waiting[u]:
                    heapq.heappush(queues[self.ops[u][0]], (ready_at[u], u))
        return start, end, busy


def predict(layout: Layout, w: Workload, m: Machine, group_bytes: dict, group_params: dict) -> Prediction:
    """The steady step of ``layout`` (see the module's docstring)."""
    p = max(1, layout.passes)
    if p <= SIM_PASSES:
        return _simulate(layout, w, m, group_bytes, group_params)

    def sim(n: int) -> Prediction:
        wn = w.scaled(w.tokens * n / p, max(1, round(w.micro_batches * n / p)))
        return _simulate(dataclasses.replace(layout, passes=n), wn, m, group_bytes, group_params)

    a, b = sim(SIM_PASSES - 1), sim(SIM_PASSES)
    more = p - SIM_PASSES
    ext = lambda x, y: y + more * (y - x)  # noqa: E731
    busy = {r: ext(a.busy[r], b.busy[r]) for r in b.busy}
    step = ext(a.step, b.step)
    wait_opt, wait_xfer = ext(a.wait_optimizer, b.wait_optimizer), ext(a.wait_transfer, b.wait_transfer)
    return Prediction(step, busy, {k: ext(a.bytes[k], b.bytes[k]) for k in b.bytes}, ext(a.compute, b.compute),
                      wait_opt, wait_xfer, _bound(step, busy, wait_opt, wait_xfer), ext(a.nvme_read, b.nvme_read),
                      ext(a.nvme_write, b.nvme_write), {"finish": ext(a.details["finish"], b.details["finish"])})


def _simulate(layout: Layout, w: Workload, m: Machine, group_bytes: dict, group_params: dict) -> Prediction:
    """The step of ``layout`` simulated pass by pass: the update of the step before, then the step's forward, loss
    and backward (``_Step``), list-scheduled on the resources."""
    step = _Step(layout, w, m, group_bytes, group_params)
    step.update()
    step.passes()
    return step.result()


class _Step:
    """The operations of one steady step. Where a (group, kind) lives decides what reaching it costs: on the
    device tier nothing (it is computed on in place), on a host tier the PCIe link, on a storage tier its disk
    (its ``resource``, at its ``rates``) and then the link, or (the CPU worker) its disk into the host tier that
    stages it."""

    def __init__(self, layout: Layout, w: Workload, m: Machine, group_bytes: dict, group_params: dict):
        self.layout, self.w, self.m, self.group_bytes, self.group_params = layout, w, m, group_bytes, group_params
        self.where = where = layout.where
        self.kinds = {t: registry.tier_type(t) for t in set(where.values())}
        self.roles = {t: cls.role for t, cls in self.kinds.items()}
        self.rates = {t: cls.rates(m) for t, cls in self.kinds.items() if cls.role == STORAGE}
        self.resources = resources()
        disks = [r for r in self.resources if r not in (GPU, "gpu_adamw", "h2d", "d2h", "cpu")]
        self.sim = _Sim(self.resources)
        self.moved = {"h2d": 0.0, "d2h": 0.0, **{f"{r}_{d}": 0.0 for r in disks for d in ("read", "write")}}
        self.disk = {"read": 0.0, "write": 0.0}
        self.ranks = max(1, layout.ranks)
        self.peers = self.ranks - 1
        groups = w.groups
        self.has_master = any(k == "master" for (_, k) in group_bytes)
        self.state_kinds = ["master" if self.has_master else "param", "exp_avg", "exp_avg_sq"]
        resident = {g for g in groups
                    if all(self.role(g, k) == DEVICE for k in (*self.state_kinds, "grad") if (g, k) in group_bytes)}
        self.on_gpu = resident | (set(layout.gpu_updates or ()) & set(groups))
        self.mine = set(groups) if layout.mine is None or self.ranks == 1 else set(layout.mine)
        self.done: dict[Group, int] = {}  # group -> the op after which its new compute copy is home
        self.offered: set = set()  # groups whose new compute copy the GPU worker offers on the GPU
        self.compute_ops: list[tuple[int, Group, int | None]] = []  # (op, group, the update it waits on)
        self.last_compute = None
        self.last_grad: list = []

    def role(self, g, k):
        return self.roles.get(self.where.get((g, k)))

    def nbytes(self, g, k):
        return self.group_bytes.get((g, k), 0)

    def h2d(self, n, deps=(), tag="", peer=False):
        m = self.m
        if peer:  # (the owner's link: the peers' links together)
            return self.sim.op("peer_h2d", n / (m.h2d * m.duplex * self.peers), deps, tag)
        self.moved["h2d"] += n
        return self.sim.op("h2d", n / (m.h2d * m.duplex), deps, tag)

    def d2h(self, n, deps=(), tag="", peer=False):
        m = self.m
        if peer:
            return self.sim.op("peer_d2h", n / (m.d2h * m.duplex * self.peers), deps, tag)
        self.moved["d2h"] += n
        return self.sim.op("d2h", n / (m.d2h * m.duplex), deps, tag)

    def storage(self, g, k, write: bool, deps=(), tag=""):
        """The disk of the storage tier (g, k) lives on reads or writes its bytes."""
        t = self.where[(g, k)]
        r, res, n = self.rates[t], self.kinds[t].resource, self.nbytes(g, k)
        self.moved[f"{res}_{'write' if write else 'read'}"] += n
        s = n / ((r.write if write else r.read) * r.both)
        self.disk["write" if write else "read"] += s
        return self.sim.op(res, s, deps, tag)

    def update(self) -> None:
        """The update of the step before (starts at t = 0, when that step's backward ended), group by group."""
        role, nbytes, h2d, d2h, storage = self.role, self.nbytes, self.h2d, self.d2h, self.storage
        m, sim, has_master, state_kinds = self.m, self.sim, self.has_master, self.state_kinds
        done, offered, on_gpu, peers, ranks = self.done, self.offered, self.on_gpu, self.peers, self.ranks
        # (a worker's last two GPU updates, three groups in flight; its last CPU update and the one before): this
        # rank's, and the peers' for the groups it does not own
        gpu_prev = {True: [None, None], False: [None, None]}
        cpu_prev = {True: [None, None], False: [None, None]}
        for g in self.w.groups:
            params = self.group_params.get(g, 0)
            own = g in self.mine
            peer = not own
            if g in on_gpu:
                prev2, prev = gpu_prev[own]
                reads = []
                for k in state_kinds:
                    if role(g, k) == STORAGE:
                        reads.append(h2d(nbytes(g, k), [storage(g, k, False, [prev2])], peer=peer))
                    elif role(g, k) == HOST:
                        reads.append(h2d(nbytes(g, k), [prev2], peer=peer))
                if role(g, "grad") not in (DEVICE, None) and g not in on_gpu:
                    reads.append(h2d(nbytes(g, "grad"), peer=peer))
                rate = m.gpu_adamw * (1 if own else peers)
                adam = sim.op("gpu_adamw" if own else "peer_gpu_adamw", params / rate, [*reads, prev], f"adam {g}")
                for k in state_kinds:
                    if role(g, k) in (HOST, STORAGE) and not (k == "param" and has_master):
                        back = d2h(nbytes(g, k), [adam], peer=peer)
                        if role(g, k) == STORAGE:
                            storage(g, k, True, [back])
                if has_master and role(g, "param") != DEVICE:
                    done[g] = d2h(nbytes(g, "param"), [adam], f"param home {g}", peer=peer)
                    if own:  # (a peer's new compute copy reaches this rank through the arena, fetched as ever)
                        offered.add(g)
                    if role(g, "param") == STORAGE:
                        storage(g, "param", True, [done[g]])
                else:
                    done[g] = adam
                if self.layout.write_through:  # (the copies to DRAM hold no forward: the link's time only)
                    for k in {*state_kinds, "param"}:
                        if role(g, k) == DEVICE:
                            d2h(nbytes(g, k), [adam], f"write-through {g}", peer=peer)
                gpu_prev[own] = [prev, adam]
            else:
                stage_prev, prev = cpu_prev[own]
                stage = [storage(g, k, False, [stage_prev]) for k in (*state_kinds, "grad", "param")
                         if role(g, k) == STORAGE]
                # (at the worker's rates beside the link's copies, which the step runs alongside; several ranks
                # split the host's cores: this rank's worker has a share, the peers' together the rest)
                share = 1.0 / ranks if own else peers / ranks
                seconds = (params / m.cpu_adamw + (params / m.cpu_copy if has_master else 0.0)) / m.cpu_in_run / share
                upd = sim.op("cpu" if own else "peer_cpu", seconds, [*stage, prev], f"cpu adam {g}")
                cpu_prev[own] = [prev, upd]
                for k in state_kinds:
                    if role(g, k) == STORAGE:
                        storage(g, k, True, [upd])
                if role(g, "param") == DEVICE:
                    done[g] = h2d(nbytes(g, "param"), [upd], peer=peer)
                elif role(g, "param") == STORAGE and has_master:
                    done[g] = storage(g, "param", True, [upd])
                else:
                    done[g] = upd

    def passes(self) -> None:
        """The step: forward, loss, backward, per pass."""
        layout, w, role, nbytes, h2d, d2h = self.layout, self.w, self.role, self.nbytes, self.h2d, self.d2h
        done, offered = self.done, self.offered
        p = max(1, layout.passes)
        slot_free: list = []  # compute ops whose end frees a slot, in order
        partial_home: dict[Group, int] = {}
        index = {g: j for j, g in enumerate(w.layers)}  # (layer j's input is boundary j; its output j + 1)
        one = w.layer_boundary_bytes(p) if layout.act_host else 0
        act_out: dict[int, int] = {}  # boundary -> the op writing it out
        bwd_ops: list = []  # the backward's compute ops, in order

        def fetch(g, deps):
            """The group's weights on the GPU: a slot filled over PCIe (or on the GPU from an offer)."""
            if role(g, "param") == DEVICE:
                return None
            slot = slot_free[-layout.slots] if layout.slots and len(slot_free) >= layout.slots else None
            return h2d(nbytes(g, "param"), [*deps, slot], f"fetch {g}")

        for n in range(p):
            first, last_pass = n == 0, n == p - 1
            seq = [*((g, "fwd") for g in [w.first, *w.layers]), (w.last, "loss"),
                   *((g, "bwd") for g in reversed(w.layers)), (w.first, "embed_bwd")]
            for g, phase in seq:
                upd = done.get(g) if first and phase in ("fwd", "loss") else None
                tied_upd = done.get(w.first) if first and phase == "loss" and w.tied else None
                if phase == "embed_bwd":
                    f = None
                elif first and phase == "fwd" and g in offered:
                    f = None  # the GPU worker offered the new compute copy: copied on the GPU
                else:
                    f = fetch(g, [upd])
                back = None  # (the layer's input read back, one layer ahead: after the backward before last)
                if phase == "bwd" and index[g] < layout.act_host:
                    back = h2d(one, [act_out.get(index[g]), bwd_ops[-2] if len(bwd_ops) > 1 else None],
                               f"activation {index[g]}")
                partial = None
                own = g in self.mine  # (several ranks: a layer's gradient goes to its owner, which keeps the sums)
                if not first and phase in ("bwd", "loss", "embed_bwd") and role(g, "grad") != DEVICE:
                    partial = h2d(nbytes(g, "grad"), [partial_home.get(g)], f"partial {g}", peer=not own)
                bwd = w.bwd.get(g, 0.0) - (w.fwd.get(g, 0.0) * w.kept_saves if g in layout.keep else 0.0)  # (the
                # recompute a kept layer skips)
                seconds = (w.fwd.get(g, 0.0) if phase in ("fwd",) else max(bwd, 0.0)
                           if phase != "loss" else w.fwd.get(g, 0.0) + w.bwd.get(g, 0.0)) / p
                if partial is not None and own:  # (a later pass of a group summed outside HBM: its cost beyond the
                    seconds += self.m.pass_cost  # link's time, measured as the GPU's: Machine.pass_cost)
                # (a peer's partial sums are its own to add)
                c = self.sim.op(GPU, seconds, [self.last_compute, upd, tied_upd, f, partial if own else None,
                                               back], f"{phase} {g}")
                made = 0 if g == w.first and phase == "fwd" else index[g] + 1 if phase == "fwd" else None
                if made is not None and made < layout.act_host:  # (a boundary made: written out)
                    act_out[made] = d2h(one, [c], f"activation {made} out")
                if phase == "bwd":
                    bwd_ops.append(c)
                self.compute_ops.append((c, g, upd if upd is not None else tied_upd))
                self.last_compute = c
                if f is not None:
                    slot_free.append(c)
                if phase in ("bwd", "loss", "embed_bwd") and role(g, "grad") != DEVICE:
                    if last_pass and g not in self.on_gpu:
                        self.last_grad.append(d2h(nbytes(g, "grad"), [c], f"grad {g}", peer=not own))
                    elif not last_pass:
                        partial_home[g] = d2h(nbytes(g, "grad"), [c], f"partial home {g}", peer=not own)

    def result(self) -> Prediction:
        """The schedule run: the step's time, each resource's busy time, the waits and the bound."""
        start, end, busy = self.sim.run()
        drag = self.m.copy_drag * min(busy["h2d"], busy["d2h"])  # (the compute beside copies both ways)
        busy[GPU] += drag
        finish = max([end[self.last_compute] + drag, *(end[i] for i in self.last_grad)])
        compute = busy[GPU]
        wait_opt = wait_xfer = 0.0
        prev_end = 0.0
        for c, _g, upd in self.compute_ops:
            idle = start[c] - prev_end
            if idle > 1e-12:
                # the wait until the update ended is the update's (a fetch of its new weights starts there), the
                # rest the transfer's
                on_update = min(max(end[upd] - prev_end, 0.0), idle) if upd is not None else 0.0
                wait_opt += on_update
                wait_xfer += idle - on_update
            prev_end = end[c]
        totals = dict(busy)
        # the GPU's two streams share it: the compute and the optimizer's kernels add up
        # (the peers' resources too: a peer busier than the step delays the next one as well)
        peer_busy = [totals.pop(r) for r in PEERS]
        step = max(finish, *(totals[r] for r in self.resources if r not in (GPU, "gpu_adamw")),
                   totals[GPU] + totals["gpu_adamw"], *peer_busy)
        bound = _bound(step, totals, wait_opt, wait_xfer)
        return Prediction(step, totals, self.moved, compute, wait_opt, wait_xfer, bound, self.disk["read"],
                          self.disk["write"], {"finish": finish})


NAMES = {GPU: "GPU compute", "gpu_adamw": "GPU AdamW", "h2d": "PCIe to the GPU", "d2h": "PCIe from the GPU",
         "cpu": "CPU AdamW"}


def _bound(step: float, busy: dict, wait_opt: float, wait_xfer: float) -> str:
    top = max(busy, key=lambda r: busy[r])
    if busy[GPU] + busy["gpu_adamw"] >= 0.9 * step:  # the GPU: its compute (and its share of the update)
        return GPU
    if busy[top] >= 0.9 * step:
        return top
    return "wait_optimizer" if wait_opt >= wait_xfer else "wait_transfer"


def describe_bound(bound: str) -> str:
    disks = {registry.tier_type(t).resource: registry.tier_type(t).label for t in registry.of_role(STORAGE)}
    return {**NAMES, **disks, "wait_optimizer": "the next forward waiting for the update",
            "wait_transfer": "the compute waiting for weights"}.get(bound, bound)
