"""Placement: static and auto, budgets as hard limits refused before anything is allocated."""

from __future__ import annotations

import os

import pytest
import torch

from tiermem.errors import BudgetError
from tiermem.plan.placement import make_plan
from tiermem.specs import TensorSpec
from tiermem.store.store import Store
from tiermem.tiers.dram import list_arenas

MiB = 1 << 20


def model_specs(layers=4, n=MiB // 4):  # each tensor 1 MiB in fp32
    specs = []
    for i in range(layers):
        for kind in ("param", "grad", "master", "exp_avg", "exp_avg_sq"):
            specs.append(TensorSpec(f"layers.{i}.w:{kind}", (n,), torch.float32, kind, i))
    for kind in ("param", "master", "exp_avg", "exp_avg_sq"):
        specs.append(TensorSpec(f"embed:{kind}", (n // 4,), torch.float32, kind, "embed"))
    return specs


def test_static_placement(make_cfg):
    plan = make_plan(model_specs(), make_cfg(placement={"exp_avg": "nvme", "exp_avg_sq": "nvme"}))
    assert plan.where[(2, "exp_avg")] == "nvme" and plan.where[(2, "param")] == "dram"
    assert plan.where[("embed", "param")] == "dram"  # unnamed kinds stay in DRAM
    assert plan.need()["nvme"] == 2 * 4 * MiB + 2 * MiB // 4
    assert plan.slot_bytes == MiB and plan.n_slots == 3


def test_auto_spills_coldest_kinds_of_last_layers(make_cfg):
    cfg = make_cfg(dram_budget="16MiB", nvme_budget="1GiB")
    plan = make_plan(model_specs(), cfg)
    assert all(plan.where[("embed", k)] == "gpu" for k in ("param", "master", "exp_avg", "exp_avg_sq"))
    assert plan.need()["dram"] <= 16 * MiB
    assert plan.where[(3, "exp_avg_sq")] == "nvme"  # coldest kind, last layer first
    assert plan.where[(0, "param")] == "dram"  # hottest stays
    moved = [k for k, t in plan.where.items() if t == "nvme"]
    assert all(k[1] in ("exp_avg_sq", "exp_avg") for k in moved)


def test_over_budget_is_refused_before_allocation(make_cfg, store_name):
    cfg = make_cfg(placement={"exp_avg": "nvme"}, dram_budget="4MiB", nvme_budget="2MiB")
    with pytest.raises(BudgetError) as e:
        Store.open(cfg, model_specs())
    msg = str(e.value)  # dram: 16 MiB of layer state, 0.75 of embed, 2 of staging for NVMe reads
    assert "needs" in msg and "dram 18.8 MiB (budget 4.0 MiB)" in msg and "nvme 4.2 MiB (budget 2.0 MiB)" in msg
    assert "raise tiers.dram.budget" in msg
    assert not any(a.name == store_name for a in list_arenas())


def test_nvme_placement_without_tier(make_cfg):
    cfg = make_cfg(nvme=False, dram_budget="1MiB")
    with pytest.raises(BudgetError, match="dram"):
        make_plan(model_specs(), cfg)



@pytest.mark.parametrize("how,gpu", [("spread", {0, 2}), ("last", {"embed", 0})])
def test_the_cpu_workers_groups_spread_or_last(make_cfg, how, gpu):
    """optimizer.cpu_groups: the GPU worker's half of five streamed groups, the CPU worker's spread over the
    forward order or the ones the next forward needs last."""
    from tiermem.optim import AdamWConfig, StoreAdamW

    cfg = make_cfg(placement={k: "dram" for k in ("param", "grad", "master", "exp_avg", "exp_avg_sq")},
                   optimizer={"gpu_share": 0.5, "cpu_groups": how})
    with Store.open(cfg, model_specs()) as store:
        opt = StoreAdamW(store, ["embed", 0, 1, 2, 3], {}, AdamWConfig(), has_master=True)
        try:
            assert opt.on_gpu == gpu
        finally:
            opt.close()


def test_an_update_is_done_only_when_its_last_nvme_write_back_is(make_cfg):
    """The future of ``StoreAdamW.step`` stands for the whole update: the moments the CPU worker staged from
    NVMe are written back (here slowly) before it completes, the last group's too."""
    import threading
    import time

    from tiermem.optim import AdamWConfig, StoreAdamW

    cfg = make_cfg(placement={"param": "dram", "grad": "dram", "master": "dram", "exp_avg": "nvme",
                              "exp_avg_sq": "nvme"}, optimizer={"gpu_share": 0.0})
    from tiermem.specs import state_name

    specs = [TensorSpec(state_name(f"layers.{i}.w", kind), (MiB // 4,), torch.float32, kind, i)
             for i in range(4) for kind in ("param", "grad", "master", "exp_avg", "exp_avg_sq")]
    with Store.open(cfg, specs) as store:
        landed, real = [], store.store_group

        def slow(group, kind, tensors, bulk=False):
            fut = real(group, kind, tensors, bulk)
            if kind not in ("exp_avg", "exp_avg_sq"):
                return fut
            import concurrent.futures as cf

            late = cf.Future()

            def finish():
                time.sleep(0.2)
                fut.result()
                landed.append((group, kind))
                late.set_result(None)

            threading.Thread(target=finish, daemon=True).start()
            return late

        store.store_group = slow
        for e in specs:
            store.write(e.name, torch.ones(e.shape)).result()
        opt = StoreAdamW(store, [0, 1, 2, 3], {}, AdamWConfig(), has_master=True)
        try:
            opt.step(1, 1e-3).result()
            assert (3, "exp_avg_sq") in landed and len(landed) == 2 * 4
        finally:
            opt.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread priorities from Linux's /proc")
def test_the_cpu_workers_threads_yield_and_the_stores_threads_do_not(make_cfg):
    """The CPU worker runs at a lower priority (nice 10), so the trainer's thread gets a core when it wakes;
    the store's I/O and copy threads, which the worker also submits to, keep the normal one (they are started
    when the store opens, not on demand from the worker, whose priority a new thread would inherit)."""
    import threading

    from tiermem.optim import AdamWConfig, StoreAdamW
    from tiermem.specs import state_name

    def nice(tid: int) -> int:
        with open(f"/proc/self/task/{tid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[16])

    cfg = make_cfg(placement={"param": "dram", "grad": "dram", "master": "dram", "exp_avg": "nvme",
                              "exp_avg_sq": "nvme"}, optimizer={"gpu_share": 0.0})
    specs = [TensorSpec(state_name(f"layers.{i}.w", kind), (MiB // 4,), torch.float32, kind, i)
             for i in range(2) for kind in ("param", "grad", "master", "exp_avg", "exp_avg_sq")]
    with Store.open(cfg, specs) as store:
        for e in specs:
            store.write(e.name, torch.ones(e.shape)).result()
        opt = StoreAdamW(store, [0, 1], {}, AdamWConfig(), has_master=True)
        try:
            opt.step(1, 1e-3).result()
            opt.step(2, 1e-3).result()
            threads = {t.name: t.native_id for t in threading.enumerate()}
            worker = [tid for name, tid in threads.items() if name.startswith("tiermem-optim-cpu")]
            store_threads = [tid for name, tid in threads.items() if name.startswith(("tiermem-nvme", "tiermem-copy"))]
            base = nice(threading.get_native_id())  # (this process's: a test run may itself be niced)
            assert worker and all(nice(t) == max(base, 10) for t in worker)
            assert store_threads and all(nice(t) == base for t in store_threads), \
                {n: nice(t) for n, t in threads.items() if t in store_threads}
        finally:
            opt.close()


def test_the_cpu_workers_nice_value_comes_from_the_environment(monkeypatch):
    from tiermem.optim.store_adamw import worker_nice

    for value, nice in (("0", 0), ("5", 5), (" 15 ", 15), ("", 10), ("high", 10)):
        monkeypatch.setenv("TIERMEM_OPTIM_NICE", value)
        assert worker_nice() == nice, value
    monkeypatch.delenv("TIERMEM_OPTIM_NICE")
    assert worker_nice() == 10


def test_the_gpu_workers_kept_views_follow_a_tensor_that_moves_in_hbm(make_cfg):
    """A group living in HBM is updated in place through views the GPU worker builds once and keeps (a
    mixture-of-experts layer has hundreds of tensors); when one of its tensors gets a new home in HBM the views
    are built again: three updates, one tensor moved between the second and the third, end as torch's AdamW."""
    from tiermem.optim import AdamWConfig, StoreAdamW
    from tiermem.specs import state_name

    kinds = ("param", "grad", "exp_avg", "exp_avg_sq")
    cfg = make_cfg(placement={k: "gpu" for k in kinds}, gpu_budget="16MiB")
    names = [f"layers.{i}.w{j}" for i in range(2) for j in range(3)]
    specs = [TensorSpec(state_name(n, k), (1000 + 8 * j,), torch.float32, k, i)
             for i in range(2) for j, n in enumerate(names[3 * i: 3 * i + 3]) for k in kinds]
    gen = torch.Generator().manual_seed(0)
    ref = {n: torch.nn.Parameter(torch.randn(s.shape, generator=gen)) for n, s in
           ((s.name, s) for s in specs if s.kind == "param")}
    grads = [{n: torch.randn(p.shape, generator=gen) for n, p in ref.items()} for _ in range(3)]
    torch_opt = torch.optim.AdamW(ref.values(), lr=1e-2, weight_decay=0.1)
    with Store.open(cfg, specs) as store:
        for n, p in ref.items():
            store.write(n, p.detach().clone()).result()
        opt = StoreAdamW(store, [0, 1], {}, AdamWConfig(weight_decay=0.1), has_master=False, on_gpu={0, 1})
        try:
            assert opt.resident == {0, 1}
            for step, g in enumerate(grads, 1):
                for n, t in g.items():
                    store.write(state_name(n, "grad"), t.clone()).result()
                    ref[n].grad = t.clone()
                if step == 3:  # (a moment of layer 1 moves within HBM)
                    name = state_name(names[4], "exp_avg")
                    store.rehome(name, store.copy_to(name, "gpu").result())
                opt.step(step, 1e-2).result()
                torch_opt.step()
            for n, p in ref.items():
                torch.testing.assert_close(store.read(n).result(), p.detach(), rtol=1e-6, atol=1e-7)
                for k in ("exp_avg", "exp_avg_sq"):  # (the moved moment's new home holds the third update's)
                    torch.testing.assert_close(store.read(state_name(n, k)).result(), torch_opt.state[p][k],
                                               rtol=1e-6, atol=1e-9)
        finally:
            opt.close()
