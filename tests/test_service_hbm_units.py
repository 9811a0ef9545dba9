"""A service's state in HBM, in process (issue 43): the block the service owns and its trainer maps, the out-of-place
update's places there, the copies ``durability: step`` keeps and puts back, the planner's HBM for an attached run,
and the settings refused in one line."""

from __future__ import annotations

import socket

import pytest
import torch
import yaml

from tests.test_planner import GiB, machine, specs_for, workload
from tiermem.config import load_store_config
from tiermem.errors import ConfigError
from tiermem.plan.resolve import resolve_auto
from tiermem.service.planning import plan_run
from tiermem.specs import TensorSpec
from tiermem.tiers.extents import Extent
from tiermem.tiers.hbm_share import MappedBlock, OwnedBlock

HBM = {"param": "gpu", "grad": "gpu", "exp_avg": "gpu", "exp_avg_sq": "gpu"}


def _service(tmp_path, placement, durability="checkpoint", device="cpu", groups=1, share=1):
    """An in-process service over a fp32 model of ``groups`` one-tensor groups (w, or w0, w1, ...), every update the
    trainer's (``share`` 0: the service's CPU worker's), and a trainer connection (``device`` cuda: its arena in
    /dev/shm, where CUDA pins the pages)."""
    import os

    from tiermem.service.runs import Client
    from tiermem.service.server import Service
    from tiermem.store.layout import spec_to_json

    (tmp_path / "shm").mkdir()
    shm = "/dev/shm" if device == "cuda" else str(tmp_path / "shm")
    cfg = tmp_path / "serve.yaml"
    name = f"unit{os.getpid()}" if device == "cuda" else "unit"  # (/dev/shm: one of its own)
    cfg.write_text(yaml.safe_dump({"name": name, "placement": placement, "durability": durability,
                                   "optimizer": {"gpu_share": share},
                                   "tiers": {"gpu": {"device": device, "budget": "1MiB"},
                                             "dram": {"path": shm, "budget": "1MiB"}}}))
    svc = Service(str(cfg), str(tmp_path / "s.sock"), say=lambda _: None)
    ws = ["w"] if groups == 1 else [f"w{g}" for g in range(groups)]
    specs = [TensorSpec(n, (4, 4), torch.float32, k, g) for g, w in enumerate(ws) for n, k in
             ((w, "param"), (f"grad/{w}", "grad"), (f"exp_avg/{w}", "exp_avg"), (f"exp_avg_sq/{w}", "exp_avg_sq"))]
    optim = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "has_master": False,
             "decay": {w: True for w in ws}, "groups": list(range(groups))}
    hello = {"op": "hello", "id": 1, "run": "r1", "specs": [spec_to_json(s) for s in specs], "optim": optim}
    mine, theirs = socket.socketpair()
    return svc, Client(mine), theirs, hello


def _ok(reply: dict) -> dict:
    assert reply["ok"], reply
    return reply


@pytest.mark.parametrize("durability", ["checkpoint", "step"])
def test_the_services_hbm_is_mapped_by_its_trainer_and_updated_out_of_place(tmp_path, durability):
    """The hello reply describes the service's block; what the trainer writes through its mapping is the service's
    bytes; alloc hands out new places in HBM (the old state untouched), flip makes them the home; with durability:
    step the flip first copies the group's new state to DRAM, which puts it back into a block that lost it."""
    placement = HBM if durability == "checkpoint" else dict(HBM, grad="dram")
    svc, client, theirs, hello = _service(tmp_path, placement, durability)
    try:
        reply = _ok(svc.dispatch(client, hello))
        assert reply["hbm"]["kind"] == "memfd" and reply["layout"]["w"][0] == "gpu"
        block = MappedBlock(reply["hbm"], torch.device("cpu"))

        def write(place, value: float) -> None:  # what the trainer's GPU worker does through its mapping
            block.tensor[place[0]: place[0] + 64].copy_(torch.full((16,), value).view(torch.uint8))

        write(reply["layout"]["w"][1:], 1.0)
        _ok(svc.dispatch(client, {"op": "init", "id": 2, "run": "r1", "step": 0}))
        store = svc.run.store
        assert (store.read("w").result() == 1.0).all()
        _ok(svc.dispatch(client, {"op": "commit", "id": 3, "run": "r1", "step": 1, "lr": 0.1}))
        places = _ok(svc.dispatch(client, {"op": "alloc", "id": 4, "run": "r1", "step": 1, "group": 0}))["places"]
        assert all(places[n][0] != reply["layout"][n][1] for n in places)  # new places in HBM
        for place in places.values():
            write(place, 2.0)
        assert (store.read("w").result() == 1.0).all()  # (the old state whole until the flip)
        _ok(svc.dispatch(client, {"op": "flip", "id": 5, "run": "r1", "step": 1, "group": 0, "places": places}))
        svc.run.wait()
        assert svc.run.state.updated == 1 and store.catalog["w"].tier == "gpu"
        assert (store.read("w").result() == 2.0).all()
        mirrors = svc.run.guard.mirrors
        assert (mirrors is not None) == (durability == "step")
        if mirrors is not None:  # the block lost (a crash of the service), then put back from the copies
            for name in places:
                store.tiers.device.view(store.catalog[name].extent).zero_()
            mirrors.restore(svc.run.state.versions)
            assert all((store.read(n).result() == 2.0).all() for n in places)
        block.close()
        svc._close_run(keep=False)
    finally:
        theirs.close()
        svc.release()


def _plan(durability="checkpoint", owners=None):
    raw = load_store_config({"placement": "auto", "durability": durability,
                             "tiers": {"gpu": {"device": "cpu"}, "dram": {"budget": "40GiB"},
                                       "nvme": {"path": "/nonexistent/tiermem", "budget": "200GiB"}}})
    asked = {"workload": workload(8).to_json(), "hbm_room": 40 * GiB}
    specs = specs_for(8, 50_000_000, 100_000_000)
    return plan_run(specs, resolve_auto(raw, "service"), raw, asked, machine, owners=owners)[0]


def test_the_service_plans_an_attached_run_with_hbm_as_a_tier():
    """One rank: state in HBM, as an embedded run; several ranks (``owners``): a group's state in its owner's HBM,
    never its compute copy. durability: step: every gradient in the arena, and the write-through's bytes on the
    link from the GPU."""
    owners = {g: n % 2 for n, g in enumerate(["embed", *range(8), "head"])}
    plain, ranks, step = _plan(), _plan(owners=owners), _plan("step")
    assert "gpu" in plain.where.values() and "gpu" in ranks.where.values() and ranks.owners == owners
    assert all(t != "gpu" for (g, k), t in ranks.where.items() if k == "param")
    assert any(t == "gpu" for (g, k), t in step.where.items() if k != "grad")
    assert all(t == "dram" for (g, k), t in step.where.items() if k == "grad")
    in_hbm = sum(b for (g, k), b in step.group_bytes.items() if step.where[(g, k)] == "gpu")
    assert step.prediction.bytes["d2h"] >= in_hbm  # (each step's copies of the state in HBM)


def test_durability_step_is_a_services_and_keeps_the_gradients_in_dram(tmp_path):
    from tiermem.service.config import service_config
    from trainer.state import store_config

    with pytest.raises(ConfigError, match="a service's setting") as e:
        store_config({"durability": "step"})
    assert "\n" not in str(e.value)
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(yaml.safe_dump({"durability": "step", "placement": HBM,
                                   "tiers": {"gpu": {"device": "cpu"}, "dram": {"path": str(tmp_path)}}}))
    with pytest.raises(ConfigError, match="place grad on dram"):
        service_config(str(cfg))


def test_a_mapped_block_is_below_the_trainers_own_slots(tmp_path):
    """The trainer's device tier: the service's block at offsets below its size, its own slots above; it never
    allocates in the service's block."""
    from tiermem.tiers.gpu import GpuTier

    block = OwnedBlock(4096, torch.device("cpu"))
    owner = GpuTier(torch.device("cpu"), 4096, 0, 0, block=block)
    owner.view(Extent(512, 512)).fill_(7)
    trainer = GpuTier.map_shared(owner.describe(None), torch.device("cpu"), 1024, 2)
    assert (trainer.view(Extent(512, 512)) == 7).all()
    slot = trainer.acquire_slot()
    assert slot.extent.offset >= 4096
    trainer.view(slot.extent).fill_(1)
    assert (owner.view(Extent(0, 4096)) != 1).all()
    with pytest.raises(RuntimeError, match="the service alone allocates"):
        trainer.allocate(512)
    trainer.close()
    owner.close()
    block.close()


def test_the_services_block_is_kept_across_its_runs():
    """One block for all of a service's runs (torch keeps a freed shared block a killed trainer had opened): handed
    out again zeroed, made anew only when a run needs more."""
    from tiermem.service.hbm import ServiceHbm

    hbm = ServiceHbm(torch.device("cpu"))
    first = hbm(10_000)
    first.tensor.fill_(3)
    assert hbm(8_000) is first and (first.tensor == 0).all()
    bigger = hbm(100_000)
    assert bigger is not first and bigger.nbytes >= 100_000
    hbm.close()
    assert hbm.block is None


def test_serve_fresh_discards_the_hbm_block_a_clean_stop_left(tmp_path):
    """``tiermem serve --fresh`` removes, unread, the file a clean stop wrote of the state kept in HBM
    (``<name>.hbm`` beside the arena) with the arena and the run record (tiermem.service.discarding)."""
    from tiermem.service.server import Service

    svc, *_ = _service(tmp_path, HBM)
    svc.release()
    left = tmp_path / "shm" / "unit.hbm"
    left.write_bytes(b"\0" * 4096)
    said = []
    fresh = Service(str(tmp_path / "serve.yaml"), str(tmp_path / "s.sock"), fresh=True, say=said.append)
    fresh.release()
    assert not left.exists() and f"discarded {left}" in said, said


def _plans_of(shape: str, tmp_path, keep="auto", rows=4, seq=4096, micro_batches=4):
    """A model shape (tools/make_shape_run.py's) at 16 x 4096 tokens a step planned from the H200 machine's file,
    nothing timed: (embedded, as ``tiermem plan --machine`` plans it; attached, as a service on that machine plans it
    from what its trainer sends; what the service tells the trainer)."""
    import json
    import sys
    from pathlib import Path

    from tiermem.plan.machine_file import load_machine
    from tiermem.plan.planner import HBM_RESERVE
    from trainer.planning import plan_workload, run_plan
    from trainer.run.job import model_config
    from trainer.state import state_specs, store_config

    root = Path(__file__).parent.parent
    if str(root / "tools") not in sys.path:
        sys.path.insert(0, str(root / "tools"))
    from make_shape_run import SHAPES

    (tmp_path / shape).mkdir()
    (tmp_path / shape / "config.json").write_text(json.dumps(SHAPES[shape]))
    mcfg = model_config(tmp_path / shape, None)
    m = load_machine(root / "configs/machines/h200-pcie5-125g.yaml")
    scfg = store_config({"placement": "auto", "tiers": {"gpu": {"device": "auto"}}}, here=False)
    step, chunk = run_plan.Shape(rows, seq, micro_batches), 4096  # (default: 4 micro-batches of 4 rows of 4096)
    cpu = torch.device("cpu")
    embedded = run_plan.make(mcfg, torch.bfloat16, scfg, step, m, cpu, chunk, time_it=False,
                             budgets=run_plan.budgets_for(scfg, m), cuda=True, keep=keep)
    w = plan_workload.build(mcfg, torch.bfloat16, rows, seq, micro_batches, m, cpu, chunk, time_it=False)
    asked = {"workload": w.to_json(), "hbm_room": int(m.gpu_memory * (1 - HBM_RESERVE)) - (1 << 30),
             "keep": keep == "auto"}
    dram = run_plan.budgets_for(scfg, m)["dram"]  # (the machine's, not this one's)
    raw = load_store_config({"placement": "auto",
                             "tiers": {"gpu": {"device": "auto"}, "dram": {"path": str(tmp_path), "budget": dram}}})
    plan, _, told = plan_run(state_specs(mcfg, torch.bfloat16), resolve_auto(raw, "service"), raw, asked, lambda: m,
                             cuda=True)
    return embedded, plan, told


@pytest.mark.parametrize("shape", ["3b", "8b"])
def test_an_attached_run_is_planned_within_3_percent_of_the_embedded_one(tmp_path, shape):
    """The service plans the layers that keep their activations, as the embedded run does (issue 43): without them
    the attached 3B shape was predicted 1.069x its embedded twin from the H200's machine file (3.12 s against 2.92:
    every layer recomputed, where the embedded run keeps 8), measured 1.107x on that machine; now 1.027x (5 layers
    kept: docs/service.md says what holds the rest). The 8B shape (its state beyond the H200 machine's RAM): 1.025x,
    no layer kept (moving state off HBM for one more is not worth it there). Since the service's CPU worker updates
    in place where its crash loses the run anyway (state in HBM, durability: checkpoint), it is planned at the plain
    CPU AdamW rate, as the embedded run's: 1.001x and 1.016x, with as many CPU groups as the embedded run."""
    embedded, attached, told = _plans_of(shape, tmp_path)
    assert embedded.keep and told["keep"] == sorted(attached.keep)
    assert attached.keep or shape == "8b"
    ratio = attached.prediction.step / embedded.prediction.step
    assert ratio <= 1.02, (ratio, attached.prediction.step, embedded.prediction.step)
    groups = len(embedded.workload.groups)
    assert groups - len(attached.gpu_updates) >= groups - len(embedded.gpu_updates) - 1


def test_an_attached_run_never_plans_boundary_activations_in_dram(tmp_path):
    """The attached trainer keeps every boundary activation in its own HBM (the arena it maps is the service's): a
    service that planned some in DRAM (the 3B shape at one row of 524,288 tokens: 7 layers' inputs, 21.6 GiB) left
    the trainer holding them on the GPU beyond its plan. Such a row is now refused in one line that says why and what
    does place them in DRAM (tiermem-train without the service); a row whose activations fit on the GPU is planned
    as before."""
    from tiermem.errors import BudgetError

    with pytest.raises(BudgetError, match="an attached run keeps its boundary activations in HBM") as e:
        _plans_of("3b", tmp_path, rows=1, seq=524288, micro_batches=1)
    assert "\n" not in str(e.value) and "without tiermem_server" in str(e.value)
    (tmp_path / "short").mkdir()
    _, plan, _ = _plans_of("3b", tmp_path / "short", rows=1, seq=131072, micro_batches=1)
    assert plan.act_host == 0 and plan.prediction.step > 0


def test_a_plan_request_asks_for_kept_layers_with_true_or_false():
    """``plan.keep`` (the trainer's tiermem_keep_activations is auto) is checked as every field a request reads; a
    trainer of an earlier version, which does not send it, gets no kept layers, as then."""
    from tiermem.service.requests import RequestError

    raw = load_store_config({"placement": "auto", "tiers": {"gpu": {"device": "cpu"}, "dram": {"budget": "40GiB"}}})
    asked = {"workload": workload(8).to_json(), "hbm_room": 40 * GiB}
    specs = specs_for(8, 50_000_000, 100_000_000)
    with pytest.raises(RequestError, match="'plan.keep' must be true") as e:
        plan_run(specs, resolve_auto(raw, "service"), raw, dict(asked, keep="yes"), machine)
    assert "\n" not in str(e.value)
    assert plan_run(specs, resolve_auto(raw, "service"), raw, asked, machine)[2]["keep"] == []


def test_a_flip_asks_for_the_places_of_the_group_two_after_it(tmp_path, monkeypatch):
    """The GPU worker of a service's run asks for the first two groups' places itself (an attached trainer's come
    with its commit's reply) and for each later group's in the flip of the group two before it (one round trip a
    group, made while the worker updates the next group); the service's reply to such a flip carries the places,
    granted to that group. Here the service's own GPU worker updates the four groups its trainer owed, as when a
    trainer dies; its updates end at the state's new places."""
    from tiermem.service.journal import UndoGuard

    asked, flipped = [], []
    allocate, flip = UndoGuard.allocate, UndoGuard.flip
    monkeypatch.setattr(UndoGuard, "allocate", lambda self, g, *a: asked.append(g) or allocate(self, g, *a))
    monkeypatch.setattr(UndoGuard, "flip", lambda self, g, s, new, ahead=None: flipped.append(
        (g, ahead and ahead[0])) or flip(self, g, s, new, ahead))
    svc, client, theirs, hello = _service(tmp_path, HBM, groups=4)
    try:
        _ok(svc.dispatch(client, hello))
        _ok(svc.dispatch(client, {"op": "init", "id": 2, "run": "r1", "step": 0}))
        _ok(svc.dispatch(client, {"op": "commit", "id": 3, "run": "r1", "step": 1, "lr": 0.1}))
        store = svc.run.store
        before = {f"w{g}": store.catalog[f"w{g}"].extent.offset for g in range(4)}
        with svc.lock:
            svc._trainer_left(svc.run)
        svc.run.wait()
        assert svc.run.state.updated == 1
        assert [store.catalog.version(g) for g in range(4)] == [1] * 4
        assert sorted(asked) == [0, 1, 2, 3] and flipped == [(0, 2), (1, 3), (2, None), (3, None)], (asked, flipped)
        assert all(store.catalog[w].extent.offset != off for w, off in before.items())  # (out of place)
        svc._close_run(keep=False)
        # the trainer's side of it: a flip with ``next`` is answered as alloc for that group
        _ok(svc.dispatch(client, dict(hello, id=4, run="r2")))
        _ok(svc.dispatch(client, {"op": "init", "id": 5, "run": "r2", "step": 0}))
        granted = _ok(svc.dispatch(client, {"op": "commit", "id": 6, "run": "r2", "step": 1, "lr": 0.1,
                                            "grant": [0, 1]}))["places"]  # (the first two groups' places)
        assert [set(p) for p in granted] == [{f"{k}w{g}" for k in ("", "exp_avg/", "exp_avg_sq/")} for g in (0, 1)]
        assert set(svc.run.grants) == {0, 1}
        places = _ok(svc.dispatch(client, {"op": "alloc", "id": 7, "run": "r2", "step": 1, "group": 0}))["places"]
        reply = _ok(svc.dispatch(client, {"op": "flip", "id": 8, "run": "r2", "step": 1, "group": 0, "places": places,
                                          "next": 2}))
        assert set(reply["places"]) == {"w2", "exp_avg/w2", "exp_avg_sq/w2"} and 2 in svc.run.grants, reply
        bad = svc.dispatch(client, {"op": "flip", "id": 9, "run": "r2", "step": 1, "group": 2,
                                    "places": reply["places"], "next": 0})  # (group 0 is no longer owed)
        assert not bad["ok"] and "not owed" in bad["error"], bad
        with svc.lock:  # (groups 1 and 3: the service's once its trainer is gone)
            svc._trainer_left(svc.run)
        svc.run.wait()
        assert [svc.run.store.catalog.version(g) for g in range(4)] == [1] * 4
        svc._close_run(keep=False)
    finally:
        theirs.close()
        svc.release()


@pytest.mark.parametrize("lost", [False, True])
def test_the_services_cpu_worker_updates_in_place_only_where_its_crash_loses_the_run(tmp_path, monkeypatch, lost):
    """The service's CPU worker (gpu_share 0: every group's, their state in DRAM) writes out of place
    (new places, the old state whole) unless a crash of the service loses the run's state anyway
    (``lost_with_service``: state in HBM under durability: checkpoint); then in place, with no undo copy. Either way
    the groups' versions are journaled and the new weights are the fused AdamW's of the old state."""
    from tiermem.optim.kernels import fused_adamw
    from tiermem.service import server
    from tiermem.service.journal import UndoGuard

    monkeypatch.setattr(server, "lost_with_service", lambda record: lost)
    begun, begin = [], UndoGuard.begin
    monkeypatch.setattr(UndoGuard, "begin", lambda self, g, *a: begun.append(g) or begin(self, g, *a))
    svc, client, theirs, hello = _service(tmp_path, {k: "dram" for k in HBM}, groups=2, share=0)
    try:
        _ok(svc.dispatch(client, hello))
        _ok(svc.dispatch(client, {"op": "init", "id": 2, "run": "r1", "step": 0}))
        store = svc.run.store
        names = [f"{k}w{g}" for g in range(2) for k in ("", "exp_avg/", "exp_avg_sq/")]
        before = {n: store.catalog[n].extent.offset for n in names}
        for g in range(2):  # (what the trainer's backward would have left)
            store.write(f"grad/w{g}", torch.linspace(-1, 1, 16).reshape(4, 4) * (g + 1)).result()
        old = {g: [store.read(n).result().clone() for n in (f"w{g}", f"grad/w{g}")] for g in range(2)}
        _ok(svc.dispatch(client, {"op": "commit", "id": 3, "run": "r1", "step": 1, "lr": 0.1}))
        assert svc.run.guard.in_place == lost
        svc.run.wait()
        assert [store.catalog.version(g) for g in range(2)] == [1, 1] and svc.run.state.updated == 1
        assert all(store.catalog[n].extent.offset == before[n] for n in names) == lost and begun == []
        for g, (w, grad) in old.items():
            m, v = torch.zeros_like(w), torch.zeros_like(w)
            fused_adamw([w], [grad], [m], [v], 1, 0.1, 0.9, 0.999, 1e-8, 0.0, None, "cpu")
            assert torch.equal(store.read(f"w{g}").result(), w)
        svc._close_run(keep=False)
    finally:
        theirs.close()
        svc.release()


def test_the_service_splits_the_updates_again_at_its_cpu_workers_measured_rate(tmp_path):
    """The 8B shape planned by a service that believed its CPU AdamW at 0.6 of the H200 machine's rate: the trainer's
    GPU worker streams 16 groups' state through PCIe beside the forward. Its CPU worker measured 0.6 of the planned
    seconds (as the H200's in-place update did: 0.55 s for 0.90 planned): the split found again gives it 11 more
    groups (the GPU worker streams 5), predicted no slower; near the plan's rate, or before two updates, none."""
    import dataclasses

    from tiermem.plan import machine_file
    from tiermem.service.planning import split_again

    load = machine_file.load_machine
    try:
        machine_file.load_machine = lambda path: dataclasses.replace(load(path), cpu_adamw=load(path).cpu_adamw * 0.6)
        _, plan, _ = _plans_of("8b", tmp_path)
    finally:
        machine_file.load_machine = load
    planned = plan.prediction.busy["cpu"]
    assert len(plan.gpu_updates) == 29
    found = split_again(plan, [planned * 0.6] * 2)
    assert found is not None and len(found) == 18 and found < set(plan.gpu_updates)
    assert split_again(plan, [planned * 0.95, planned * 1.05]) is None and split_again(plan, [planned * 0.6]) is None


def test_a_split_found_again_is_told_with_one_commit_and_taken_at_the_next(tmp_path, monkeypatch):
    """The service's split found again (``split_again``, once its CPU worker has done two updates) goes to the trainer
    with the commit's reply (``next_split``: the trainer's next backward keeps those groups' gradients on its GPU) and
    both take it at the next commit: the groups the trainer then owes are the new ones, the service's CPU worker
    updates the rest, and the run's record keeps it for a restarted service."""
    import json
    import types

    from tiermem.service import updates

    svc, client, theirs, hello = _service(tmp_path, {k: "dram" for k in HBM}, groups=4)
    try:
        _ok(svc.dispatch(client, hello))
        _ok(svc.dispatch(client, {"op": "init", "id": 2, "run": "r1", "step": 0}))
        run = svc.run
        assert run.trainer.groups == {0, 1, 2, 3}
        run.plan = types.SimpleNamespace(prediction=types.SimpleNamespace(busy={"cpu": 1.0}), gpu_updates={0, 1, 2, 3})
        asked = []
        monkeypatch.setattr(updates, "split_again", lambda plan, seen: asked.append(list(seen)) or {0, 1})
        replies = []
        for step in (1, 2, 3, 4):
            replies.append(_ok(svc.dispatch(client, {"op": "commit", "id": 10 + step, "run": "r1", "step": step,
                                                     "lr": 0.1})))
            if step <= 2:
                assert "next_split" not in replies[-1]
                run.cpu_seen.append(0.5)  # (what the CPU worker's updates would have measured)
            assert run.owed == ({0, 1} if step == 4 else {0, 1, 2, 3})
            with svc.lock:  # (the trainer's groups: the service's own GPU worker does them, as for a gone trainer)
                svc._trainer_left(svc.run)
            run.wait()
        assert replies[2]["next_split"] == [0, 1] and asked == [[0.5, 0.5]]
        assert run.trainer.groups == {0, 1} and run.optimizer.on_gpu == {0, 1}
        assert json.loads(svc.record_path.read_text())["plan"]["gpu_updates"] == [0, 1]
        assert [run.store.catalog.version(g) for g in range(4)] == [4] * 4
        svc._close_run(keep=False)
    finally:
        theirs.close()
        svc.release()


def test_the_trainer_takes_a_split_found_again_from_its_next_backward(tmp_path):
    """The trainer's side of a split found again: the commit whose reply carries ``next_split`` still updates the
    groups it started with; from then on the backward keeps the new groups' gradients on the GPU (``grads_on_gpu``)
    and the next commit hands the GPU worker the new split before its update."""
    import types

    from tiermem.futures import done_future
    from tiermem.service.client import RemoteOptimizer

    calls = []
    client = types.SimpleNamespace(error=None, lost=False, on_version=None,
                                   request=lambda op, **f: calls.append(("commit", f["step"])) or (
                                       {"next_split": ["a"]} if f["step"] == 3 else {}))
    local = types.SimpleNamespace(on_gpu={"a", "b"}, failure=None, check=lambda: None,
                                  first_out_of_place=lambda mine: [],
                                  resplit=lambda on_gpu: calls.append(("resplit", sorted(on_gpu))),
                                  step=lambda step, lr, scale, only: calls.append(("update", step, sorted(only)))
                                  or done_future())
    store = types.SimpleNamespace(flush=lambda kind: None, in_device_memory=lambda g, kind: False)
    opt = RemoteOptimizer(client, store, ["a", "b", "c"], "r1", 2, local)
    assert opt.grads_on_gpu("b")
    opt.step(3, 0.1)
    assert not opt.grads_on_gpu("b") and opt.grads_on_gpu("a")  # (the next backward's)
    assert opt.take_notes() == ["plan: the service measured its CPU worker and split the updates again: from update 4 "
                                "this trainer's GPU updates 1 of 3 groups, the service the others"]
    assert opt.take_notes() == []
    opt.step(4, 0.1)
    assert calls == [("commit", 3), ("update", 3, ["a", "b"]), ("resplit", ["a"]), ("commit", 4),
                     ("update", 4, ["a"])], calls


def test_a_commit_with_a_bad_grant_is_refused_before_it_is_journaled(tmp_path):
    """``grant`` that is not a short list of groups: the commit is refused in one line and nothing of it is journaled
    or started (the same step commits afterwards)."""
    svc, client, theirs, hello = _service(tmp_path, HBM)
    try:
        _ok(svc.dispatch(client, hello))
        _ok(svc.dispatch(client, {"op": "init", "id": 2, "run": "r1", "step": 0}))
        bad = svc.dispatch(client, {"op": "commit", "id": 3, "run": "r1", "step": 1, "lr": 0.1, "grant": "all"})
        assert not bad["ok"] and "grant: a list of at most 4 groups" in bad["error"], bad
        assert svc.run.state.committed == 0 and not svc.run.owed
        _ok(svc.dispatch(client, {"op": "commit", "id": 4, "run": "r1", "step": 1, "lr": 0.1, "grant": [0]}))
        assert svc.run.state.committed == 1
        with svc.lock:  # (the group the trainer owed: the service's own worker updates it)
            svc._trainer_left(svc.run)
        svc.run.wait()
        svc._close_run(keep=False)
    finally:
        theirs.close()
        svc.release()
