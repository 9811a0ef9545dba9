"""A training run's plan: the machine's figures, the step's workload, the planner's placement and
prediction, and how they are told to the user (``tiermem-train``'s start lines, ``tiermem plan``'s report).

    machine = machine_for(scfg, device, probe_file)      # a probe file, a quick probe, or assumed figures
    plan = make(mcfg, dtype, scfg, shape, machine, device, loss_chunk)   # None when every kind is pinned
    lines(plan)                                            # what the run prints at start
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiermem.config import KINDS, StoreConfig
from tiermem.errors import BudgetError
from tiermem.plan.costmodel import GPU, describe_bound
from tiermem.plan.machine import Machine, machine_for  # noqa: F401 - (machine_for: the callers' name)
from tiermem.plan.placement import Plan
from tiermem.plan.planner import ADVICE_GAIN, TIE, compute_bound_at, plan_step, recommended_at, tflops
from tiermem.plan.workload import Workload
from tiermem.sizes import format_size
from tiermem.tiers import registry
from tiermem.tiers.base import DEVICE, HOST, STORAGE
from trainer.config import MAX_MICRO_BATCHES as MAX_PIECES
from trainer.planning import plan_workload
from trainer.run import pieces
from trainer.state import state_specs

MERGES = (2, 4)  # micro-batches a piece may merge where auto finds it faster (tiermem_physical_batch_size)
MERGE_GAIN = 0.05  # by more than this share of the step: a merge's larger working set is not worth less


@dataclass
class Shape:
    rows: int  # rows a micro-batch
    seq: int  # tokens a row (padded)
    micro_batches: int  # micro-batches a step
    unit: int = 1  # rows a piece holds whole (stage dpo: 2, a pair's)

    @property
    def tokens(self) -> int:
        return self.rows * self.seq * self.micro_batches


def make(mcfg, dtype: torch.dtype, scfg: StoreConfig, shape: Shape, machine: Machine, device: torch.device,
         loss_chunk: int, time_it: bool = True, budgets: dict | None = None, cuda: bool | None = None,
         keep=0, hbm_state: bool = True, hbm_taken: int = 0, workload: Workload | None = None,
         owners: dict | None = None, piece_rows="auto", activations: str = "auto") -> Plan | None:
    """The planner's plan for this run, or None when the placement pins every kind (the fixed rule then
    places; nothing to decide). ``cuda``: plan for a CUDA GPU of ``machine``'s figures (default: whether
    ``device`` is one). ``keep``: tiermem_keep_activations (auto: the planner chooses the kept layers with
    the placement, for a dense model: the kept graphs of expert layers are not yet measured on the GPU; a
    number: ``keep_activations`` takes them after). ``hbm_state`` False: no state in HBM (several ranks share
    the hosts' stores); ``hbm_taken``: HBM the run takes besides (several ranks' gradients in flight); ``owners``:
    several ranks of a host, each group's state in its owner's HBM (``tiermem.plan.planner``);
    ``workload``: the step as measured before (``tiermem plan --workload``), not timed here. ``piece_rows``
    (tiermem_physical_batch_size): the rows the GPU computes at once, a number, or auto: the planner's (the
    micro-batch's own, or halves of it while a smaller piece is predicted faster or the larger does not fit;
    ``plan.piece_rows``). ``activations`` (tiermem_activations): where the boundary activations may live (the
    planner's ``plan_step``)."""
    specs = state_specs(mcfg, dtype)
    if all(s.kind in scfg.pins() for s in specs):
        return None

    def measure(rows: int) -> Workload:
        return plan_workload.build(mcfg, dtype, rows, shape.seq, pieces.in_step(shape.micro_batches, shape.rows, rows),
                                   machine, device, loss_chunk, time_it=time_it)

    def plan_for(w: Workload) -> Plan:
        return plan_step(specs, scfg, w, machine, budgets, cuda=device.type == "cuda" if cuda is None else cuda,
                         hbm_state=hbm_state, hbm_taken=hbm_taken, owners=owners, activations=activations,
                         keep_auto=keep == "auto" and keeps_activations(mcfg) and mcfg.moe is None)

    if piece_rows != "auto" or not keeps_activations(mcfg):  # (a load-balancing loss is a micro-batch's)
        rows = shape.rows if piece_rows == "auto" else fixed_rows(int(piece_rows), shape.rows)
        w = workload.in_pieces(rows) if workload is not None else measure(rows)
        return _with_pieces(plan_for(w), shape.rows, rows)
    w = workload or measure(shape.rows)
    # (the CPU stand-in measures no working set: its micro-batches are cut only where they are refused whole)
    faster = device.type == "cuda" if cuda is None else cuda
    best = search_pieces(shape.rows, w, plan_for, faster=faster, unit=shape.unit)
    merged = search_merges(shape, w, plan_for, best) if faster else None
    if merged is not None:
        if workload is not None or not time_it:
            return merged
        try:  # (timed at the merged pieces: not faster than the micro-batch whole, today's choice)
            timed = _with_pieces(plan_for(measure(merged.piece_rows)), shape.rows, merged.piece_rows)
            if timed.prediction.step < best.prediction.step:
                return timed
        except BudgetError:
            pass
    if best.piece_rows == shape.rows or workload is not None or not time_it:
        return best
    # (timed at that shape; where its working set is larger than scaled, at a smaller one)
    for rows in [r for r in pieces.candidates(shape.rows, shape.unit) if r <= best.piece_rows]:
        try:
            return _with_pieces(plan_for(measure(rows)), shape.rows, rows)
        except BudgetError as e:
            refused = e
    raise refused


def search_pieces(rows: int, w: Workload, plan_for, faster: bool = True, unit: int = 1) -> Plan:
    """The plan (``plan_for(workload)``) of micro-batches of ``rows`` rows computed whole, or in pieces of halves
    of them, down to one row, while a smaller piece is predicted faster (by more than the planner's tie; not
    ``faster``: never) or the larger piece's plan is refused (BudgetError): the first of near-equal plans (the
    largest pieces). Refused when every piece is: the smallest's refusal (the nearest to fitting). ``unit``: pieces
    hold whole units of that many rows (stage dpo's pairs)."""
    best = refused = None
    for r in pieces.candidates(rows, unit):
        if w.micro_batches * pieces.count(rows, r) > MAX_PIECES:
            break  # (a step's pieces are bounded as its micro-batches are: trainer.config.MAX_MICRO_BATCHES)
        try:
            plan = _with_pieces(plan_for(w.in_pieces(r)), rows, r)
        except BudgetError as e:
            refused = e
            continue
        if best is not None and (not faster or plan.prediction.step >= best.prediction.step * (1 - TIE)):
            break
        best = plan
        if not faster:
            break
    if best is None:
        raise refused or BudgetError(f"{w.micro_batches:,} micro-batches of {rows:,} rows are more than a step may "
                                     f"compute ({MAX_PIECES:,} pieces)")
    return best


def fixed_rows(rows: int, micro_rows: int) -> int:
    """The pieces' rows for tiermem_physical_batch_size ``rows``: at most a micro-batch's, or (a multiple of it,
    trainer.config checks) several micro-batches merged."""
    return rows if rows >= 2 * micro_rows else min(rows, micro_rows)


def search_merges(shape: Shape, w: Workload, plan_for, best: Plan) -> Plan | None:
    """The plan of pieces of 2 or 4 consecutive micro-batches merged (``MERGES``; those dividing the step's
    micro-batches), the fastest, where it fits (``plan_for`` does not refuse it) and is predicted faster than
    ``best`` (today's choice: the micro-batch whole or in pieces) by more than ``MERGE_GAIN``; else None."""
    out = None
    for k in MERGES:
        if shape.micro_batches % k or k * shape.rows > shape.rows * shape.micro_batches:
            continue
        try:
            plan = _with_pieces(plan_for(w.in_pieces(k * shape.rows)), shape.rows, k * shape.rows)
        except BudgetError:
            break  # (a larger piece needs more HBM still)
        if plan.prediction.step < best.prediction.step * (1 - MERGE_GAIN) and (
                out is None or plan.prediction.step < out.prediction.step):
            out = plan
    return out


def _with_pieces(plan: Plan, micro_rows: int, rows: int) -> Plan:
    plan.micro_rows, plan.piece_rows = micro_rows, rows
    return plan


def keeps_activations(mcfg) -> bool:
    """Whether a layer of this model can keep its activations (not while a load-balancing loss is on: its
    backward differentiates the router's term, which the recompute provides)."""
    return mcfg.moe is None or not mcfg.moe.aux_loss_coef


def local_budgets(scfg: StoreConfig, mcfg, dtype: torch.dtype, out_dir, saves: bool) -> dict:
    """This machine's tier budgets for a run writing to ``out_dir``: the GPU's is tiers.gpu.budget (unset: all
    of HBM, activations included); an unset NVMe budget leaves room on its disk, when ``out_dir`` is on the
    same one, for the exported model and (``saves``) one checkpoint: a full disk at the end loses nothing
    but the time of the run. Where the disk takes holes punched in a file, the exported model's room is only
    kept from the state that stays on NVMe to the end (``nvme_kept``): the gradients and moments there are
    discarded before the export."""
    from tiermem.plan.placement import default_budgets
    from tiermem.tiers.drives import drive_of, gives_bytes_back

    device, _, disk = plan_tiers()
    b = {**default_budgets(scfg), device: scfg.tiers.device_tier.budget}
    nv = scfg.tiers[disk]
    if nv is not None and nv.budget is None and b.get(disk) is not None and out_dir is not None:
        where = drive_of(nv, out_dir)
        if where is not None:  # (one of the tier's disks is output_dir's)
            n = mcfg.num_params()
            export = n * torch.empty((), dtype=dtype).element_size()
            ckpt = n * (2 + 12) if saves else 0
            b[disk] = max(0, b[disk] - ckpt)
            if gives_bytes_back(where):  # (the state the export does not read is discarded before it)
                b[f"{disk}_kept"] = max(0, b[disk] - export)
            else:
                b[disk] = max(0, b[disk] - export)
    return b


def budgets_for(scfg: StoreConfig, machine: Machine) -> dict:
    """Tier budgets on the machine ``machine`` describes (not this one): the config's, else 90% of its RAM
    for DRAM and, for NVMe, its disks' room where the probe or the machine file gave it (else this disk's)."""
    from tiermem.plan.placement import default_budgets

    device, host, disk = plan_tiers()
    here = default_budgets(scfg)
    arena = scfg.tiers.host_tier.budget if scfg.tiers.host_tier.budget is not None else int(machine.ram * 0.9)
    on_disk, section = None, scfg.tiers[disk]
    if section is not None:
        on_disk = section.budget if section.budget is not None else (
            machine.disk_free if machine.disk_free is not None else here[disk])  # (0: a machine file's no disk)
    out = {device: scfg.tiers.device_tier.budget, host: arena, disk: on_disk}
    if on_disk is not None and machine.disk_free is not None:  # (refusals name that machine's disks, not this one's)
        out[f"{disk}_free"] = machine.disk_free
    return out


def plan_tiers() -> tuple[str, str, str]:
    """The tiers a plan's lines and its JSON tell, by their roles: the device tier, the store's host tier and the
    first storage tier (the built-in ones: a tier added at run time is not among them)."""
    return registry.primary(DEVICE), registry.primary(HOST), registry.of_role(STORAGE)[0]


def disk_resource() -> str:
    """The cost model's resource of that storage tier's disk (its reads and writes)."""
    return registry.tier_type(plan_tiers()[2]).resource


def span(groups: list) -> str:
    ints = sorted(g for g in groups if isinstance(g, int))
    parts, run = [], []
    for g in [*ints, None]:
        if g is not None and run and g == run[-1] + 1:
            run.append(g)
            continue
        if run:
            parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [g] if g is not None else []
    names = [str(g) for g in groups if not isinstance(g, int)]
    return ", ".join(names + (["layers " + ", ".join(parts)] if parts else []))


def where_lines(plan: Plan) -> list[str]:
    """Per tier: the kinds it holds and of which groups."""
    out = []
    groups = plan.workload.groups
    device = registry.primary(DEVICE)
    for tier in plan_tiers():
        by_kind = {}
        for k in KINDS:
            gs = [g for g in groups if plan.where.get((g, k)) == tier]
            if gs:
                by_kind[k] = gs
        if not by_kind:
            continue
        size = sum(b for key, b in plan.group_bytes.items() if plan.where[key] == tier)
        # kinds with the same groups together
        seen: dict = {}
        for k, gs in by_kind.items():
            seen.setdefault(tuple(map(str, gs)), ([], gs))[0].append(k)
        parts = [f"{'+'.join(ks)} of {span(gs) if len(gs) < len(groups) else 'every group'}"
                 for ks, gs in seen.values()]
        ranks = len(set(plan.owners.values())) if tier == device and plan.owners else 0
        where = f" over {ranks} ranks' GPUs (each group's in its owner's)" if ranks > 1 else ""
        out.append(f"{tier} {format_size(size)}{where}: " + "; ".join(parts))
    return out


def budget_lines(plan: Plan) -> list[str]:
    need, (device, host, disk) = plan.need(), plan_tiers()
    out = [f"{device}: state {format_size(need[device])} + activations {format_size(plan.activation_bytes)} of "
           f"{format_size(plan.hbm_room)} usable HBM"]
    for t in (host, disk):
        b = plan.budgets.get(t)
        if need[t] or b:
            acts = f" (boundary activations {format_size(plan.act_host_bytes)} of it)" \
                if t == host and plan.act_host_bytes else ""
            out.append(f"{t}: {format_size(need[t])}{acts} of {'no limit' if b is None else format_size(b)}")
    return out


def split_line(plan: Plan) -> str:
    p = plan.prediction
    names = {GPU: "GPU compute", "gpu_adamw": "GPU AdamW", "h2d": "PCIe in", "d2h": "PCIe out",
             "cpu": "CPU AdamW"}
    parts = [f"{names[r]} {p.busy[r]:.2f}s" for r in names if p.busy[r] > 0]
    disk = disk_resource()
    if p.busy[disk] > 0:
        parts.append(f"NVMe {p.busy[disk]:.2f}s (read {p.nvme_read:.2f} + write {p.nvme_write:.2f})")
    return ", ".join(parts)


def lines(plan: Plan, ga: int | None = None) -> list[str]:
    """The plan told in a few lines (a run's start, the head of ``tiermem plan``)."""
    p, w = plan.prediction, plan.workload
    passes = f"{plan.passes} pass{'es' if plan.passes > 1 else ''} a step" + (
        f"; the activations of {span(sorted(plan.keep))} kept (no recompute)" if plan.keep else "")
    if plan.gpu_updates is None:
        updates = "updates: as optimizer.gpu_share says (the prediction assumed the planner's split)"
    else:
        updates = f"updates: {updates_split(len(plan.gpu_updates), len(w.groups))}"
    if pieces.told(plan.micro_rows, plan.piece_rows):
        passes += f"; {pieces.told(plan.micro_rows, plan.piece_rows)} (tiermem_physical_batch_size)"
    if plan.act_host:
        passes += f"; {activations_line(plan)}"
    out = [f"plan: {'; '.join(where_lines(plan))}", f"plan: {updates}; {passes}",
           f"plan: predicted step {p.step:.2f}s = {w.tokens / p.step:,.0f} tokens/s, {tflops_text(w, p.step)}; "
           f"bound: {describe_bound(p.bound)} ({split_line(plan)})"]
    return out


def updates_split(gpu: int, groups: int) -> str:
    """How many groups each worker updates: ``GPU 1 group, CPU 5 groups``."""
    return ", ".join(f"{who} {n} group{'s' if n != 1 else ''}" for who, n in (("GPU", gpu), ("CPU", groups - gpu)))


def activations_line(plan: Plan) -> str:
    """Where the boundary activations of a plan that puts some in the host tier live."""
    n = len(plan.workload.layers)
    which = "every layer's input" if plan.act_host >= n else (
        f"the inputs of layers 0-{plan.act_host - 1}" if plan.act_host > 1 else "layer 0's input")
    return (f"boundary activations: {which} in dram ({format_size(plan.act_host_bytes)} a pass), "
            "the rest on the GPU (tiermem_activations)")


def tflops_text(w: Workload, seconds: float) -> str:
    """A step's TFLOP/s by 6·N and with attention counted (causal), e.g. "465 TFLOP/s (492 with attention)"."""
    return f"{figure(tflops(w, seconds))} TFLOP/s ({figure(tflops(w, seconds, attention=True))} with attention)"


def figure(value: float) -> str:
    """A rate as a person reads it: whole from 10 up (465), three significant digits below (a CPU's 0.00614)."""
    return f"{value:.0f}" if value >= 10 or value == 0 else f"{value:.3g}"


def report(plan: Plan, ga: int) -> dict:
    """Everything ``tiermem plan`` says, as data (its --json), with the advice."""
    p, w, m = plan.prediction, plan.workload, plan.machine
    by_kind: dict = {}
    for (_g, k), b in plan.group_bytes.items():
        by_kind[k] = by_kind.get(k, 0) + b
    tiers = {}
    for t in plan_tiers():
        tiers[t] = {"need": plan.need()[t], "budget": plan.budgets.get(t),
                    "kinds": {k: [str(g) for g in w.groups if plan.where.get((g, k)) == t] for k in KINDS
                              if any(plan.where.get((g, k)) == t for g in w.groups)}}
    bound_at = compute_bound_at(plan, ga)
    advised = recommended_at(plan, ga, bound_at)
    out = {"state_bytes": by_kind, "tiers": tiers, "activation_bytes": plan.activation_bytes,
           "hbm_usable": plan.hbm_room, "passes": plan.passes, "piece_rows": plan.piece_rows or None,
           "activations": {"host_boundaries": plan.act_host, "host_bytes": plan.act_host_bytes},
           "gpu_updates": None if plan.gpu_updates is None else [str(g) for g in w.groups if g in plan.gpu_updates],
           "prediction": {**p.to_json(), "tokens_per_s": w.tokens / p.step, "tflops": tflops(w, p.step),
                          "tflops_attention": tflops(w, p.step, attention=True),
                          "mfu": tflops(w, p.step) * 1e12 / m.gpu_peak,
                          "mfu_attention": tflops(w, p.step, attention=True) * 1e12 / m.gpu_peak},
           "tokens_per_step": w.tokens, "compute": w.timed, "machine": m.to_json(), "workload": w.to_json(),
           "compute_bound": None, "recommended": None, "advice": advice(plan, ga, bound_at, advised)}
    for key, at in (("compute_bound", bound_at), ("recommended", advised)):
        if at is not None:
            k, pr = at
            out[key] = {"gradient_accumulation_steps": k, "step_seconds": pr.step,
                        "tokens_per_s": w.tokens * k / ga / pr.step}
    return out


def advice(plan: Plan, ga: int, bound_at, advised=None) -> str | None:
    """One line when a change would make a step's tokens go through more than 10% faster: more tokens a step
    (as many as bring the rate within 10% of the compute-bound step's: ``advised``), or the disk."""
    p, w = plan.prediction, plan.workload
    now = w.tokens / p.step
    best = None
    if advised is not None and bound_at is not None:
        (k, pr), (k_cb, pr_cb) = advised, bound_at
        rate, top = w.tokens * k / ga / pr.step, w.tokens * k_cb / ga / pr_cb.step
        if rate > (1 + ADVICE_GAIN) * now:
            there = ("the step becomes compute-bound" if k == k_cb else
                     f"within {ADVICE_GAIN:.0%} of the compute-bound rate ({top:,.0f} tokens/s from {k_cb})")
            best = (rate, f"raise gradient_accumulation_steps to {k}: {rate:,.0f} tokens/s (+{rate / now - 1:.0%}), "
                          f"{there}")
    disk = disk_resource()
    if p.bound == disk or p.busy[disk] > 0.5 * p.step:
        rate = now * min(2.0, p.step / max(p.busy[GPU], 1e-9))
        if rate > (1 + ADVICE_GAIN) * now and (best is None or rate > best[0]):
            best = (rate, "the disk bounds the step: more DRAM (tiers.dram.budget) or a faster disk moves it "
                          f"toward {rate:,.0f} tokens/s")
    return best[1] if best else None


def service_plan_input(mcfg, dtype: torch.dtype, shape: Shape, loss_chunk: int, piece_rows="auto", keep=0):
    """What an attached trainer sends the service so that it plans the run: the step's workload, timed on this
    process's GPU (the CPU stand-in's for a small model), the HBM the step may use, and whether the planner chooses
    the layers that keep their activations (``keep``, tiermem_keep_activations: auto, as ``make`` does for an
    embedded run). ``piece_rows`` (tiermem_physical_batch_size): a number is the pieces' rows the workload is timed
    at; auto: the micro-batch's own (the service plans the placement for the trainer's step as it is)."""
    import psutil

    from tiermem.plan.planner import HBM_RESERVE

    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    m = Machine.h200("for the workload's estimate when the layer is not timed")
    rows = shape.rows if piece_rows == "auto" else fixed_rows(int(piece_rows), shape.rows)
    w = plan_workload.build(mcfg, dtype, rows, shape.seq, pieces.in_step(shape.micro_batches, shape.rows, rows), m,
                            device, loss_chunk)
    if cuda:
        room = int(torch.cuda.get_device_properties(device).total_memory * (1 - HBM_RESERVE)) - (1 << 30)
    else:  # (the CPU stand-in's "GPU" is a share of host memory, as an embedded run's)
        room = psutil.virtual_memory().available // 4
    keep_auto = keep == "auto" and keeps_activations(mcfg) and mcfg.moe is None
    return w, {"workload": w.to_json(), "hbm_room": int(room), "keep": keep_auto}


def from_service(told: dict, specs, w, micro_rows: int = 0) -> Plan:
    """The plan the service made of this run (``tiermem.service.planning``), as the run's own: placement, split,
    passes, the layers that keep their activations and the prediction, made again here from the same figures (``w``:
    the workload sent, at the pieces' rows; ``micro_rows``: a micro-batch's)."""
    from tiermem.plan.costmodel import Layout, predict
    from tiermem.plan.planner import sizes

    group_bytes, params = sizes(specs)
    where = {(g, k): t for g, k, t in told["where"]}
    m = Machine.from_json(told["machine"])
    gpu_updates = None if told.get("gpu_updates") is None else set(told["gpu_updates"])
    plan = Plan(where, group_bytes, 0, 0, 0, {})
    plan.passes, plan.gpu_updates = int(told["passes"]), gpu_updates
    plan.activation_budget, plan.activation_bytes = told.get("activation_budget"), int(told["activation_bytes"])
    plan.hbm_room, plan.machine, plan.workload, plan.params = int(told["hbm_room"]), m, w, params
    plan.keep = frozenset(told.get("keep") or ())  # (a service of an earlier version chose none)
    layout = Layout(where, gpu_updates or set(), plan.passes, keep=plan.keep,
                    write_through=bool(told.get("write_through")))
    plan.prediction = predict(layout, w, m, group_bytes, params)
    return _with_pieces(plan, micro_rows or w.micro_rows, w.micro_rows)


def keep_activations(plan: Plan, n, mcfg) -> None:
    """A number ``n`` of tiermem_keep_activations in the plan: the first ``n`` layers whose weights live in
    HBM (the executor picks the same), their recompute gone from the prediction (none while a load-balancing
    loss is on). ``auto`` was the planner's to choose (``make(keep="auto")``): nothing to do here."""
    from tiermem.plan.costmodel import predict
    from tiermem.plan.planner import kept_layers, layout_of

    if not n or n == "auto" or not keeps_activations(mcfg):
        return
    plan.keep = kept_layers(plan.where, plan.workload.layers, n)
    if not plan.keep:
        return
    plan.prediction = predict(layout_of(plan), plan.workload, plan.machine, plan.group_bytes, plan.params)
