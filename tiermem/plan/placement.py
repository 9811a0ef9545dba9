"""Placement: which tier holds each (group, kind), checked against the tier budgets before anything is
allocated.

A training run's placement comes from the cost model's planner (``tiermem.plan.planner``), which fills
this module's ``Plan`` with its decisions. Without a workload to plan for (a service's store, a store
opened by hand) the rule here places: a mapping pins kinds to tiers for every group (kinds not named stay
in DRAM); ``auto`` puts small shared groups (embeddings, final norm, LM head: groups named by a string)
wholly on the GPU when they fit; everything else goes to DRAM, hottest
kind first (param, grad, master, exp_avg, exp_avg_sq); what does not fit spills to NVMe, coldest kinds
of the last layers first. The GPU also holds ``slots`` streaming slots sized from the largest group.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from tiermem.config import StoreConfig
from tiermem.errors import BudgetError
from tiermem.plan.hostmem import available_memory
from tiermem.plan.resolve import compute_device
from tiermem.sizes import align_up, format_size
from tiermem.specs import KINDS, Group, TensorSpec
from tiermem.tiers import registry
from tiermem.tiers.base import DEVICE, HOST, STORAGE

ALIGN = 4096
HOT_FIRST = KINDS  # param, grad, master, exp_avg, exp_avg_sq


@dataclass
class Plan:
    where: dict[tuple[Group, str], str]
    group_bytes: dict[tuple[Group, str], int]
    slot_bytes: int
    n_slots: int
    staging_bytes: int
    budgets: dict[str, int | None] = field(default_factory=dict)
    # what the cost model's planner (tiermem.plan.planner) decided besides the tiers; None/1 for a fixed rule
    gpu_updates: set | None = None  # the groups the GPU updates (the rest: CPU AdamW)
    passes: int = 1  # layer-major passes a step runs as
    activation_budget: int | None = None  # boundary-activation bytes a pass may keep (None: any)
    activation_bytes: int = 0  # HBM the planner keeps for activations
    keep: frozenset = frozenset()  # layers whose activations a step keeps (tiermem_keep_activations): no recompute
    hbm_room: int = 0  # HBM for state, slots and activations together
    prediction: object = None  # costmodel.Prediction of a step
    machine: object = None  # machine.Machine it planned on
    workload: object = None  # workload.Workload it planned for
    params: dict = field(default_factory=dict)  # group -> parameters
    # several ranks of a host: group -> the rank whose GPU holds the group's HBM-resident state (its owner); every
    # rank has its own HBM, with its own streaming slots (None: one GPU holds all of it)
    owners: dict | None = None
    # the rows of a micro-batch, and the rows the GPU computes at once (tiermem_physical_batch_size: a micro-batch
    # of more rows runs as pieces of this many; the workload's micro-batches are the pieces). 0: not planned
    micro_rows: int = 0
    piece_rows: int = 0
    # the boundary activations 0..act_host-1 (layer i's input) live in the host tier, in ``act_host_bytes`` of its
    # room beside the state (a pass's worth: tiermem.store.scratch); the others on the GPU
    act_host: int = 0
    act_host_bytes: int = 0

    def need(self, rank: int | None = None) -> dict[str, int]:
        """Bytes each registered tier needs (the device tier: the streaming slots too; the host tier: the staging of
        storage-resident state too). With ``owners``, the device tier's is one rank's HBM: ``rank``'s, or (None)
        the fullest rank's (what every rank's budget must hold)."""
        device = registry.primary(DEVICE)
        out = dict.fromkeys(registry.names(), 0)
        out[device] += self.slot_bytes * self.n_slots
        out[registry.primary(HOST)] += self.staging_bytes + self.act_host_bytes
        by_rank: dict = defaultdict(int)
        for key, tier in self.where.items():
            if tier == device and self.owners is not None:
                by_rank[self.owners[key[0]]] += self.group_bytes[key]
            else:
                out[tier] += self.group_bytes[key]
        if self.owners is not None:
            out[device] += by_rank.get(rank, 0) if rank is not None else max(by_rank.values(), default=0)
        return out

    def bytes_by_kind(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {t: defaultdict(int) for t in registry.names()}
        for key, tier in self.where.items():
            out[tier][key[1]] += self.group_bytes[key]
        return {t: dict(v) for t, v in out.items()}


def default_budgets(cfg: StoreConfig) -> dict[str, int | None]:
    """Each registered tier's budget: the config's; unset, its class's default from what the machine has (the
    host's memory: the cgroup's limit where there is one, ``tiermem.plan.hostmem``); None for a tier the config
    leaves out."""
    device = compute_device(cfg)
    out: dict[str, int | None] = {}
    for name, section in cfg.tiers.items():
        budget = None if section is None else section.budget
        if section is not None and budget is None:
            budget = registry.tier_type(name).default_budget(section, device, available_memory)
        out[name] = budget
    return out


def make_plan(specs: list[TensorSpec], cfg: StoreConfig, streamed_kinds: tuple[str, ...] = ("param",),
              budgets: dict[str, int | None] | None = None, owners: dict | None = None) -> Plan:
    """The fixed rule's plan (``owners``: several ranks, each group's state pinned to ``gpu`` in its owner's
    HBM, every rank's budget checked)."""
    budgets = default_budgets(cfg) if budgets is None else budgets
    group_bytes: dict[tuple[Group, str], int] = defaultdict(int)
    for s in specs:
        group_bytes[(s.group, s.kind)] += align_up(s.nbytes, ALIGN)
    where: dict[tuple[Group, str], str] = {}
    if isinstance(cfg.placement, dict):  # (without a workload to plan for, kinds not pinned live in DRAM)
        pins = cfg.pins()
        for key in group_bytes:
            where[key] = pins.get(key[1], registry.primary(HOST))
    else:
        _auto(group_bytes, where, budgets, cfg, streamed_kinds)
    plan = _finish(group_bytes, where, cfg, streamed_kinds, budgets)
    plan.owners = owners
    check_budgets(plan)
    return plan


def staging_bytes(where: dict, group_bytes: dict) -> int:
    """Host memory that stages storage-resident state: two groups' worth (one group's read ahead while the last
    one's is written back)."""
    on_storage: dict = defaultdict(int)
    storage = {t for t in set(where.values()) if registry.role_of(t) == STORAGE}
    for (g, k), tier in where.items():
        if tier in storage:
            on_storage[g] += group_bytes[(g, k)]
    return 2 * max(on_storage.values(), default=0)


def _finish(group_bytes, where, cfg, streamed_kinds, budgets) -> Plan:
    device = registry.primary(DEVICE)
    streamed = [b for (g, k), b in group_bytes.items() if k in streamed_kinds and where[(g, k)] != device]
    slot = max(streamed, default=0)
    n_slots = cfg.tiers.device_tier.slots if slot else 0
    return Plan(dict(where), dict(group_bytes), slot, n_slots, staging_bytes(where, group_bytes), budgets)


def _auto(group_bytes, where, budgets, cfg, streamed_kinds) -> None:
    device, host, spill = registry.primary(DEVICE), registry.primary(HOST), cfg.tiers.of_role(STORAGE)
    for key in group_bytes:
        where[key] = host
    # shared (string-named) groups wholly on the GPU while they fit beside the slots
    gpu_budget = budgets.get(device)
    probe = _finish(group_bytes, where, cfg, streamed_kinds, budgets)
    gpu_used = probe.slot_bytes * probe.n_slots
    for g in sorted({g for g, _ in group_bytes if isinstance(g, str)}):
        size = sum(b for (gg, _), b in group_bytes.items() if gg == g)
        if gpu_budget is None or gpu_used + size <= gpu_budget:
            for key in group_bytes:
                if key[0] == g:
                    where[key] = device
            gpu_used += size
    # spill to the (first) storage tier, coldest kinds of the last groups first, until DRAM fits
    dram_budget = budgets.get(host)
    if dram_budget is None or not spill:
        return
    order = sorted((key for key, tier in where.items() if tier == host),
                   key=lambda k: (-HOT_FIRST.index(k[1]), -_order(k[0])))
    for key in order:
        plan = _finish(group_bytes, where, cfg, streamed_kinds, budgets)
        if plan.need()[host] <= dram_budget:
            return
        where[key] = spill[0]


def _order(group: Group) -> int:
    return group if isinstance(group, int) else -1


def check_budgets(plan: Plan) -> None:
    """Refuse (one line) a plan a tier's budget cannot hold, or one that puts state on a tier not configured."""
    need = plan.need()
    names = registry.names()
    over = [t for t in names if plan.budgets.get(t) is not None and need[t] > plan.budgets[t]]
    for t in registry.of_role(STORAGE):
        if need[t] and plan.budgets.get(t) is None:
            raise BudgetError(f"placement puts state on {t} but no {registry.tier_type(t).label} tier is "
                              f"configured; add tiers.{t} with a path and budget, or place every kind on "
                              + " or ".join(registry.of_role(DEVICE) + registry.of_role(HOST)))
    if not over:
        return

    def budget(t: str) -> str:
        b = plan.budgets.get(t)
        return "no limit" if b is None else f"budget {format_size(b)}"

    parts = ", ".join(f"{t} {format_size(need[t])} ({budget(t)})" for t in names if need[t] or t in over)
    raise BudgetError(f"placement does not fit: needs {parts}; " + "; ".join(_fix(t) for t in over))


def _fix(tier: str) -> str:
    """What to change when ``tier`` is over its budget."""
    role = registry.role_of(tier)
    if role == DEVICE:
        return f"raise tiers.{tier}.budget or place fewer kinds on {tier}"
    if role == HOST:
        return (f"raise tiers.{tier}.budget or move cold kinds (exp_avg, exp_avg_sq, master) to "
                + (" or ".join(registry.of_role(STORAGE)) or "a storage tier"))
    return f"raise tiers.{tier}.budget or choose a larger disk"
