"""``placement: auto`` from the cost model: where each group's state lives across HBM, DRAM and NVMe, where
its update runs, and how many layer-major passes a step takes, chosen by predicting the step.

    plan = plan_step(specs, cfg, workload, machine)     # -> placement.Plan with .prediction, .passes, ...

For each number of passes (fewer passes keep more boundary activations in HBM, more passes leave HBM to
state), HBM takes whole groups in the order the next forward needs their update (the embedding, layer 0,
1, ...: their update must be done first, and a group that lives in HBM is updated there in place, moving
nothing over PCIe), while they fit beside the activations, the working set of a layer and the streaming
slots; the other groups live in DRAM, their coldest kinds (exp_avg_sq, exp_avg, master) spilling to NVMe
from the last groups first while DRAM is short. The streamed groups' updates are split between the CPU
(the last groups: the forward needs them last) and the GPU in the proportion the cost model predicts
fastest; a streamed group the GPU updates needs HBM of its own (its gradient waits there from the backward,
three groups' state are in flight), so a split is taken only where that room is left, and a layout that
leaves it is tried too. Kinds the placement pins (``{exp_avg_sq: nvme}``) stay where they are pinned. A
service's run keeps its state in HBM in the service's own blocks (``write_through`` with its durability: step), its
ranks' as an embedded run's ranks' (``owners``).

Several ranks of a host (``owners``: group -> owning rank) each have an HBM of the same size: a group's
optimizer-side state (grad, master, exp_avg, exp_avg_sq) may live in its owner's, never its compute copy (every
rank streams it from the shared arena, so every rank keeps the streaming slots). Each rank's HBM — its owned
state, its slots, the activations, what the caller takes besides (``hbm_taken``: the gradients in flight) and
its GPU worker's copies — must fit; the plan's need of the device tier is the fullest rank's. Several ranks run as many
layer-major passes as one process would with a rank's micro-batches (each pass's gradients reduced to their
owners, which keep the partial sums: ``trainer.parallel.dp``).
"""

from __future__ import annotations

import math
from collections import defaultdict

import psutil

from tiermem.config import StoreConfig
from tiermem.errors import BudgetError
from tiermem.plan.activations import candidates as _candidates
from tiermem.plan.activations import host_activation_bytes, host_budgets, host_counts, not_on_nvme, set_host_activations
from tiermem.plan.costmodel import GPU, SLOTS, Layout, Prediction, predict, rank_of
from tiermem.plan.machine import Machine
from tiermem.plan.placement import ALIGN, Plan, check_budgets, default_budgets, staging_bytes
from tiermem.plan.refusals import does_not_fit, short_line
from tiermem.plan.workload import Workload
from tiermem.sizes import align_up, format_size
from tiermem.specs import TensorSpec
from tiermem.tiers import registry
from tiermem.tiers.base import DEVICE, HOST, STORAGE

SPILL_ORDER = ("exp_avg_sq", "exp_avg", "master", "grad", "param")  # coldest first
DISCARDED_AT_END = ("grad", "exp_avg", "exp_avg_sq")  # on NVMe: given back to the disk before the export
CPU_SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)
TIE = 0.005  # a later candidate layout must predict a step this much shorter to be taken
# ... and one that moves state off HBM to keep layers' graphs (or more boundary activations off it: their copies are
# not measured on the GPU yet) this much: on the H200 (8B, 16 x 4096 tokens) such
# a layout was predicted 1.8% faster (6.82 -> 6.70 s) and measured 0.9% faster (7.10 -> 7.04 s): the moved
# groups' updates and copies cost more beside the forward than the cost model counts
KEEP_TIE = 0.015
ADVICE_GAIN = 0.10  # advice is given for a change that makes a step's tokens go through more than this faster
HBM_RESERVE = 0.06  # of HBM kept free for the allocator's fragmentation and the CUDA context


def sizes(specs: list[TensorSpec]) -> tuple[dict, dict]:
    """Bytes of each (group, kind) as the tiers allocate them, and parameters of each group."""
    group_bytes: dict = defaultdict(int)
    params: dict = defaultdict(int)
    for s in specs:
        group_bytes[(s.group, s.kind)] += align_up(s.nbytes, ALIGN)
        if s.kind == "grad":
            params[s.group] += math.prod(s.shape)
    return dict(group_bytes), dict(params)


def hbm_room(machine: Machine, budgets: dict, cuda: bool) -> int:
    """HBM the state, the slots and the activations may take together."""
    if not cuda:  # the CPU stand-in: its "GPU" budget is a share of host memory
        gpu = budgets.get(registry.primary(DEVICE))
        return int(gpu) if gpu is not None else psutil.virtual_memory().available // 4
    total = int(machine.gpu_memory * (1 - HBM_RESERVE)) - (1 << 30)
    gpu = budgets.get(registry.primary(DEVICE))
    return total if gpu is None else min(total, int(gpu))


def _partials_bytes(group_bytes: dict) -> int:
    """HBM a step of several passes needs beside the activations: on each pass after the first, a group's
    gradient partial sums of the earlier passes come back into a buffer beside its new gradient (the largest
    group's: the LM head's or the embedding's, read back while the loss's working set is held). The 14B run
    planned 0.1 GiB short of its HBM without it ran out of memory in its first step."""
    return max((b for (_, kind), b in group_bytes.items() if kind == "grad"), default=0)


def pass_counts(micro_batches: int) -> list[int]:
    """Numbers of passes that differ in the micro-batches a pass holds."""
    out, seen = [], set()
    for p in range(1, micro_batches + 1):
        per = -(-micro_batches // p)
        if per not in seen:
            seen.add(per)
            out.append(-(-micro_batches // per))
    return out


def plan_step(specs: list[TensorSpec], cfg: StoreConfig, w: Workload, m: Machine, budgets: dict | None = None,
              cuda: bool = True, fixed_passes: int | None = None, hbm_state: bool = True, gpu_worker: bool = True,
              keep_auto: bool = False, hbm_taken: int = 0, owners: dict | None = None, activations: str = "auto",
              write_through: bool = False) -> Plan:
    """The fastest predicted placement of ``specs`` for steps of ``w`` on machine ``m`` (see the module).
    ``hbm_state`` False: no state in HBM (several hosts' stores); HBM holds the activations, the slots and the
    GPU worker's copies. ``gpu_worker`` False: the CPU updates every group that does not live in HBM (a service
    without CUDA). ``hbm_taken``: bytes of HBM the run takes for something else the whole step (several ranks: the
    gradients in flight to their owners; a service: room for new state, its CUDA context). ``keep_auto``
    (tiermem_keep_activations: auto): the layers that keep their forward's activations, and skip the recompute, are
    chosen with the placement: HBM given to a layer's kept graph is HBM taken from state, so several numbers of kept
    layers are tried, each with the state placed in what they leave, and every layout keeps as many more as its
    leftover HBM holds. Kept graphs are weighed at the number of passes chosen without them: they never add passes
    (each pass moves the streamed groups' partial gradients both ways, which the GPU runs have shown costs more than
    the cost model counts). ``owners`` (several ranks of a host: group -> rank): each group's HBM-resident state
    lives in its owner's HBM (see the module). ``activations``: where the boundary activations may live
    (``host_counts``). ``write_through`` (durability: step): each update's new state in HBM is copied to DRAM."""
    device = registry.primary(DEVICE)  # (its budget: the device tier's, or unset all of its HBM, activations too)
    budgets = dict(budgets) if budgets is not None else {**default_budgets(cfg), device: cfg.tiers.device_tier.budget}
    (group_bytes, params), pins = sizes(specs), cfg.pins()
    room = hbm_room(m, budgets, cuda) - hbm_taken
    need_total, best = sum(group_bytes.values()), None
    short, host, one_pass = None, registry.primary(HOST), []  # (one_pass: a layout of one pass, activations on GPU)
    keeps = keep_auto and hbm_state and w.kept_bytes and owners is None
    candidates = _candidates(w, [fixed_passes] if fixed_passes else pass_counts(w.micro_batches),
                             host_counts(w, activations, owners is None and hbm_state), one_pass,
                             lambda: best[1] if best is not None and keeps else None, keep_counts)
    partials = _partials_bytes(group_bytes)
    # the embedding's gradient summed in its home in HBM needs no tensor of its own: a layout is tried first with
    # that much more HBM for state, kept if it keeps the embedding's whole state in HBM (one process); then without
    homes = (True, False) if w.embed_grad_bytes and owners is None and hbm_state and not w.tied else (False,)
    for (p, k, more, h), home in ((c, e) for c in candidates for e in homes):
        act = w.hbm_activation_bytes(p, h, embed_home=home) + (partials if p > 1 else 0)
        per_kept = w.kept_bytes * -(-w.micro_batches // p)  # (a kept layer's graph: every micro-batch of a pass)
        state_room, on_host = room - act - k * per_kept, host_budgets(budgets, host, host_activation_bytes(w, p, h))
        if state_room < 0 or on_host is None:
            continue
        try:
            first = _place(group_bytes, w, pins, state_room, on_host, cfg, fill=hbm_state, owners=owners, act=act)
        except BudgetError as e:
            if not k:  # (the last: the most passes, the most HBM left to state; none given to kept graphs)
                short = e
            continue
        # then the same with HBM left for the GPU worker to update every streamed group (their gradients
        # wait there from the backward; three groups' state in flight); last, where neither leaves the GPU
        # worker room, nothing in HBM but what is pinned there (every update may then run on the CPU)
        reserve = gpu_update_bytes(first, group_bytes, set(w.groups), owners) if hbm_state else 0
        tries = [(first, None), (state_room - reserve, True), (state_room, False)] if reserve else [(first, None)]
        fits = False
        for n, (where, fill) in enumerate(tries):
            if n == 2 and fits:
                break
            if fill is not None:
                try:
                    where = _place(group_bytes, w, pins, where, on_host, cfg, fill, owners, act)
                except BudgetError:
                    continue
            if home and not embed_resident(where, w):  # (the room counted on the embedding's home in HBM)
                continue
            free = state_room - _hbm_used(where, group_bytes, cfg)
            for gpu_updates in _update_splits(where, w, gpu_worker):
                need = gpu_update_bytes(where, group_bytes, gpu_updates)
                if owners is not None:  # (each rank's HBM: its state, its slots, its GPU worker's copies)
                    by_rank = hbm_by_rank(where, group_bytes, cfg, owners, gpu_updates)
                    r = max(by_rank, key=by_rank.get)
                    need = gpu_update_bytes(where, group_bytes, {g for g in gpu_updates if owners[g] == r})
                    free = state_room - (by_rank[r] - need)
                if need > free:
                    short = BudgetError(f"the GPU's optimizer needs {format_size(need)} of HBM beside the state "
                                        f"to update the groups it streams in, {format_size(max(free, 0))} is left: "
                                        f"raise tiers.{device}.budget, or pin fewer kinds off the GPU")
                    continue
                fits = True
                kept = kept_layers(where, w.layers, k + ((free - need) // per_kept if more and per_kept else 0))
                layout = Layout(where, gpu_updates, p, cfg.tiers.device_tier.slots, kept, act_host=h,
                                write_through=write_through, **rank_of(owners, params))
                pred = predict(layout, w, m, group_bytes, params)
                # (state moved off HBM for kept graphs, and activations moved off it, must earn their keep)
                moved = best is not None and ((kept and _hbm_used(where, group_bytes, cfg)
                                               < _hbm_used(best[1].where, group_bytes, cfg)) or h > best[1].act_host)
                tie = KEEP_TIE if moved else TIE
                if best is None or pred.step < best[0] * (1 - tie):  # (the first of near-equal layouts: fewer
                    best = (pred.step, layout, pred, state_room, act, home)  # passes, more state in HBM)
                one_pass += [True] if p == 1 and not h else []
    if best is None:
        raise not_on_nvme(short or BudgetError(does_not_fit(need_total, room, w, budgets, partials)),
                          host_counts(w, activations, owners is None and hbm_state)[-1])
    _, layout, pred, state_room, act, home = best
    plan = _finish_plan(layout, group_bytes, cfg, {**budgets, device: state_room})
    plan.owners = owners
    plan.prediction, plan.passes, plan.gpu_updates = pred, layout.passes, set(layout.gpu_updates)
    plan.activation_bytes = act
    plan.keep = layout.keep
    plan.activation_budget = (act - partials - w.working_bytes + (w.embed_grad_bytes if home else 0)) \
        if layout.passes > 1 else None
    set_host_activations(plan, w, layout)
    plan.machine, plan.workload, plan.params = m, w, params
    plan.hbm_room = room
    check_budgets(plan)
    return plan


def keep_counts(w: Workload, search: bool) -> list[int]:
    """Numbers of layers given HBM for their kept graphs before the state is placed: none, then doubling
    up to every layer (0 only when not searching or when a layer's graph was not measured)."""
    if not search or not w.kept_bytes:
        return [0]
    n, out = len(w.layers), [0]
    k = 1
    while k < n:
        out.append(k)
        k *= 2
    return out + [n]


def kept_layers(where: dict, layers: list, n: int) -> frozenset:
    """The layers that keep their graphs: the first ``n`` whose weights live in HBM (a streamed layer's weights
    are gone before its backward; the executor picks the same)."""
    device = registry.primary(DEVICE)
    return frozenset([g for g in layers if where.get((g, "param")) == device][:max(n, 0)])


def gpu_update_bytes(where: dict, group_bytes: dict, gpu_updates: set, owners: dict | None = None) -> int:
    """HBM the GPU worker needs to update the ``gpu_updates`` groups whose state does not all live in HBM:
    each one's fp32 gradient, kept on the GPU from the backward until its update (unless its home is in HBM),
    and three groups' state in flight (the next one arriving, one updating, the last one going home, with its
    compute copy; what lives in HBM is updated where it is). ``owners``: the largest of the ranks' (each rank's
    GPU worker updates the groups it owns)."""
    if owners is not None:
        return max((gpu_update_bytes(where, group_bytes, {g for g in gpu_updates if owners[g] == r})
                    for r in set(owners.values())), default=0)
    device = registry.primary(DEVICE)
    streamed = [g for g in gpu_updates
                if any(t != device for (h, k), t in where.items() if h == g)]
    if not streamed:
        return 0
    grads = sum(group_bytes.get((g, "grad"), 0) for g in streamed if where.get((g, "grad")) != device)
    state = max(sum(b for (h, k), b in group_bytes.items() if h == g and k != "grad" and where[(h, k)] != device)
                for g in streamed)
    return grads + 3 * state


def hbm_by_rank(where: dict, group_bytes: dict, cfg: StoreConfig, owners: dict, gpu_updates=()) -> dict:
    """Several ranks: each rank's HBM for state, its streaming slots and its GPU worker's copies (of the
    ``gpu_updates`` groups it owns)."""
    device = registry.primary(DEVICE)
    out = {r: 0 for r in set(owners.values())}
    for (g, k), b in group_bytes.items():
        if where[(g, k)] == device:
            out[owners[g]] += b
    streamed = [b for (g, k), b in group_bytes.items() if k == "param" and where[(g, k)] != device]
    slots = cfg.tiers.device_tier.slots * max(streamed) if streamed else 0
    return {r: used + slots + gpu_update_bytes(where, group_bytes, {g for g in gpu_updates if owners[g] == r})
            for r, used in out.items()}


def _hbm_used(where: dict, group_bytes: dict, cfg: StoreConfig) -> int:
    """HBM the placed state and the streaming slots take."""
    device = registry.primary(DEVICE)
    used = sum(b for key, b in group_bytes.items() if where[key] == device)
    streamed = [b for (g, k), b in group_bytes.items() if k == "param" and where[(g, k)] != device]
    return used + (cfg.tiers.device_tier.slots * max(streamed) if streamed else 0)


def _finish_plan(layout: Layout, group_bytes: dict, cfg: StoreConfig, budgets: dict) -> Plan:
    device = registry.primary(DEVICE)
    streamed = [b for (g, k), b in group_bytes.items() if k == "param" and layout.where[(g, k)] != device]
    slot = max(streamed, default=0)
    n_slots = cfg.tiers.device_tier.slots if slot else 0
    return Plan(dict(layout.where), dict(group_bytes), slot, n_slots, staging_bytes(layout.where, group_bytes),
                budgets)


def _place(group_bytes: dict, w: Workload, pins: dict, state_room: int, budgets: dict,
           cfg: StoreConfig, fill: bool = True, owners: dict | None = None, act: int = 0) -> dict:
    """HBM (the device tier) takes whole groups in update order while they fit (``fill``; else only what is
    pinned there); DRAM (the host tier) the rest; the first storage tier what DRAM cannot hold. ``owners``
    (several ranks): a group's state but its compute copy goes to its owner's HBM, while it fits there. ``act``:
    the activations' HBM beside the state, for a refusal's ways out."""
    device, host, spill = registry.primary(DEVICE), registry.primary(HOST), cfg.tiers.of_role(STORAGE)
    groups = w.groups
    kinds_of: dict = defaultdict(list)
    for g, k in group_bytes:
        kinds_of[g].append(k)
    where = {key: pins.get(key[1], host) for key in group_bytes}
    rank = (lambda g: owners[g]) if owners is not None else (lambda g: 0)
    used: dict = defaultdict(int)  # HBM of each rank (one GPU: rank 0)
    for key, b in group_bytes.items():
        if where[key] == device:
            used[rank(key[0])] += b
    slots = cfg.tiers.device_tier.slots * max((b for (g, k), b in group_bytes.items() if k == "param"), default=0)
    left_out = owners is not None or any(where.get((g, "param")) not in (None, device) for g in groups
                                         if "param" in pins)
    for g in groups if fill else []:  # (left_out: some group's weights stream: the slots are needed)
        free_kinds = [k for k in kinds_of[g] if k not in pins and not (owners is not None and k == "param")]
        if not free_kinds:
            continue
        size = sum(group_bytes[(g, k)] for k in free_kinds)
        r = rank(g)
        all_up = not left_out and _rest_fits(groups, g, group_bytes, kinds_of, used[r] + size, state_room)
        if used[r] + size + (0 if all_up else slots) <= state_room:
            for k in free_kinds:
                where[(g, k)] = device
            used[r] += size
        elif "param" in free_kinds:
            left_out = True
    streamed = [b for (g, k), b in group_bytes.items() if k == "param" and where[(g, k)] != device]
    used = max(used.values(), default=0)  # (the fullest rank's)
    if streamed:  # (the slots hold the largest streamed group's weights)
        used += cfg.tiers.device_tier.slots * max(streamed)
    if used > state_room:
        raise BudgetError(f"the GPU needs {format_size(used)} for the state it holds and its streaming slots, "
                          f"{format_size(max(state_room, 0))} is left beside the activations")
    dram_budget = budgets.get(host)
    if dram_budget is None:
        return where
    order = [(g, k) for k in SPILL_ORDER for g in reversed(groups)
             if (g, k) in group_bytes and where[(g, k)] == host and k not in pins]

    def dram_need():  # (what DRAM holds, and its staging of storage-resident state)
        return sum(b for key, b in group_bytes.items() if where[key] == host) + staging_bytes(where, group_bytes)

    if dram_need() <= dram_budget:
        return where
    if not spill:
        raise BudgetError(short_line(group_bytes, budgets, state_room, "host", cfg=cfg, act=act))
    for key in order:
        where[key] = spill[0]
        if dram_need() <= dram_budget:
            break
    if dram_need() > dram_budget:  # (what DRAM still holds, and the staging of a group's NVMe state)
        raise BudgetError(short_line(group_bytes, budgets, state_room, "staging", dram_need() - dram_budget,
                                     spill[0], cfg, act))
    for t in spill:
        on = sum(b for key, b in group_bytes.items() if where[key] == t)
        if budgets.get(t) is not None and on > budgets[t]:  # (DRAM also stages a group's NVMe state)
            raise BudgetError(short_line(group_bytes, budgets, state_room, "storage", on - budgets[t], t, cfg, act))
        kept = sum(b for key, b in group_bytes.items() if where[key] == t and key[1] not in DISCARDED_AT_END)
        if budgets.get(f"{t}_kept") is not None and kept > budgets[f"{t}_kept"]:  # (beside the exported model)
            raise BudgetError(short_line(group_bytes, budgets, state_room, "export", kept - budgets[f"{t}_kept"],
                                         t, cfg, act))
    return where


def _rest_fits(groups, g, group_bytes, kinds_of, used, room) -> bool:
    """Whether every group after ``g`` would fit in HBM too (then no streaming slots are needed)."""
    rest = 0
    for h in groups[groups.index(g) + 1:]:
        rest += sum(group_bytes[(h, k)] for k in kinds_of[h])
    return used + rest <= room


def _up_and_streamed(where: dict, groups: list) -> tuple[list, list]:
    """The groups with state in HBM (the GPU always updates them), and the others, in the forward's order."""
    device = registry.primary(DEVICE)
    up = [g for g in groups if any(t == device for (h, k), t in where.items() if h == g and k != "param")]
    return up, [g for g in groups if g not in up]


def _update_splits(where: dict, w: Workload, gpu_worker: bool = True):
    """Candidate sets of GPU-updated groups: the groups with state in HBM always (updated there, in place
    when all of it is); of the others, the CPU takes the last ones (a share of them; all of them without a
    ``gpu_worker``), the GPU the first. The CPU's largest share comes first, so that of near-equal predictions
    the layout streaming the least state through the GPU worker is kept: on the H200 machine such streaming
    cost more beside the forward than the cost model counts (8B, 16 x 4096 tokens: 19 streamed groups measured
    7.14 s a step where the CPU-updated layout measured 6.99)."""
    up, streamed = _up_and_streamed(where, w.groups)
    seen = set()
    for share in reversed(CPU_SHARES) if gpu_worker else (1.0,):
        n_cpu = round(share * len(streamed))
        gpu = frozenset(up + streamed[: len(streamed) - n_cpu])
        if gpu not in seen:
            seen.add(gpu)
            yield set(gpu)


def resplit(plan: Plan, w: Workload, m: Machine) -> tuple[set, Prediction] | None:
    """The fastest update split for ``plan``'s placement as it is (its tiers, passes and kept layers) on the
    figures ``w`` and ``m`` — a run's, corrected by what its first steps measured: the CPU takes the last n of
    the streamed groups, for every n from all of them down, where the GPU worker's HBM for the others (their
    gradients, three groups' state in flight) fits beside what the plan put there. None when none fits."""
    where, gb = plan.where, plan.group_bytes
    up, streamed = _up_and_streamed(where, w.groups)
    per_kept = w.kept_bytes * -(-w.micro_batches // max(plan.passes, 1))
    used = (plan.activation_bytes + sum(b for key, b in gb.items() if where[key] == registry.primary(DEVICE))
            + plan.slot_bytes * plan.n_slots + len(plan.keep) * per_kept)
    best = None
    for n_cpu in range(len(streamed), -1, -1):  # (the CPU's largest share first: it wins near-equal ones)
        gpu = set(up + streamed[: len(streamed) - n_cpu])
        if used + gpu_update_bytes(where, gb, gpu) > plan.hbm_room:
            continue
        pred = predict(layout_of(plan, gpu_updates=gpu), w, m, gb, plan.params)
        if best is None or pred.step < best[1].step * (1 - TIE):
            best = (gpu, pred)
    return best


def embed_resident(where: dict, w: Workload) -> bool:
    """Whether a layout keeps the embedding's whole state in HBM (its gradient then summed in its home there)."""
    kinds = [t for (g, _), t in where.items() if g == w.first]
    return bool(kinds) and all(t == registry.primary(DEVICE) for t in kinds)


def predict_at(plan: Plan, ga: int, k: int) -> tuple[Prediction, float]:
    """The prediction of a step of ``k`` gradient_accumulation_steps (the plan's placement, ``ga`` its own: the
    same micro-batches, as many passes as their boundaries need) and its tokens a second."""
    w, base = plan.workload, plan.workload.micro_batches
    mb = max(1, round(base / ga * k))  # (micro-batches per accumulation step x k)
    wk = w.scaled(w.tokens * k // ga, mb)
    act_room = plan.hbm_room - plan.need()[registry.primary(DEVICE)]  # (state, slots; several ranks: the fullest's)
    p, partials = 1, _partials_bytes(plan.group_bytes)
    home = bool(w.embed_grad_bytes) and not w.tied and plan.owners is None and embed_resident(plan.where, w)
    while wk.hbm_activation_bytes(p, plan.act_host, embed_home=home) + (partials if p > 1 else 0) > act_room \
            and p < mb:
        p += 1
    # (no kept graphs: a pass of more micro-batches keeps more of them)
    pr = predict(layout_of(plan, passes=p, keep=frozenset()), wk, plan.machine, plan.group_bytes, plan.params)
    return pr, wk.tokens / pr.step


def compute_bound_at(plan: Plan, ga: int, max_ga: int = 4096) -> tuple[int, Prediction] | None:
    """The smallest gradient_accumulation_steps (a multiple of steps of the same micro-batches) at which a
    step with this placement is compute-bound, and its prediction; None if none up to ``max_ga``."""
    k = ga
    while k <= max_ga:
        if predict_at(plan, ga, k)[0].bound == GPU:
            lo, hi = max(ga, k // 2), k  # the smallest in (k/2, k]
            while lo < hi:
                mid = (lo + hi) // 2
                if predict_at(plan, ga, mid)[0].bound == GPU:
                    hi = mid
                else:
                    lo = mid + 1
            return hi, predict_at(plan, ga, hi)[0]
        k *= 2
    return None


def recommended_at(plan: Plan, ga: int, bound_at: tuple[int, Prediction] | None) -> tuple[int, Prediction] | None:
    """The gradient_accumulation_steps to advise: the smallest from ``ga`` up whose tokens a second are within
    ``ADVICE_GAIN`` of the compute-bound step's (``bound_at``), and its prediction; None when ``ga`` already is.

    Where the update's wait does not shrink with more tokens (it moves the same bytes; with several passes only
    the first pass's forward hides it), the step nears the compute-bound rate slowly: the 14B shape here gets 90%
    of it at half the micro-batches of the compute-bound step. Raising further would gain less than the advice's
    threshold, for steps twice as long (fewer updates an hour)."""
    if bound_at is None:
        return None
    k_cb, pr_cb = bound_at
    goal = plan.workload.tokens * k_cb / ga / pr_cb.step / (1 + ADVICE_GAIN)
    if plan.workload.tokens / plan.prediction.step >= goal:
        return None
    lo, hi = ga + 1, k_cb
    while lo < hi:  # (tokens a second rise with the step's tokens)
        mid = (lo + hi) // 2
        if predict_at(plan, ga, mid)[1] >= goal:
            hi = mid
        else:
            lo = mid + 1
    return hi, predict_at(plan, ga, hi)[0]


def layout_of(plan: Plan, **changes) -> Layout:
    """The cost model's ``Layout`` of ``plan`` (its placement, GPU updates, passes, slots and kept layers; several
    ranks: the rank it predicts), with ``changes`` (``Layout``'s fields)."""
    fields = dict(where=plan.where, gpu_updates=plan.gpu_updates or set(), passes=plan.passes,
                  slots=plan.n_slots or SLOTS, keep=plan.keep, act_host=plan.act_host,
                  **rank_of(plan.owners, plan.params))
    return Layout(**{**fields, **changes})


def tflops(w: Workload, seconds: float, attention: bool = False) -> float:
    """TFLOP/s of a step of ``seconds``: by 6·N, or (``attention``) with attention's FLOPs counted beside."""
    flops = w.flops_per_token + (w.attention_flops_per_token if attention else 0.0)
    return flops * w.tokens / seconds / 1e12 if seconds > 0 and not math.isinf(seconds) else 0.0
