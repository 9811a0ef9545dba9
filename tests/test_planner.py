"""The planner and its cost model on synthetic machine figures: budgets never exceeded, more room on a faster
tier never predicts a slower step, the hottest state goes up first, pinned kinds stay, and the cost model's
split agrees with a separate simulation of the schedule written here."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tiermem.config import load_store_config
from tiermem.errors import BudgetError
from tiermem.plan.costmodel import Layout, predict, rank_of
from tiermem.plan.machine import Machine
from tiermem.plan.planner import gpu_update_bytes, plan_step, resplit, sizes
from tiermem.plan.workload import Workload
from tiermem.specs import TensorSpec, state_name

GiB = 1 << 30
KINDS5 = ("param", "master", "grad", "exp_avg", "exp_avg_sq")


def specs_for(layers: int, layer_params: int, embed_params: int) -> list[TensorSpec]:
    """A bf16 model's state: each group one tensor of each kind (param bf16, the rest fp32)."""
    out = []
    for g, n in [("embed", embed_params), *((i, layer_params) for i in range(layers)), ("head", embed_params)]:
        base = f"w{g}"
        out.append(TensorSpec(base, (n,), torch.bfloat16, "param", g))
        for k in KINDS5[1:]:
            out.append(TensorSpec(state_name(base, k), (n,), torch.float32, k, g))
    return out


def workload(layers: int, fwd: float = 0.1, tokens: int = 65536, micro_batches: int = 16,
             boundary: int = 64 << 10, working: int = 1 * GiB) -> Workload:
    f = {i: fwd for i in range(layers)}
    b = {i: 3 * fwd for i in range(layers)}
    f.update(embed=0.0, head=fwd)
    b.update(embed=0.0, head=2 * fwd)
    return Workload(list(range(layers)), "embed", "head", f, b, tokens, micro_batches, boundary, working, 6e9)


def machine(**kw) -> Machine:
    m = Machine.h200("synthetic")
    kw.setdefault("cpu_in_run", 1.0)  # (the CPU worker at its probed rates unless a test says otherwise)
    kw.setdefault("pass_cost", 0.0)  # (a later pass costs its copies only, unless a test says otherwise)
    return dataclasses.replace(m, **kw)


def store_cfg(placement="auto", nvme: bool = True):
    data = {"placement": placement, "tiers": {"gpu": {"device": "cpu"}}}
    if nvme:
        data["tiers"]["nvme"] = {"path": "/nonexistent/tiermem"}
    return load_store_config(data)


def plan(layers=8, layer_params=50_000_000, embed=100_000_000, gpu=None, dram=40 * GiB, nvme=200 * GiB,
         placement="auto", w=None, m=None, keep_auto=False, **mkw):
    specs = specs_for(layers, layer_params, embed)
    m = m or machine(gpu_memory=gpu or 80 * GiB, **mkw)
    return plan_step(specs, store_cfg(placement), w or workload(layers), m,
                     {"gpu": gpu, "dram": dram, "nvme": nvme}, cuda=True, keep_auto=keep_auto)


def probe_with(rows: dict) -> Path:
    """The H200 machine's probe file (tests/golden) with ``rows`` (link -> figure) added, written anew."""
    probe = json.loads(Path("tests/golden/probe_h200.json").read_text())
    probe["rows"] += [{"link": link, "tiermem": v} for link, v in rows.items()]
    path = Path(tempfile.mkdtemp()) / "p.json"
    path.write_text(json.dumps(probe))
    return path


def tier_bytes(p) -> dict:
    out = {"gpu": 0, "dram": 0, "nvme": 0}
    for key, t in p.where.items():
        out[t] += p.group_bytes[key]
    return out


@settings(max_examples=40, deadline=None)
@given(gpu=st.integers(4, 120), dram=st.integers(2, 100), layers=st.integers(2, 12),
       nvme_read=st.floats(0.5, 8.0), cpu=st.floats(0.5, 8.0), kept_mib=st.sampled_from([0, 64, 1024, 8192]))
def test_budgets_are_never_exceeded(gpu, dram, layers, nvme_read, cpu, kept_mib):
    w = dataclasses.replace(workload(layers), kept_bytes=kept_mib << 20)  # (kept graphs: chosen with the state)
    try:
        p = plan(layers=layers, gpu=gpu * GiB, dram=dram * GiB, m=machine(gpu_memory=gpu * GiB,
                 nvme_read=nvme_read * 1e9, cpu_adamw=cpu * 1e9), w=w, keep_auto=True)
    except BudgetError as e:  # the planner's own refusal, never a plan the budget check then rejects
        assert ("does not fit" in str(e) or "do not fit" in str(e) or "left beside the activations" in str(e)
                or "is left" in str(e)) and not str(e).startswith("placement does not fit"), str(e)
        return
    need = p.need()
    # (with the GPU optimizer's working copies of the streamed groups it updates)
    # and the graphs of the layers that keep their activations, every micro-batch of a pass
    kept = len(p.keep) * w.kept_bytes * -(-w.micro_batches // p.passes)
    assert (need["gpu"] + p.activation_bytes + gpu_update_bytes(p.where, p.group_bytes, p.gpu_updates) + kept
            <= p.hbm_room)
    assert all(p.where[(g, "param")] == "gpu" for g in p.keep)
    if p.passes > 1 and not p.act_host:  # (beside the activations: the largest group's gradient partials read back
        largest = max(b for (_, k), b in p.group_bytes.items() if k == "grad")  # on later passes)
        assert p.activation_bytes == w.activation_bytes(p.passes) + largest
        assert p.activation_budget == w.activation_bytes(p.passes) - w.working_bytes
    if p.act_host:  # (some boundaries in DRAM: those on the GPU and two in flight in HBM, the rest in the arena)
        largest = max(b for (_, k), b in p.group_bytes.items() if k == "grad") if p.passes > 1 else 0
        assert p.activation_bytes == w.hbm_activation_bytes(p.passes, p.act_host) + largest
        assert p.act_host_bytes >= p.act_host * w.layer_boundary_bytes(p.passes)
        assert p.activation_budget == w.layer_boundary_bytes(p.passes) * (layers + 1)
    assert need["dram"] <= dram * GiB  # (the activations there included)
    assert need["nvme"] <= 200 * GiB
    assert p.prediction.step > 0


def test_several_passes_leave_hbm_for_the_largest_groups_gradient_partials():
    """On a pass after the first, a group's gradient partial sums come back into a buffer beside its new
    gradient: the planner leaves the largest group's (fp32) room, so a step that needs several passes takes one
    more or less state in HBM than the activations alone would (the 14B run planned without it ran out of
    memory)."""
    w = workload(8, micro_batches=64, boundary=8 << 20, working=2 * GiB)  # (boundaries of 64 micro-batches: 32 GiB)
    p = plan(layers=8, layer_params=100_000_000, embed=400_000_000, gpu=24 * GiB, w=w, m=machine(gpu_memory=24 * GiB))
    largest = max(b for (_, k), b in p.group_bytes.items() if k == "grad")
    assert largest >= 1.6e9 and p.passes > 1  # (the embedding's fp32 gradient)
    assert p.activation_bytes == w.activation_bytes(p.passes) + largest
    assert p.need()["gpu"] + p.activation_bytes <= p.hbm_room
    assert w.activation_bytes(p.passes - 1) + largest > p.hbm_room - p.need()["gpu"]  # (no fewer passes fit)


def test_a_gpu_too_small_for_a_pass_and_its_partials_says_so():
    """When one micro-batch's activations fit the GPU but not with the gradient partials a pass after the first
    reads back, the refusal names those two, not the state (which DRAM would hold)."""
    w = workload(8, micro_batches=4, working=64 << 20)
    act = w.activation_bytes(w.micro_batches)
    with pytest.raises(BudgetError) as e:
        plan(layers=8, layer_params=100_000_000, embed=400_000_000, gpu=act + (64 << 20), w=w,
             m=machine(gpu_memory=64 * GiB))
    assert "a pass of one micro-batch needs" in str(e.value) and "gradient partial sums" in str(e.value), str(e.value)
    assert "training state" not in str(e.value)


@pytest.mark.parametrize("tier", ["gpu", "dram"])
def test_more_room_on_a_faster_tier_never_predicts_a_slower_step(tier):
    steps = []
    for gib in (20, 30, 40, 60, 80, 120):
        kw = {"gpu": gib * GiB} if tier == "gpu" else {"gpu": 20 * GiB, "dram": gib * GiB}
        # little compute and a slow CPU: where the state lives decides the step
        steps.append(plan(layers=10, layer_params=200_000_000, w=workload(10, fwd=0.005), cpu_adamw=0.5e9,
                          **kw).prediction.step)
    assert all(b <= a + 1e-9 for a, b in zip(steps, steps[1:])), steps
    assert steps[-1] < steps[0]  # and the room is used


def test_the_hottest_state_goes_up_first():
    p = plan(layers=10, layer_params=200_000_000, gpu=24 * GiB, dram=10 * GiB)
    order = ["embed", *range(10), "head"]
    tiers = ["gpu", "dram", "nvme"]
    resident = [g for g in order if all(p.where[(g, k)] == "gpu" for k in KINDS5)]
    assert resident and resident == order[: len(resident)]  # a prefix of the update order, whole groups
    # on NVMe the coldest kinds, of the last groups first
    assert any(t == "nvme" for t in p.where.values())
    for k in KINDS5:
        levels = [tiers.index(p.where[(g, k)]) for g in order]
        assert levels == sorted(levels), (k, levels)  # a later group never sits higher
    colder = ["exp_avg_sq", "exp_avg", "master", "grad", "param"]
    for n, k in enumerate(colder[1:], 1):  # a kind goes down only once every colder kind of streamed groups has
        if any(p.where[(g, k)] == "nvme" for g in order):
            assert all(p.where[(g, c)] == "nvme" for c in colder[:n] for g in order if g not in resident), k


def test_a_pinned_kind_stays_pinned():
    p = plan(layers=6, gpu=80 * GiB, dram=60 * GiB, placement={"exp_avg_sq": "nvme", "grad": "auto"})
    assert all(p.where[(g, "exp_avg_sq")] == "nvme" for g in ["embed", *range(6), "head"])
    assert any(p.where[(g, "grad")] == "gpu" for g in range(6))  # grad (auto) was planned
    p = plan(layers=6, gpu=80 * GiB, dram=60 * GiB, placement={"param": "dram"})
    assert all(p.where[(g, "param")] == "dram" for g in ["embed", *range(6), "head"])


def test_a_state_too_big_for_every_tier_is_refused_in_one_line_with_every_way_out():
    """The refusal names each way to the room it lacks, with the figure: a larger NVMe budget (or another disk of
    the NVMe share plus the shortfall), a larger DRAM budget, fewer activations in HBM, a larger GPU budget."""
    with pytest.raises(BudgetError) as e:
        plan(layers=8, gpu=8 * GiB, dram=4 * GiB, nvme=4 * GiB)
    msg = str(e.value)
    assert "does not fit" in msg and "\n" not in msg
    more = msg.split("; ")[1].split(" more is needed")[0]  # (the shortfall, e.g. "3.0 GiB")
    for way in (f"a tiers.nvme.budget {more} larger", "or a tiers.nvme.path on a disk with",
                f"a tiers.dram.budget {more} larger", f"a tiers.gpu.budget {more} larger"):
        assert way in msg, msg
    with pytest.raises(BudgetError) as e:  # (activations of 40 GiB a pass: giving some up gives the room)
        plan(layers=8, gpu=46 * GiB, dram=2 * GiB, nvme=2 * GiB, w=workload(8, working=40 * GiB))
    assert "fewer activations in HBM (a pass holds" in str(e.value), str(e.value)


def test_the_gpu_optimizer_gets_room_for_the_groups_it_streams_in_or_leaves_them_to_the_cpu():
    """A group the GPU updates without living in HBM needs its gradient and working copies there: the plan
    leaves that room, or the CPU updates the group."""
    p = plan(layers=8, gpu=12 * GiB, dram=40 * GiB)
    streamed = [g for g in p.gpu_updates if any(t != "gpu" for (h, _), t in p.where.items() if h == g)]
    used = sum(b for key, b in p.group_bytes.items() if p.where[key] == "gpu")
    assert used + p.slot_bytes * p.n_slots + p.activation_bytes + \
        gpu_update_bytes(p.where, p.group_bytes, p.gpu_updates) <= p.hbm_room
    if streamed:
        assert gpu_update_bytes(p.where, p.group_bytes, set(streamed)) >= 3 * p.group_bytes[(streamed[0], "master")]


def test_a_services_plan_keeps_no_state_in_hbm_and_leaves_the_gpu_worker_its_room():
    """A service's run (hbm_state False): every kind in DRAM or on NVMe whatever HBM there is, the GPU worker's
    copies within the trainer's HBM; without CUDA (gpu_worker False) the CPU updates every group."""
    specs = specs_for(8, 50_000_000, 100_000_000)
    w = workload(8)
    for room in (6 * GiB, 60 * GiB):
        p = plan_step(specs, store_cfg(), w, machine(gpu_memory=room), {"gpu": room, "dram": 12 * GiB,
                      "nvme": 200 * GiB}, cuda=False, hbm_state=False)
        assert "gpu" not in set(p.where.values())
        assert p.slot_bytes * p.n_slots + p.activation_bytes + \
            gpu_update_bytes(p.where, p.group_bytes, p.gpu_updates) <= p.hbm_room
    p = plan_step(specs, store_cfg(), w, machine(), {"gpu": 60 * GiB, "dram": 12 * GiB, "nvme": 200 * GiB},
                  cuda=False, hbm_state=False, gpu_worker=False)
    assert p.gpu_updates == set() and p.prediction.busy["cpu"] > 0


def test_a_trainers_workload_goes_to_the_service_and_back_or_is_refused_in_one_line():
    from tiermem.service.planning import plan_run
    from tiermem.service.requests import RequestError

    specs = specs_for(4, 1_000_000, 2_000_000)
    w = workload(4)
    assert Workload.from_json(w.to_json()) == w
    from tiermem.plan.resolve import resolve_auto

    raw = store_cfg()
    cfg = resolve_auto(raw, role="service")
    plan, share, told = plan_run(specs, cfg, raw, {"workload": w.to_json(), "hbm_room": 8 * GiB},
                                 lambda: machine())
    assert share == 0 and "gpu" in {t for _, _, t in told["where"]} and told["passes"] == plan.passes  # (HBM a tier)
    _, _, told = plan_run(specs, cfg, raw, {"workload": w.to_json(), "hbm_room": 8 * GiB}, machine,
                          owners={g: n % 2 for n, g in enumerate(["embed", *range(4), "head"])})
    assert all(t != "gpu" for _, k, t in told["where"] if k == "param")  # (several ranks: each reads every group's)
    assert plan_run(specs, cfg, raw, None, machine) is None  # nothing sent: the fixed rule
    bad = [("a list", "must be an object"), ({"workload": {}, "hbm_room": 1}, "workload.layers"),
           ({"workload": dict(w.to_json(), tokens=-1), "hbm_room": 1}, "workload.tokens"),
           ({"workload": dict(w.to_json(), fwd={"0": 1.0}), "hbm_room": 1}, "workload.fwd"),
           ({"workload": dict(w.to_json(), micro_batches=1 << 30), "hbm_room": 1}, "workload.micro_batches"),
           ({"workload": w.to_json(), "hbm_room": "lots"}, "hbm_room"),
           ({"workload": workload(5).to_json(), "hbm_room": 1 << 30}, "groups")]
    for asked, needle in bad:
        with pytest.raises(RequestError, match=needle):
            plan_run(specs, cfg, raw, asked, machine)


def test_kept_layers_skip_their_recompute_in_the_prediction():
    specs = specs_for(6, 50_000_000, 100_000_000)
    w = workload(6, fwd=0.1)
    gb, params = sizes(specs)
    where = {key: "gpu" for key in gb}
    base = predict(Layout(where, set(w.groups), 1), w, machine(), gb, params)
    kept = predict(Layout(where, set(w.groups), 1, keep=frozenset({0, 1})), w, machine(), gb, params)
    assert base.compute - kept.compute == pytest.approx(2 * 0.1)
    # over rows cut into chunks a kept layer skips only the q/k/v and attention's share of its forward
    w = dataclasses.replace(w, kept_saves=0.75)
    kept = predict(Layout(where, set(w.groups), 1, keep=frozenset({0, 1})), w, machine(), gb, params)
    assert base.compute - kept.compute == pytest.approx(2 * 0.1 * 0.75)
    assert Workload.from_json(w.to_json()).kept_saves == 0.75


def test_keep_auto_keeps_the_resident_layers_the_hbm_left_holds():
    from types import SimpleNamespace

    from trainer.planning.run_plan import keep_activations

    specs = specs_for(6, 10_000_000, 20_000_000)
    base = plan_step(specs, store_cfg(), workload(6), machine(gpu_memory=80 * GiB),
                     {"gpu": None, "dram": 40 * GiB, "nvme": 200 * GiB}, cuda=True).prediction.compute
    for kept_bytes, expect in ((1 << 20, 6), (1 << 40, 0)):
        w = dataclasses.replace(workload(6), kept_bytes=kept_bytes)
        p = plan_step(specs, store_cfg(), w, machine(gpu_memory=80 * GiB),
                      {"gpu": None, "dram": 40 * GiB, "nvme": 200 * GiB}, cuda=True, keep_auto=True)
        keep_activations(p, "auto", SimpleNamespace(moe=None))  # (nothing more: the planner chose)
        assert len(p.keep) == expect
        assert p.prediction.compute == pytest.approx(base - expect * w.fwd[0])
    w = workload(6)  # (n layers asked: the first n of those in HBM)
    p = plan_step(specs, store_cfg(), w, machine(gpu_memory=80 * GiB), {"gpu": None, "dram": 40 * GiB,
                  "nvme": 200 * GiB}, cuda=True)
    keep_activations(p, 2, SimpleNamespace(moe=None))
    assert p.keep == {0, 1} and all(p.where[(g, "param")] == "gpu" for g in p.keep)


def test_keep_auto_gives_hbm_from_state_to_kept_graphs_where_the_step_is_compute_bound():
    """All the state fits in HBM with no room left for a kept graph. In one pass a step, where the CPU updates
    the state of a few groups well within the compute, the planner moves it to DRAM and keeps layers; where
    moving it costs more than their recompute, the state stays; free to choose the passes, it does not add
    passes for kept graphs (the GPU runs found passes cost more than the cost model counts)."""
    specs = specs_for(8, 100_000_000, 100_000_000)  # 1.6 GB of state a layer
    w = dataclasses.replace(workload(8, fwd=0.1), kept_bytes=256 << 20)  # 4 GiB a layer for 16 micro-batches
    gb, _ = sizes(specs)
    room = sum(gb.values()) + w.activation_bytes(1) + 2 * GiB  # (HBM for all the state, little more)
    m = machine(gpu_memory=(room + GiB) / (1 - 0.06), cpu_adamw=4e9)
    budgets = {"gpu": None, "dram": 60 * GiB, "nvme": 200 * GiB}

    def planned(mm, keep_auto, passes=1):
        return plan_step(specs, store_cfg(), w, mm, budgets, cuda=True, keep_auto=keep_auto, fixed_passes=passes)

    plain, kept = planned(m, False), planned(m, True)
    assert not plain.keep and all(t == "gpu" for t in plain.where.values())
    assert kept.keep and any(t == "dram" for t in kept.where.values())
    assert all(kept.where[(g, "param")] == "gpu" for g in kept.keep)
    assert kept.prediction.step < plain.prediction.step * (1 - 0.005)
    drag = m.copy_drag * min(kept.prediction.busy["h2d"], kept.prediction.busy["d2h"])  # (beside copies both ways)
    assert kept.prediction.compute == pytest.approx(plain.prediction.compute - len(kept.keep) * 0.1 + drag)
    slow = dataclasses.replace(m, cpu_adamw=0.005e9, h2d=0.1e9, d2h=0.1e9)
    assert not planned(slow, True).keep
    free = planned(slow, True, passes=None)  # (more passes would leave the graphs room: not taken for them)
    assert free.passes == 1 and not free.keep and all(t == "gpu" for t in free.where.values())


def test_the_room_kept_for_the_export_binds_only_the_state_that_stays_on_nvme():
    """Gradients and moments on NVMe are discarded before the export: only the rest must leave the exported
    model's room (``nvme_kept``); a plan that needs master weights there beyond it is refused in one line."""
    specs = specs_for(8, 50_000_000, 100_000_000)
    m, w = machine(gpu_memory=8 * GiB), workload(8)
    p = plan_step(specs, store_cfg(), w, m, {"gpu": 8 * GiB, "dram": 5 * GiB, "nvme": 200 * GiB, "nvme_kept": 0},
                  cuda=True)
    on_nvme = {k for (g, k), t in p.where.items() if t == "nvme"}
    assert on_nvme and on_nvme <= {"exp_avg", "exp_avg_sq"}
    with pytest.raises(BudgetError) as e:  # DRAM so small that master weights must spill too
        plan_step(specs, store_cfg(), w, m, {"gpu": 8 * GiB, "dram": 4 * GiB, "nvme": 200 * GiB, "nvme_kept": 0},
                  cuda=True)
    assert "more is needed" in str(e.value) and "exported model" in str(e.value) and "\n" not in str(e.value)


# -- the cost model against a simulation written separately ---------------------------------------------

def simulate_streamed_cpu(w: Workload, m: Machine, gb: dict, params: dict, slots: int) -> dict:
    """The schedule of an all-DRAM, CPU-updated, one-pass step, followed process by process: the CPU updates
    groups in order from t=0; the forward fetches each group's weights once its update is done and a slot
    is free (a slot frees when the compute that used it ends); the backward fetches them again and sends
    each gradient home. The PCIe link each way serves transfers in the order they become ready, at the
    machine's duplex share of its rate alone; the compute stretches by its copy drag of the time both ways are
    busy (taken as the lesser)."""
    drag_share = m.copy_drag
    m = dataclasses.replace(m, h2d=m.h2d * m.duplex, d2h=m.d2h * m.duplex)
    order = w.groups
    done, t = {}, 0.0
    for g in order:
        t += params[g] / m.cpu_adamw
        done[g] = t
    h2d_free = d2h_free = 0.0
    gpu = 0.0
    ends: list[float] = []
    h2d_busy = d2h_busy = 0.0
    wait = 0.0

    def fetch(g, ready):
        nonlocal h2d_free, h2d_busy
        slot = ends[-slots] if len(ends) >= slots else 0.0
        start = max(ready, slot, h2d_free)
        h2d_free = start + gb[(g, "param")] / m.h2d
        h2d_busy += gb[(g, "param")] / m.h2d
        return h2d_free

    seq = [(g, "fwd") for g in [w.first, *w.layers]] + [(w.last, "loss")] + \
          [(g, "bwd") for g in reversed(w.layers)] + [(w.first, "embed_bwd")]
    grads = []
    for g, phase in seq:
        ready = done[g] if phase in ("fwd", "loss") else 0.0
        arrive = ready if phase == "embed_bwd" else fetch(g, ready)
        start = max(gpu, arrive)
        wait += start - gpu
        secs = w.fwd[g] if phase == "fwd" else (w.fwd[g] + w.bwd[g] if phase == "loss" else w.bwd[g])
        gpu = start + secs
        if phase != "embed_bwd":
            ends.append(gpu)
        if phase in ("bwd", "loss", "embed_bwd"):
            s = max(gpu, d2h_free)
            d2h_free = s + gb[(g, "grad")] / m.d2h
            d2h_busy += gb[(g, "grad")] / m.d2h
            grads.append(d2h_free)
    drag = drag_share * min(h2d_busy, d2h_busy)
    return {"end": max(gpu + drag, *grads), "h2d": h2d_busy, "d2h": d2h_busy, "cpu": t, "wait": wait, "drag": drag}


@pytest.mark.parametrize("cpu_rate,h2d", [(4e9, 55e9), (0.5e9, 55e9), (4e9, 2e9), (0.2e9, 1e9)])
def test_the_cost_model_agrees_with_a_simulation_of_the_schedule(cpu_rate, h2d):
    layers = 6
    specs = specs_for(layers, 40_000_000, 80_000_000)
    gb, params = sizes(specs)
    w = workload(layers, fwd=0.05)
    m = machine(cpu_adamw=cpu_rate, h2d=h2d, d2h=h2d)
    where = {key: "dram" for key in gb}
    p = predict(Layout(where, set(), 1, 3), w, m, gb, params)
    ref = simulate_streamed_cpu(w, m, gb, params, 3)
    assert p.busy["h2d"] == pytest.approx(ref["h2d"])
    assert p.busy["d2h"] == pytest.approx(ref["d2h"])
    assert p.busy["cpu"] == pytest.approx(ref["cpu"] + sum(params.values()) / m.cpu_copy)  # + the compute copy
    assert p.busy["gpu"] == pytest.approx(w.compute_seconds() + ref["drag"])
    assert p.details["finish"] == pytest.approx(ref["end"], rel=0.02) or cpu_rate != 4e9


def test_all_resident_is_compute_plus_the_gpu_update():
    layers = 4
    specs = specs_for(layers, 10_000_000, 20_000_000)
    gb, params = sizes(specs)
    w = workload(layers)
    m = machine()
    p = predict(Layout({k: "gpu" for k in gb}, set(), 1), w, m, gb, params)
    assert p.bytes == {"h2d": 0, "d2h": 0, "nvme_read": 0, "nvme_write": 0}
    assert p.step == pytest.approx(w.compute_seconds() + sum(params.values()) / m.gpu_adamw)
    assert p.bound == "gpu"


def test_near_equal_splits_keep_the_cpus_largest_share():
    """The update splits are tried with the CPU's largest share first, so that of near-equal predictions (the
    planner keeps the first) the one streaming the least state through the GPU worker is kept; the groups with
    state in HBM are always the GPU's."""
    from tiermem.plan.planner import _update_splits

    w = workload(8)
    where = {(g, k): ("gpu" if g in ("embed", 0, 1) else "dram") for g in w.groups for k in KINDS5}
    splits = list(_update_splits(where, w))
    assert splits[0] == {"embed", 0, 1} and splits[-1] == set(w.groups)
    assert [len(s) for s in splits] == sorted(len(s) for s in splits)
    assert list(_update_splits(where, w, gpu_worker=False)) == [{"embed", 0, 1}]


def test_the_link_both_ways_comes_from_the_machines_figures(tmp_path):
    """The copies run at the machine's duplex share of the link's rate and the compute stretches by its copy
    drag of the time both ways copy; a probe file's rows give both (a file without them: the H200's, said to
    be assumed)."""
    layers = 4
    specs = specs_for(layers, 10_000_000, 20_000_000)
    gb, params = sizes(specs)
    w = workload(layers)
    where = {key: "dram" for key in gb}
    ideal = predict(Layout(where, set(), 1), w, machine(duplex=1.0, copy_drag=0.0), gb, params)
    real = predict(Layout(where, set(), 1), w, machine(duplex=0.8, copy_drag=0.1), gb, params)
    assert real.busy["h2d"] == pytest.approx(ideal.busy["h2d"] / 0.8)
    assert real.busy["d2h"] == pytest.approx(ideal.busy["d2h"] / 0.8)
    assert real.compute == pytest.approx(ideal.compute + 0.1 * min(real.busy["h2d"], real.busy["d2h"]))
    probe = json.loads(Path("tests/golden/probe_h200.json").read_text())
    old = Machine.from_probe("tests/golden/probe_h200.json")
    assert "duplex" in old.assumed and old.duplex == 0.92 and old.copy_drag == 0.06
    probe["rows"] += [{"link": "arena <-> GPU, both ways at once", "tiermem": 0.85},
                      {"link": "matmuls beside copies both ways", "tiermem": 0.9}]
    (tmp_path / "p.json").write_text(json.dumps(probe))
    new = Machine.from_probe(tmp_path / "p.json")
    assert new.duplex == 0.85 and new.copy_drag == pytest.approx(0.1) and "duplex" not in new.assumed


def all_in_dram(**machine_kw):
    """The prediction of four layers' state all in DRAM, updated by the CPU worker, on the H200's figures with
    ``machine_kw``; and the groups' parameters."""
    specs = specs_for(4, 10_000_000, 20_000_000)
    gb, params = sizes(specs)
    where = {key: "dram" for key in gb}
    return predict(Layout(where, set(), 1), workload(4), machine(**machine_kw), gb, params), params


def test_the_cpu_workers_compute_copy_is_a_machine_figure():
    """The fp32 -> bf16 copy after each CPU update costs params / cpu_copy of the CPU (with master weights); the
    probe's "CPU compute copy" row sets it; a plan written before it had the figure replays with the H200's,
    said to be assumed."""
    fast, params = all_in_dram(cpu_copy=1e12)
    slow, _ = all_in_dram(cpu_copy=1e9)
    assert slow.busy["cpu"] - fast.busy["cpu"] == pytest.approx(sum(params.values()) * (1 / 1e9 - 1 / 1e12))
    assert "cpu_copy" in Machine.from_probe("tests/golden/probe_h200.json").assumed
    m = Machine.from_probe(probe_with({"CPU compute copy": 9.5}))
    assert m.cpu_copy == 9.5e9 and "cpu_copy" not in m.assumed
    old = m.to_json()
    del old["cpu_copy"]
    old["assumed"] = []
    again = Machine.from_json(old)
    assert again.cpu_copy == 8.0e9 and again.assumed == ["cpu_copy"]


def test_the_cpu_workers_rate_beside_the_links_copies_is_a_machine_figure():
    """A CPU update costs 1 / cpu_in_run of its time alone (the link's copies share the host's memory); the
    probe's "CPU update beside copies both ways" row sets the figure, else it is the H200's 0.75, said to be
    assumed; a slower worker moves updates from the CPU to the GPU where HBM allows."""
    alone, _ = all_in_dram(cpu_in_run=1.0)
    beside, _ = all_in_dram(cpu_in_run=0.5)
    assert beside.busy["cpu"] == pytest.approx(2 * alone.busy["cpu"])
    assert Machine.from_probe("tests/golden/probe_h200.json").cpu_in_run == 0.75
    assert "cpu_in_run" in Machine.from_probe("tests/golden/probe_h200.json").assumed
    m = Machine.from_probe(probe_with({"CPU update beside copies both ways": 0.6}))
    assert m.cpu_in_run == 0.6 and "cpu_in_run" not in m.assumed
    fast = plan(layers=8, gpu=None, dram=40 * GiB, m=machine(cpu_in_run=1.0))
    slow = plan(layers=8, gpu=None, dram=40 * GiB, m=machine(cpu_in_run=0.2))
    assert len(slow.gpu_updates) >= len(fast.gpu_updates)
    assert slow.prediction.busy["cpu"] <= fast.prediction.busy["cpu"] / 0.2


def test_nvme_traffic_is_each_resident_byte_read_and_written_once():
    layers = 4
    specs = specs_for(layers, 10_000_000, 20_000_000)
    gb, params = sizes(specs)
    where = {k: ("nvme" if k[1] in ("exp_avg", "exp_avg_sq") else "dram") for k in gb}
    w, m = workload(layers), machine()
    moments = sum(b for (g, k), b in gb.items() if k in ("exp_avg", "exp_avg_sq"))
    for gpu_updates in (set(), {"embed", 0, 1}):
        p = predict(Layout(where, gpu_updates, 1), w, m, gb, params)
        assert p.bytes["nvme_read"] == moments and p.bytes["nvme_write"] == moments
        # (one disk: its reads and writes one after the other, each at its rate alone times nvme_both)
        read = moments / (m.nvme_read * m.nvme_both)
        write = moments / (m.nvme_write * m.nvme_both)
        assert p.nvme_read == pytest.approx(read) and p.nvme_write == pytest.approx(write)
        assert p.busy["nvme"] == pytest.approx(read + write)


def test_the_disk_is_one_resource_its_gain_both_ways_a_machine_figure():
    """The disk reads and writes as one resource, each operation at its direction's rate alone times
    `nvme_both` (the full probe's "disk both ways" row, else the H200's, said to be assumed): a disk-bound step
    is as long as its reads and writes one after the other, shorter as the disk gains more from both at once.
    A probe of an earlier version, with each direction's share beside the other, gives the same figure."""
    layers = 4
    specs = specs_for(layers, 50_000_000, 20_000_000)
    gb, params = sizes(specs)
    where = {k: ("nvme" if k[1] in ("exp_avg", "exp_avg_sq") else "dram") for k in gb}
    w = workload(layers, fwd=0.001)  # (little compute: the disk bounds the step)
    one = predict(Layout(where, set(), 1), w, machine(nvme_both=1.0), gb, params)
    two = predict(Layout(where, set(), 1), w, machine(nvme_both=2.0), gb, params)
    assert one.busy["nvme"] == pytest.approx(one.nvme_read + one.nvme_write)
    assert two.busy["nvme"] == pytest.approx(one.busy["nvme"] / 2)
    assert one.step >= one.busy["nvme"] and two.step < one.step
    h200 = Machine.from_probe("tests/golden/probe_h200.json")
    assert h200.nvme_both == 0.94 and "nvme_both" in h200.assumed
    m = Machine.from_probe(probe_with({"disk both ways": 1.3}))
    assert m.nvme_both == 1.3 and "nvme_both" not in m.assumed
    old = Machine.from_probe(probe_with({"disk read beside writes": 1.0, "disk write beside reads": 0.5}))
    r, wr = old.nvme_read, old.nvme_write  # (equal bytes each way: 1/r + 1/w one after the other)
    assert old.nvme_both == pytest.approx((1 / r + 1 / wr) / max(1 / r, 1 / (0.5 * wr)))
    plan = Machine.h200("x").to_json()
    del plan["nvme_both"]
    plan.update(nvme_read_beside=1.0, nvme_write_beside=0.5)  # (a tiermem_plan.json of an earlier version)
    r, wr = plan["nvme_read"], plan["nvme_write"]
    assert Machine.from_json(plan).nvme_both == pytest.approx((1 / r + 1 / wr) / max(1 / r, 1 / (0.5 * wr)))
    plan["assumed"] = ["nvme_read_beside", "nvme_write_beside"]  # (shares it had assumed: nothing measured)
    got = Machine.from_json(plan)
    assert got.nvme_both == 0.94 and "nvme_both" in got.assumed and "nvme_read_beside" not in got.assumed


def test_the_quick_probe_times_the_disk_each_way_alone_and_both_at_once(tmp_path):
    """`disk_rates`: the disk's rates alone and its gain both ways at once, on one file it removes."""
    from tiermem.plan.machine import BOTH_RANGE, disk_rates

    got = disk_rates(str(tmp_path), size=8 << 20, block=1 << 20)
    assert got["nvme_read"] > 0 and got["nvme_write"] > 0
    assert BOTH_RANGE[0] <= got["nvme_both"] <= BOTH_RANGE[1]
    assert list(tmp_path.iterdir()) == []


# -- `tiermem plan` ----------------------------------------------------------------------------------------

GOLDEN = Path(__file__).parent / "golden"
SHAPE_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "tie_word_embeddings": False, "hidden_act": "silu"}


@pytest.fixture
def plan_yaml(tmp_path, monkeypatch):
    monkeypatch.chdir(Path(__file__).parent.parent)  # the probe file's path as the golden text shows it
    model = tmp_path / "llama-8b-shape"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SHAPE_8B))
    cfg = {"model_name_or_path": str(model), "tiermem_init": "random", "stage": "pt", "dataset": "demo_pt",
           "dataset_dir": "data", "cutoff_len": 4096, "output_dir": str(tmp_path / "out"), "bf16": True,
           "per_device_train_batch_size": 1, "gradient_accumulation_steps": 32,
           "tiermem": {"tiers": {"nvme": {"path": str(tmp_path / "nvme"), "budget": "58GiB"}}}}
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_plan(argv, capsys) -> tuple[int, str, str]:
    from trainer.plan_cli import main

    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the plan times a layer: the golden text is "
                                                      "the plan from the probe file alone")
def test_plan_for_a_probe_file_is_the_golden_text_and_json(plan_yaml, capsys, tmp_path):
    probe = "tests/golden/probe_h200.json"
    rc, text, err = run_plan([plan_yaml, "--probe", probe], capsys)
    assert rc == 0, err
    assert not (tmp_path / "out").exists()  # nothing written to output_dir
    rc, js, err = run_plan([plan_yaml, "--probe", probe, "--json"], capsys)
    data = json.loads(js)
    data.pop("plan_seconds")
    if os.environ.get("TIERMEM_REGOLD"):
        (GOLDEN / "plan_8b.txt").write_text(text)
        (GOLDEN / "plan_8b.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    assert text == (GOLDEN / "plan_8b.txt").read_text()
    assert data == json.loads((GOLDEN / "plan_8b.json").read_text())
    # what the golden plan says: no NVMe (HBM + DRAM hold the 134.6 GiB), compute-bound, within the budgets
    assert data["tiers"]["nvme"]["need"] == 0 and data["prediction"]["bound"] == "gpu"
    assert data["tiers"]["dram"]["need"] <= data["tiers"]["dram"]["budget"]


def test_plan_overrides_are_a_what_if(plan_yaml, capsys):
    probe = "tests/golden/probe_h200.json"
    _, js, _ = run_plan([plan_yaml, "--probe", probe, "--json", "tiermem.tiers.dram.budget=40GiB",
                         "tiermem.tiers.gpu.budget=80GiB"], capsys)
    small = json.loads(js)
    assert small["tiers"]["nvme"]["need"] > 0  # the state spilled to the disk
    assert small["tiers"]["gpu"]["need"] <= 80 * GiB and small["tiers"]["dram"]["need"] <= 40 * GiB


def test_plan_with_a_step_measured_elsewhere(plan_yaml, capsys, tmp_path):
    """--workload: the step of a `tiermem plan --json` file (as made on the GPU machine) is planned with as it
    is, not estimated again; a slower measured layer gives a slower prediction; another shape is refused."""
    probe = "tests/golden/probe_h200.json"
    _, js, _ = run_plan([plan_yaml, "--probe", probe, "--json"], capsys)
    first = json.loads(js)
    saved = tmp_path / "gpu_plan.json"
    slow = dict(first["workload"])
    slow["fwd"] = {g: 1.5 * t for g, t in slow["fwd"].items()}
    slow["bwd"] = {g: 1.5 * t for g, t in slow["bwd"].items()}
    saved.write_text(json.dumps(dict(first, workload=slow)))
    rc, js, err = run_plan([plan_yaml, "--probe", probe, "--json", "--workload", saved], capsys)
    assert rc == 0, err
    again = json.loads(js)
    assert again["workload"] == slow
    assert again["prediction"]["compute_seconds"] == pytest.approx(1.5 * first["prediction"]["compute_seconds"],
                                                                   rel=0.02)
    rc, _, err = run_plan([plan_yaml, "--probe", probe, "--workload", saved, "gradient_accumulation_steps=16"],
                          capsys)
    assert rc == 2 and err.count("\n") == 1 and "this run has 32 layers in 16" in err, err
    # without --probe, the figures of the machine the file was planned with
    rc, js, err = run_plan([plan_yaml, "--json", "--workload", saved], capsys)
    assert rc == 0, err
    there = json.loads(js)["machine"]
    assert there.pop("source").startswith(str(saved)) and there == {k: v for k, v in first["machine"].items()
                                                                   if k != "source"}
    saved.write_text(json.dumps(dict(first, machine=dict(first["machine"], h2d="fast"))))
    rc, _, err = run_plan([plan_yaml, "--workload", saved], capsys)
    assert rc == 2 and err.count("\n") == 1 and "machine figures" in err, err
    saved.write_text("[]")
    rc, _, err = run_plan([plan_yaml, "--probe", probe, "--workload", saved], capsys)
    assert rc == 2 and err.count("\n") == 1 and "not a `tiermem plan --json` file" in err, err


@pytest.mark.parametrize("extra,needle", [
    (["tiermem.tiers.dram.budget=4GiB", "tiermem.tiers.nvme.budget=4GiB"], "does not fit"),
    (["tiermem.placement.momentum=nvme"], "unknown kind 'momentum'"),
    (["tiermem.placement.exp_avg=tape"], "unknown tier 'tape'"),
])
def test_plan_refusals_are_one_line(plan_yaml, capsys, extra, needle):
    rc, out, err = run_plan([plan_yaml, "--probe", "tests/golden/probe_h200.json", *extra], capsys)
    assert rc == 2 and err.count("\n") == 1 and needle in err, err


@pytest.mark.parametrize("content", [None, "not json", '{"rows": 3}'])
def test_plan_refuses_an_unreadable_probe_file(plan_yaml, capsys, tmp_path, content):
    probe = tmp_path / "probe.json"
    if content is not None:
        probe.write_text(content)
    rc, out, err = run_plan([plan_yaml, "--probe", probe], capsys)
    assert rc == 2 and err.count("\n") == 1 and "probe file" in err, err


def test_the_run_corrects_its_prediction_and_names_what_was_off():
    from trainer.planning.plan_watch import PlanWatch
    from trainer.run.executor import StepResult

    p = plan(layers=6, gpu=80 * GiB)
    watch = PlanWatch(p)
    predicted = watch.predicted
    slow = lambda compute, wait=0.0: StepResult(1.0, 1.0, 100, compute + wait, 0.0, wait, {})
    said = [line for n in range(3) for line in watch.observe(n, slow(p.prediction.compute * 1.3))]
    assert said and "corrected" in said[0] and watch.predicted == pytest.approx(predicted * 1.3, rel=0.05)
    # steady steps now 40% slower than the corrected prediction, all of it waiting for the optimizer
    extra = watch.predicted * 0.4
    lines = [line for n in range(3, 8) for line in watch.observe(n, slow(watch.prediction.compute, extra))]
    assert len(lines) == 1 and "waiting for the optimizer" in lines[0] and "+" in lines[0]


def test_the_run_corrects_the_cpu_workers_rate_from_its_updates():
    """The CPU worker's seconds of AdamW and compute copy an update, as the optimizer's split says, against the
    plan's: the prediction again at the rates measured, said in the correction's line and kept as ``measured``."""
    from trainer.planning.plan_watch import PlanWatch
    from trainer.run.executor import StepResult

    p = plan(layers=6, gpu=6 * GiB, w=workload(6, fwd=0.05))
    planned = p.prediction.busy["cpu"]
    assert planned > 0, "the plan should give the CPU worker some groups"
    watch = PlanWatch(p)
    step = StepResult(1.0, 1.0, 100, p.prediction.compute, 0.0, 0.0, {})
    split = {"cpu_adamw": planned * 1.5, "cpu_compute_copy": planned * 0.5, "gpu_path": 9.0}
    said = [line for n in range(3) for line in watch.observe(n, step, split)]
    assert len(said) == 1 and "the CPU worker by its updates (x2.00" in said[0], said
    assert watch.prediction.busy["cpu"] == pytest.approx(2 * planned)
    m = watch.measured
    assert m["cpu_factor"] == pytest.approx(2.0) and m["cpu_adamw"] == pytest.approx(p.machine.cpu_adamw / 2)
    assert m["compute_factor"] == pytest.approx(1.0) and m["predicted_step_seconds"] == watch.predicted
    unsplit = PlanWatch(p)  # (an optimizer that does not say: the CPU figures stay)
    assert [line for n in range(3) for line in unsplit.observe(n, step, {})] and \
        unsplit.prediction.busy["cpu"] == pytest.approx(planned)


def test_the_run_corrects_the_disks_rate_from_the_traffic_of_the_update_it_waited_for():
    """The disk's bytes each way in a step and its busy time either way, against what the plan gives those bytes:
    the prediction again at the disk's rate in the run (the 14B on the H200 machine: 94 GB both ways in 61 s,
    where its quick probe gave 48 s); said in the correction's line, kept as ``measured``; a step that moved
    too little to tell leaves the disk as planned."""
    from trainer.planning.plan_watch import PlanWatch
    from trainer.run.executor import StepResult

    p = plan(layers=8, gpu=8 * GiB, dram=4 * GiB, w=workload(8, fwd=0.05))
    m = p.machine
    read, write = p.prediction.bytes["nvme_read"], p.prediction.bytes["nvme_write"]
    assert read > 0 and write > 0, "the plan should keep state on NVMe"
    planned = (read / m.nvme_read + write / m.nvme_write) / m.nvme_both
    step = StepResult(1.0, 1.0, 100, p.prediction.compute, 0.0, 0.0, {})
    watch = PlanWatch(p)
    said = [line for n in range(3) for line in watch.observe(n, step, {}, (read, write, planned * 1.25))]
    assert len(said) == 1 and "the disk by its traffic (x0.80" in said[0], said
    assert watch.measured["disk_factor"] == pytest.approx(0.8)
    assert watch.prediction.busy["nvme"] == pytest.approx(p.prediction.busy["nvme"] * 1.25, rel=1e-6)
    assert watch.prediction.step > p.prediction.step
    little = PlanWatch(p)
    said = [line for n in range(3) for line in little.observe(n, step, {}, (1 << 20, 1 << 20, 2.0))]
    assert "disk" not in said[0] and "disk_factor" not in little.measured
    assert little.prediction.busy["nvme"] == pytest.approx(p.prediction.busy["nvme"])


def test_a_run_whose_cpu_worker_is_slow_splits_its_updates_again_within_the_hbm_it_has():
    """``resplit``: for the plan's placement as it is, the split the figures measured in the run predict fastest,
    among those whose GPU worker's HBM fits beside what the plan placed; the run's watch takes it when the CPU
    worker measured slower than planned and it predicts at least 2% faster (never when not allowed to)."""
    from trainer.planning.plan_watch import PlanWatch
    from trainer.run.executor import StepResult

    p = plan(layers=6, gpu=8 * GiB, w=workload(6, fwd=0.05))
    p = dataclasses.replace(p, hbm_room=p.hbm_room + 6 * GiB)  # (room the plan left, for the GPU worker)
    base = set(p.gpu_updates)
    assert len(base) < len(p.workload.groups)
    slow_cpu = dataclasses.replace(p.machine, cpu_adamw=p.machine.cpu_adamw / 20, cpu_copy=p.machine.cpu_copy / 20)
    gpu, pred = resplit(p, p.workload, slow_cpu)
    at_plan = predict(Layout(p.where, base, p.passes, keep=p.keep), p.workload, slow_cpu, p.group_bytes, p.params)
    assert len(gpu) > len(base) and base <= gpu and pred.step < at_plan.step
    per_kept = p.workload.kept_bytes * -(-p.workload.micro_batches // p.passes)
    used = (p.activation_bytes + sum(b for k, b in p.group_bytes.items() if p.where[k] == "gpu")
            + p.slot_bytes * p.n_slots + len(p.keep) * per_kept)
    assert used + gpu_update_bytes(p.where, p.group_bytes, gpu) <= p.hbm_room
    assert used + gpu_update_bytes(p.where, p.group_bytes, base) <= p.hbm_room  # (the plan's own fits too)
    tight = dataclasses.replace(p, hbm_room=used + gpu_update_bytes(p.where, p.group_bytes, base))
    found = resplit(tight, p.workload, slow_cpu)
    assert found is not None and gpu_update_bytes(p.where, p.group_bytes, found[0]) <= \
        gpu_update_bytes(p.where, p.group_bytes, base)
    step = StepResult(1.0, 1.0, 100, p.prediction.compute, 0.0, 0.0, {})
    split = {"cpu_adamw": p.prediction.busy["cpu"] * 20}
    for may in (True, False):
        q = dataclasses.replace(p, gpu_updates=set(base))
        watch = PlanWatch(q, may_resplit=may)
        said = [line for n in range(3) for line in watch.observe(n, step, split)]
        if may:
            assert watch.resplit_to == gpu and q.gpu_updates == gpu and "split again" in said[-1], said
            assert watch.predicted == pytest.approx(pred.step) and watch.measured["gpu_updates"]
        else:
            assert watch.resplit_to is None and q.gpu_updates == base and len(said) == 1


@pytest.mark.parametrize("passes", [9, 24, 60])
def test_a_step_of_many_passes_extends_the_last_simulated_pass(passes):
    """A step of more than SIM_PASSES passes (7 and 8 simulated, the rest extended by the last one's share)
    predicts what the whole simulation does: every pass after the first runs alike."""
    from tiermem.plan.costmodel import _simulate

    p = plan(layers=6, gpu=8 * GiB, w=workload(6, fwd=0.05), nvme=200 * GiB, dram=4 * GiB)
    w = p.workload
    wk = w.scaled(w.tokens * passes * 2 // w.micro_batches, passes * 2)
    layout = Layout(p.where, p.gpu_updates, passes)
    whole = _simulate(layout, wk, p.machine, p.group_bytes, p.params)
    ext = predict(layout, wk, p.machine, p.group_bytes, p.params)
    assert ext.step == pytest.approx(whole.step, rel=1e-6) and ext.bound == whole.bound
    assert ext.wait_transfer == pytest.approx(whole.wait_transfer, rel=1e-6, abs=1e-9)
    assert ext.wait_optimizer == pytest.approx(whole.wait_optimizer, rel=1e-6, abs=1e-9)
    assert all(ext.busy[r] == pytest.approx(whole.busy[r], rel=1e-6, abs=1e-9) for r in whole.busy)
    assert all(ext.bytes[k] == pytest.approx(whole.bytes[k], rel=1e-6, abs=1e-9) for k in whole.bytes)


@pytest.mark.parametrize("passes", [4, 20])
def test_each_pass_beyond_the_first_costs_the_gpu_for_every_group_summed_outside_hbm(passes):
    """Machine.pass_cost (13 ms on the H200: the 14B runs, tools/profile_step.py --passes): each pass after the first
    adds it to the GPU's compute for every group whose gradient lives outside HBM (its partial sums go home and come
    back); a group whose gradient lives in HBM sums it there and costs nothing more. Beyond SIM_PASSES as well."""
    p = plan(layers=6, gpu=8 * GiB, w=workload(6, fwd=0.05), nvme=200 * GiB, dram=4 * GiB)
    w = p.workload
    wk = w.scaled(w.tokens * passes * 2 // w.micro_batches, passes * 2)
    layout = Layout(p.where, p.gpu_updates, passes)
    free = predict(layout, wk, dataclasses.replace(p.machine, pass_cost=0.0), p.group_bytes, p.params)
    paid = predict(layout, wk, dataclasses.replace(p.machine, pass_cost=0.01), p.group_bytes, p.params)
    outside = [g for g in w.groups if p.where[(g, "grad")] != "gpu"]
    assert 0 < len(outside) < len(w.groups)
    assert paid.compute - free.compute == pytest.approx(0.01 * (passes - 1) * len(outside))
    one = Layout(p.where, p.gpu_updates, 1)
    assert predict(one, w, dataclasses.replace(p.machine, pass_cost=0.01), p.group_bytes, p.params).compute == \
        pytest.approx(predict(one, w, dataclasses.replace(p.machine, pass_cost=0.0), p.group_bytes, p.params).compute)


def test_a_micro_batch_in_pieces_pays_each_layers_cost_a_piece():
    """Workload.piece_seconds (a layer's cost each piece whatever its tokens: Machine.gpu_piece_rate): cutting each
    of 8 micro-batches of 4 rows into pieces adds it to every layer's backward for each further piece; the loss's and
    the FLOPs' seconds stay; a workload's JSON carries it."""
    w = dataclasses.replace(workload(4, micro_batches=8), micro_rows=4, piece_seconds=0.002)
    half, one = w.in_pieces(2), w.in_pieces(1)
    assert (half.micro_batches, one.micro_batches) == (16, 32)
    assert all(half.bwd[i] == pytest.approx(w.bwd[i] + 8 * 0.002) for i in w.layers)
    assert all(one.bwd[i] == pytest.approx(w.bwd[i] + 3 * 8 * 0.002) for i in w.layers)
    assert half.bwd["head"] == w.bwd["head"] and half.fwd == w.fwd
    assert Workload.from_json(json.loads(json.dumps(w.to_json()))).piece_seconds == 0.002


def test_the_estimated_loss_holds_one_chunk_of_a_pieces_tokens_whatever_its_rows():
    """The loss runs over a piece's tokens in chunks of loss_chunk_tokens, whatever its rows
    (trainer.model.layers.head_loss_backward): estimated at 2 rows of 4096 tokens it holds one 4096-token chunk's
    fp32 logits and their gradient, as at 1 row; only the layer's working set doubles (it once counted a chunk a
    row: 5 GB too many for the 14B's 2 x 4096, which pushed its state to NVMe)."""
    from trainer.model.config import model_config_from_dict
    from trainer.planning import plan_workload

    cfg = model_config_from_dict(SHAPE_8B)
    one, two = (plan_workload.build(cfg, torch.bfloat16, rows, 4096, 4, Machine.h200("t"), torch.device("cpu"), 4096,
                                    time_it=False) for rows in (1, 2))
    assert two.layer_work_bytes == 2 * one.layer_work_bytes
    assert two.working_bytes - one.working_bytes == two.layer_work_bytes - one.layer_work_bytes


def test_steps_that_grow_are_reported_once():
    from trainer.planning.plan_watch import PlanWatch
    from trainer.run.executor import StepResult

    p = plan(layers=6, gpu=80 * GiB)
    watch = PlanWatch(p, start=10)
    base = max(p.prediction.compute, 1.0)
    step = lambda wait: StepResult(1.0, 1.0, 100, base + wait, 0.0, wait, {})
    said = []
    for n in range(12):  # flat, then the optimizer's wait grows by 0.2 s a step
        said += watch.observe(n, step(0.0 if n < 6 else 0.2 * (n - 5)))
    growing = [line for line in said if "growing" in line]
    assert len(growing) == 1 and "waiting for the optimizer" in growing[0] and "since step 13" in growing[0]
    flat = PlanWatch(p)
    assert not [line for n in range(12) for line in flat.observe(n, step(0.0)) if "growing" in line]


@pytest.mark.parametrize("gpu", [12 * GiB, 16 * GiB])
def test_the_embeddings_gradient_summed_in_its_hbm_home_leaves_its_room_to_state(gpu):
    """The embedding's fp32 gradient needs no tensor of its own when the embedding's whole state lives in HBM
    (the executor sums it in its home there): the planner gives that room to state or activations — never less
    state in HBM, never more passes — and keeps the embedding in HBM when it counts on it. A tied head's
    gradient is the embedding's anyway: nothing changes."""
    from tiermem.plan.planner import embed_resident

    w0 = workload(8, working=4 * GiB)
    w1 = dataclasses.replace(w0, embed_grad_bytes=2 * GiB)
    p0, p1 = plan(w=w0, gpu=gpu, dram=6 * GiB), plan(w=w1, gpu=gpu, dram=6 * GiB)
    pt = plan(w=dataclasses.replace(w1, tied=True), gpu=gpu, dram=6 * GiB)

    def hbm(p):
        return sum(b for k, b in p.group_bytes.items() if p.where[k] == "gpu")

    assert embed_resident(p1.where, w1)
    assert p1.activation_bytes == w1.activation_bytes(p1.passes, embed_home=True) + (
        max(b for (_, k), b in p1.group_bytes.items() if k == "grad") if p1.passes > 1 else 0)
    assert p1.passes <= p0.passes and hbm(p1) >= hbm(p0)
    assert (p1.passes, hbm(p1)) != (p0.passes, hbm(p0))  # (the room was used: the state does not all fit)
    assert (pt.passes, hbm(pt), pt.activation_bytes) == (p0.passes, hbm(p0), p0.activation_bytes)
    assert Workload.from_json(json.loads(json.dumps(w1.to_json()))).embed_grad_bytes == 2 * GiB


def test_the_advised_tokens_are_the_fewest_within_ten_percent_of_the_compute_bound_rate():
    """A step whose update waits on the disk by the same bytes whatever its tokens nears the compute-bound rate
    slowly: the advice is the fewest gradient_accumulation_steps within 10% of that rate (raising further helps
    less than the advice's threshold), not the compute-bound step twice as long; both are in the report."""
    from tiermem.plan.planner import compute_bound_at, predict_at, recommended_at
    from trainer.planning.run_plan import report

    ga = 16
    p = plan(layers=8, layer_params=200_000_000, gpu=20 * GiB, dram=8 * GiB,
             w=workload(8, fwd=0.05, micro_batches=ga, boundary=64 << 10))
    assert tier_bytes(p)["nvme"] > 0 and p.prediction.bound == "nvme"
    k_cb, pr_cb = compute_bound_at(p, ga)
    top = p.workload.tokens * k_cb / ga / pr_cb.step
    k, pr = recommended_at(p, ga, (k_cb, pr_cb))
    assert k < 0.6 * k_cb  # (the wait stays: half the micro-batches give 90% of the rate)
    assert predict_at(p, ga, k)[1] >= top / 1.1 > predict_at(p, ga, k - 1)[1]
    assert predict_at(p, ga, k)[0].step == pr.step
    got = report(p, ga)
    assert got["recommended"]["gradient_accumulation_steps"] == k
    assert got["compute_bound"]["gradient_accumulation_steps"] == k_cb
    assert got["advice"].startswith(f"raise gradient_accumulation_steps to {k}: ") and f"from {k_cb})" in got["advice"]
    # already past it: no advice to raise
    assert recommended_at(p, ga, (ga, p.prediction)) is None


def test_a_forward_waiting_for_its_update_is_the_updates_wait_not_the_transfers():
    """Moments on a slow disk, weights streamed: the next forward's fetch of a layer's weights starts when its
    update ends, so the compute's idle time is the update's (the step is bound by it), not the link's: the
    14B run on the H200 machine measured 53 s a step waiting for the optimizer and 0.4 s for transfers, where
    the model had called 43 s of it a wait for weights."""
    gb = {}
    where = {}
    layers = 4
    for g in ("embed", *range(layers), "head"):
        for k in KINDS5:
            gb[(g, k)] = (1 if k == "param" else 2) * GiB
            where[(g, k)] = "nvme" if k in ("exp_avg", "exp_avg_sq") else "dram"
    params = {g: GiB // 2 for g in ("embed", *range(layers), "head")}
    w = workload(layers, fwd=0.05)
    p = predict(Layout(where, set(), 1), w, machine(nvme_read=1e9, nvme_write=1e9), gb, params)
    assert p.bound in ("nvme", "wait_optimizer"), p
    assert p.wait_optimizer > 10 * max(p.wait_transfer, 1e-3), p


def test_a_rank_is_predicted_updating_only_the_groups_it_owns():
    """Several ranks of a host: a rank's GPU worker updates the groups it owns, its CPU worker its own with its
    share of the host's cores; the others' updates run on the peers' (their new weights still gate the forward).
    Two ranks owning half the groups each: half the GPU AdamW of one process, the same CPU time (half the groups
    on half the cores); the step no faster than one process's compute."""
    layers = 8
    specs = specs_for(layers, 50_000_000, 20_000_000)
    gb, params = sizes(specs)
    groups = ["embed", *range(layers), "head"]
    owners = {g: n % 2 for n, g in enumerate(groups)}
    w = workload(layers)
    for gpu_updates in (set(groups), set()):
        one = predict(Layout({k: "dram" for k in gb}, gpu_updates, 1), w, machine(), gb, params)
        rank = rank_of(owners, params)
        assert rank["ranks"] == 2 and len(rank["mine"]) == len(groups) // 2
        two = predict(Layout({k: "dram" for k in gb}, gpu_updates, 1, **rank), w, machine(), gb, params)
        mine = sum(params[g] for g in rank["mine"]) / sum(params.values())
        if gpu_updates:
            assert two.busy["gpu_adamw"] == pytest.approx(one.busy["gpu_adamw"] * mine)
            assert two.busy["cpu"] == 0
            assert two.bytes["h2d"] < one.bytes["h2d"]  # (the peers read their groups' state over their links)
        else:
            assert two.busy["cpu"] == pytest.approx(one.busy["cpu"] * mine * 2)
            assert two.bytes["h2d"] == one.bytes["h2d"]  # (every rank fetches every layer's weights)
        assert two.step >= two.compute
    assert rank_of(None, params) == {} and rank_of({g: 0 for g in groups}, params) == {}


def test_a_plan_of_several_ranks_predicts_the_rank_it_names():
    """The planner's prediction of a plan of several ranks is its busiest rank's (``layout_of``: the plan's layout
    as the cost model takes it), not one process's, in the plan and in the run's corrections alike."""
    from tiermem.plan.planner import layout_of
    from trainer.parallel.dp import owners

    layers = 8
    specs = specs_for(layers, 50_000_000, 20_000_000)
    own = owners(["embed", *range(layers), "head"], specs, 2)
    p = plan_step(specs, store_cfg(), workload(layers), machine(gpu_memory=80 * GiB),
                  {"gpu": None, "dram": 40 * GiB, "nvme": 200 * GiB}, cuda=True, owners=own)
    layout = layout_of(p)
    assert p.owners == own and layout.ranks == 2 and layout.mine == frozenset(g for g, r in own.items() if r == 0)
    again = predict(layout, p.workload, p.machine, p.group_bytes, p.params)
    assert again.step == pytest.approx(p.prediction.step) and again.busy == pytest.approx(p.prediction.busy)
    alone = predict(layout_of(p, mine=None, ranks=1), p.workload, p.machine, p.group_bytes, p.params)
    updates = ("gpu_adamw", "cpu")
    assert sum(again.busy[r] for r in updates) < sum(alone.busy[r] for r in updates)


def test_micro_batches_run_in_pieces_where_hbm_is_short():
    """The planner's physical micro-batch (trainer.planning.run_plan.search_pieces): micro-batches of 4 rows whose layer
    working set leaves too little HBM are refused whole but run as pieces of 2 rows (the working set scales with a
    piece's rows, the loss's does not); where the state fits in HBM beside the whole micro-batch, it stays whole."""
    from trainer.planning.run_plan import search_pieces

    specs = specs_for(8, 200_000_000, 100_000_000)  # (30.2 GiB of state)
    w = dataclasses.replace(workload(8, micro_batches=4), micro_rows=4, layer_work_bytes=60 * GiB,
                            head_work_bytes=2 * GiB, working_bytes=60 * GiB + 2 * GiB)
    m = machine(gpu_memory=80 * GiB)

    def plan_for(budgets):
        return lambda wk: plan_step(specs, store_cfg(), wk, m, budgets, cuda=True)

    tight = {"gpu": None, "dram": 4 * GiB, "nvme": 4 * GiB}  # (the state must mostly live in HBM)
    with pytest.raises(BudgetError):
        plan_for(tight)(w)
    p = search_pieces(4, w, plan_for(tight))
    assert (p.micro_rows, p.piece_rows) == (4, 2)
    assert p.workload.micro_batches == 8 and p.workload.working_bytes == 30 * GiB + 2 * GiB
    roomy = dataclasses.replace(w, layer_work_bytes=2 * GiB, working_bytes=4 * GiB)
    p = search_pieces(4, roomy, plan_for({"gpu": None, "dram": 40 * GiB, "nvme": 200 * GiB}))
    assert p.piece_rows == 4 and all(t == "gpu" for t in p.where.values())
    with pytest.raises(BudgetError):  # (even one row a piece leaves the state no room)
        search_pieces(4, w, plan_for({"gpu": 30 * GiB, "dram": 4 * GiB, "nvme": 4 * GiB}))


def test_micro_batches_merged_pay_each_layers_cost_a_piece_the_fewer():
    """Workload.in_pieces at a multiple of a micro-batch's rows: 8 micro-batches of 4 rows as 4 pieces of 8 (2
    merged each): every layer's backward pays the cost a piece 4 times less, the working set and a kept graph
    grow with a piece's rows, the loss's working set and the FLOPs' seconds stay."""
    w = dataclasses.replace(workload(4, micro_batches=8), micro_rows=4, piece_seconds=0.002, layer_work_bytes=GiB,
                            head_work_bytes=GiB // 2, working_bytes=GiB + GiB // 2, kept_bytes=100)
    two = w.in_pieces(8)
    assert (two.micro_batches, two.micro_rows, w.in_pieces(16).micro_batches) == (4, 8, 2)
    assert all(two.bwd[i] == pytest.approx(w.bwd[i] - 4 * 0.002) for i in w.layers)
    assert two.bwd["head"] == w.bwd["head"] and two.fwd == w.fwd and two.tokens == w.tokens
    assert (two.layer_work_bytes, two.working_bytes, two.kept_bytes) == (2 * GiB, 2 * GiB + GiB // 2, 200)


def merge_case(piece_seconds: float, layer_work: int):
    """Micro-batches of 4 rows, 8 a step, the state fitting HBM beside them: (today's plan, the merges' plan)."""
    from trainer.planning.run_plan import Shape, search_merges, search_pieces

    specs = specs_for(8, 50_000_000, 20_000_000)
    w = dataclasses.replace(workload(8, micro_batches=8), micro_rows=4, piece_seconds=piece_seconds,
                            layer_work_bytes=layer_work, head_work_bytes=GiB, working_bytes=layer_work + GiB)

    def plan_for(wk):
        return plan_step(specs, store_cfg(), wk, machine(gpu_memory=80 * GiB),
                         {"gpu": None, "dram": 40 * GiB, "nvme": 200 * GiB}, cuda=True)

    best = search_pieces(4, w, plan_for)
    return best, search_merges(Shape(4, 2048, 8), w, plan_for, best)


def test_auto_merges_micro_batches_where_predicted_faster_and_fitting():
    """tiermem_physical_batch_size auto (trainer.planning.run_plan.search_merges): where a layer's cost a piece
    makes larger pieces predicted more than 5% faster and they fit HBM, pieces of 4 micro-batches (the fastest);
    the plan line says so."""
    from trainer.planning.run_plan import MERGE_GAIN, lines

    best, merged = merge_case(0.02, GiB)
    assert best.piece_rows == 4 and merged is not None
    assert (merged.micro_rows, merged.piece_rows, merged.workload.micro_batches) == (4, 16, 2)
    assert merged.prediction.step < best.prediction.step * (1 - MERGE_GAIN)
    assert "pieces of 16 rows, each 4 micro-batches of 4 rows merged (tiermem_physical_batch_size)" in \
        "\n".join(lines(merged))
    assert "merged" not in "\n".join(lines(best))


@pytest.mark.parametrize("piece_seconds,layer_work,why", [
    (1e-5, GiB, "less than 5% faster"), (0.02, 50 * GiB, "larger pieces do not fit HBM")])
def test_auto_keeps_the_micro_batch_whole_unless_merging_gains_and_fits(piece_seconds, layer_work, why):
    """No merge where the prediction gains 5% or less (a small cost a piece), nor where 2 micro-batches' working set
    does not fit HBM (the planner refuses the larger piece)."""
    best, merged = merge_case(piece_seconds, layer_work)
    assert best.piece_rows == 4 and merged is None, why


def test_plan_says_where_the_boundary_activations_go(plan_yaml, capsys):
    """tiermem_activations: dram (every layer's input in the arena) in `tiermem plan`'s text and JSON, the arena's
    need counting them; gpu: none there."""
    probe = "tests/golden/probe_h200.json"
    rc, text, err = run_plan([plan_yaml, "--probe", probe, "tiermem_activations=dram"], capsys)
    assert rc == 0, err
    assert "boundary activations: every layer's input in dram" in text and "(boundary activations" in text, text
    _, js, _ = run_plan([plan_yaml, "--probe", probe, "--json", "tiermem_activations=dram"], capsys)
    data = json.loads(js)
    assert data["activations"]["host_boundaries"] == 32 and data["activations"]["host_bytes"] >= 32 * 32 * 4096 * 8192
    assert data["tiers"]["dram"]["need"] <= data["tiers"]["dram"]["budget"]
    _, js, _ = run_plan([plan_yaml, "--probe", probe, "--json", "tiermem_activations=gpu"], capsys)
    assert json.loads(js)["activations"] == {"host_boundaries": 0, "host_bytes": 0}
