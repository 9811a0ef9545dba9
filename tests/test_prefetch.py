"""The prefetcher waits for a group's params version: an update's compute copy home, which may run
ahead of the version a checkpoint reads (an attached trainer's GPU worker publishes the weights before
the service has journaled the rest of the update)."""

from __future__ import annotations

import time

import torch

from tiermem.specs import TensorSpec
from tiermem.store.prefetch import Prefetcher
from tiermem.store.store import Store


def test_a_param_request_starts_once_the_params_are_home_before_the_version(make_cfg):
    specs = [TensorSpec(f"w{g}{':' + k if k != 'param' else ''}", (256,), torch.float32, k, g)
             for g in (0, 1) for k in ("param", "master")]
    with Store.open(make_cfg(placement={"param": "dram", "master": "dram"}, nvme=False), specs) as store:
        cat = store.catalog
        for g in (0, 1):
            store.write(f"w{g}", torch.full((256,), float(g))).result()
            cat.bump(g, to=1)
        pre = Prefetcher(store)
        try:
            ahead, behind = pre.request(0, "param", 2), pre.request(1, "param", 2)
            time.sleep(0.3)
            assert not ahead.future.done() and not behind.future.done()
            cat.params_ready(0, 2)  # update 2's weights of group 0 are home; its version is still 1
            view = ahead.future.result(timeout=5)
            assert cat.version(0) == 1 and cat.params_version(0) == 2
            assert torch.equal(view.tensors["w0"].cpu(), torch.zeros(256))
            view.release()
            time.sleep(0.3)
            assert not behind.future.done()
            cat.bump(1, to=2)  # the version alone makes the params ready too
            behind.future.result(timeout=5).release()
            assert cat.params_version(1) == 2
        finally:
            pre.close()


def test_a_group_laid_out_end_to_end_comes_to_the_gpu_in_one_copy(make_cfg):
    """A streamed group whose tensors lie end to end in DRAM (as the store lays a group out) is fetched into its
    slot by one copy of the span, each tensor's view at its place in it (a mixture-of-experts layer has hundreds
    of tensors: a copy each held the interpreter); when they do not, a copy each."""
    sizes = [256, 1000, 4096, 3, 1024]  # (elements: extents 4 KiB-aligned, some with padding after them)
    specs = [TensorSpec(f"l0.w{i}", (n,), torch.float32, "param", 0) for i, n in enumerate(sizes)]
    with Store.open(make_cfg(placement={"param": "dram"}, nvme=False), specs) as store:
        values = {s.name: torch.randn(s.shape) for s in specs}
        for name, t in values.items():
            store.write(name, t).result()
        calls, real = [], store.mover.copy

        def counted(src, dst, *a, **k):
            calls.append(store.mover.nbytes(src))
            return real(src, dst, *a, **k)

        store.mover.copy = counted
        view = store.fetch(0).result()
        assert len(calls) == 1 and calls[0] >= sum(4 * n for n in sizes)
        assert all(torch.equal(view.tensors[n].cpu(), t) for n, t in values.items())
        view.release()
        # two tensors' places swapped (both one 4 KiB extent): not in order any more, a copy each
        e0, e3 = store.catalog["l0.w0"], store.catalog["l0.w3"]
        e0.extent, e3.extent = e3.extent, e0.extent
        for name in ("l0.w0", "l0.w3"):
            store.write(name, values[name]).result()
        calls.clear()
        view = store.fetch(0).result()
        assert len(calls) == len(sizes)
        assert all(torch.equal(view.tensors[n].cpu(), t) for n, t in values.items())
        view.release()
