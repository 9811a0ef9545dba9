"""The prefetcher waits for a group's params version: an update's compute copy home, which may run
ahead of the version a checkpoint reads (an attached trainer's GPU worker publishes the weights before
the service has journaled the rest of the update)."""

from __future__ import annotations

import time

import torch

from tiermem.store.catalog import TensorSpec
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
