"""GPU paths: CUDA registration of the arena, H2D/D2H through the mover, GPU slots, and the kvikio
backend straight to and from GPU memory. Skipped without CUDA (run on the GPU machine)."""

from __future__ import annotations

import pytest
import torch

from tests.test_service import env  # noqa: F401 - the service fixture
from tiermem.catalog import TensorSpec
from tiermem.config import load_store_config
from tiermem.store import Store
from tiermem.tiers.dram import DramArena

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the GPU machine)")


def test_arena_is_registered_as_pinned(store_name):
    with DramArena.create(store_name, 64 << 20, pin=True) as arena:
        assert arena.pinned
        v = arena.view(arena.allocate(1 << 20))
        assert v.is_pinned()


@pytest.mark.parametrize("backend", ["posix", "kvikio"])
def test_store_on_gpu(nvme_dir, store_name, backend):
    if backend == "kvikio":
        pytest.importorskip("kvikio")
    cfg = load_store_config({"tiers": {"gpu": {"device": "cuda"}, "dram": {"budget": "1GiB"},
                                       "nvme": {"path": str(nvme_dir), "budget": "1GiB", "backend": backend}},
                             "placement": {"param": "dram", "master": "nvme", "exp_avg": "gpu"},
                             "name": store_name})
    specs = [TensorSpec(f"l{i}.{k}", (1000, 333), torch.float32, k, i)
             for i in range(4) for k in ("param", "master", "exp_avg")]
    with Store.open(cfg, specs) as store:
        assert store.dram.pinned and store.nvme.backend_name == backend
        vals = {s.name: torch.randn(s.shape, device="cuda") for s in specs}
        for n, v in vals.items():
            store.write(n, v).result()
        for n, v in vals.items():
            assert torch.equal(store.read(n).result(), v.cpu()), n
        for kind in ("param", "master", "exp_avg"):
            view = store.fetch(2, kind).result()
            t = view.tensors[f"l2.{kind}"]
            assert t.is_cuda and torch.equal(t, vals[f"l2.{kind}"])
            view.release()
        # grads computed on the GPU go home after the producing kernel, not before
        g = torch.randn(1000, 333, device="cuda")
        out = g * 3
        store.store_group(1, "master", {"l1.master": out}).result()
        assert torch.equal(store.read("l1.master").result(), (g * 3).cpu())
        stats = store.stats()
        assert stats["links"]["dram->gpu"]["bytes"] > 0 and stats["links"]["gpu->dram"]["bytes"] > 0
        key = "nvme->gpu"
        assert stats["links"][key]["bytes"] > 0 or backend == "posix"


def test_training_on_the_gpu_matches_plain_pytorch(tmp_path):
    """fp32 streamed training with the executor on CUDA (layers streamed from the pinned arena, moments
    on the GPU tier) against the CPU reference loop; cuBLAS rounds differently, hence the wider bound."""
    from tests.test_train_parity import reference_training, run_cli
    from tests.tiny_models import save_tiny_model, write_tokenized_dataset

    model_dir = save_tiny_model("qwen2", tmp_path / "model")
    data_dir = tmp_path / "data"
    name = write_tokenized_dataset(data_dir)
    ref = reference_training(model_dir, data_dir, name, [])
    tiermem = {"tiers": {"gpu": {"device": "cuda"}, "dram": {"budget": "256MiB"}},
               "placement": {"param": "dram", "grad": "dram", "exp_avg": "gpu", "exp_avg_sq": "dram"}}
    assert run_cli(tmp_path, model_dir, data_dir, name, tiermem) == 0
    from safetensors.torch import load_file

    got = load_file(tmp_path / "out" / "model.safetensors")
    for n, t in got.items():
        err = (t - ref[n]).norm() / ref[n].norm()
        assert err <= (1e-3 if n.endswith("k_proj.bias") else 1e-4), f"{n}: {err:.2e}"


@pytest.mark.parametrize("kill_at", [None, "update:3:0"])
def test_attached_training_on_the_gpu_matches_embedded(env, kill_at):  # noqa: F811 - the fixture
    """A trainer attached to a service computing on CUDA (arena registered by the trainer, gradients D2H
    into the shared arena and kept on the GPU for the trainer's GPU worker, 0.85 of the groups updated
    there out of place, the rest by CPU AdamW in the service) ends where the embedded CUDA run (CPU AdamW)
    ends; only GPU kernels' rounding may differ. Killed with its GPU worker's update of group 0 written but
    not journaled, the service updates what it owed (on its own GPU worker) and the rerun ends the same."""
    ref = env.reference(device="cuda")
    svc = env.service(device="cuda", shm="/dev/shm")  # CUDA pins tmpfs pages, not a disk file's
    try:
        if kill_at:
            killed = env.train("attached", kill_at=kill_at)
            assert killed.returncode == -9, killed.stderr
        run = env.train("attached")
        assert run.returncode == 0, run.stderr
        if kill_at:
            assert "groups the trainer left" in svc.text
        got = env.weights("attached")
        off = {k: f"{((got[k] - ref[k]).abs() / (ref[k].abs() + 1e-6)).max():.1e}" for k in ref
               if not torch.allclose(got[k], ref[k], rtol=1e-4, atol=1e-6)}
        assert not off, f"{len(off)} of {len(ref)} tensors differ (max relative error): {off}"
    finally:
        assert svc.stop() == 0
