"""GPU paths: CUDA registration of the arena, H2D/D2H through the mover, GPU slots, and the kvikio
backend straight to and from GPU memory. Skipped without CUDA (run on the GPU machine)."""

from __future__ import annotations

import pytest
import torch

from tests.test_service import env  # noqa: F401 - the service fixture
from tiermem.config import load_store_config
from tiermem.specs import TensorSpec
from tiermem.store.store import Store
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


@pytest.mark.parametrize("family,passes", [("qwen2", 1), ("qwen2", 2), ("qwen3", 2)])
def test_training_with_the_state_in_hbm_matches_plain_pytorch(tmp_path, capsys, family, passes):
    """fp32, placement auto: the whole state lives in HBM, so the LM head's and the embedding's gradients are
    summed straight into their homes there over the step's micro-batches (and passes) on CUDA's streams;
    untied (qwen2) and tied (qwen3) heads, against the CPU reference loop."""
    from safetensors.torch import load_file

    from tests.test_train_parity import reference_training, run_cli
    from tests.tiny_models import COMMON, save_tiny_model, write_tokenized_dataset

    model_dir = save_tiny_model(family, tmp_path / "model")
    data_dir = tmp_path / "data"
    name = write_tokenized_dataset(data_dir)
    ref = reference_training(model_dir, data_dir, name, [])
    # (a budget below any micro-batch's boundary activations: a pass each, 2 for the step's 2 micro-batches)
    one_token = (COMMON["num_hidden_layers"] + 1) * COMMON["hidden_size"] * 4
    over = {"tiermem_activation_budget": one_token} if passes > 1 else {}
    tiermem = {"tiers": {"gpu": {"device": "cuda"}}, "placement": "auto"}
    assert run_cli(tmp_path, model_dir, data_dir, name, tiermem, **over) == 0
    out = capsys.readouterr().out
    assert (f"each step runs as {passes} layer-major passes" in out) == (passes > 1), out[-2000:]
    assert "param+grad+exp_avg+exp_avg_sq of every group" in out.split("plan: gpu", 1)[-1].splitlines()[0], out[:800]
    got = {}
    for f in (tmp_path / "out").glob("*.safetensors"):
        got.update(load_file(f))
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


@pytest.mark.parametrize("kill_at", ["backward:3", "update:3:0", "update:4:2"])
def test_state_in_the_services_hbm_on_cuda_survives_the_trainers_kill(env, kill_at):  # noqa: F811 - the fixture
    """Every kind in the service's HBM on CUDA (its own allocation, mapped by the trainer through CUDA IPC): the run
    ends as the embedded CUDA run to the GPU kernels' rounding, and a trainer killed in the backward or mid-update
    (group 0's or 2's new state written in HBM, not flipped to) leaves the block intact: the rerun maps it again
    and ends bit-identical to the uninterrupted attached run."""
    from tests.test_service import same
    from tests.test_service_hbm import HBM

    ref = env.reference(device="cuda")
    svc = env.service(placement=HBM, device="cuda", shm="/dev/shm")
    try:
        straight = env.train("straight")
        assert straight.returncode == 0, straight.stderr
        assert "store: gpu: " in straight.stdout, straight.stdout
        got = env.weights("straight")
        assert all(torch.allclose(got[k], ref[k], rtol=1e-4, atol=1e-6) for k in ref)
        killed = env.train("killed", kill_at=kill_at)
        assert killed.returncode == -9, killed.stderr
        again = env.train("killed")
        assert again.returncode == 0, again.stderr
        assert same(env.weights("killed"), got)
    finally:
        assert svc.stop() == 0


# The Llama-3B shape cut to 8 layers (1.6 B params): the multi-pass fault showed at this size on CUDA and
# not with the tiny models
SHAPE_3B_8 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 3072,
              "intermediate_size": 8192, "num_hidden_layers": 8, "num_attention_heads": 24, "num_key_value_heads": 8,
              "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "tie_word_embeddings": False, "hidden_act": "silu"}


def multi_pass_runs(tmp_path, shape: dict, bf16: bool, rows: int, accum: int, seq: int, passes=(1, 2, 4),
                    device: str = "cuda", steps: int = 2, placement=None):
    """``tiermem-train`` (random init, random tokenized rows, every kind in the DRAM arena unless ``placement``
    says otherwise) once per number of layer-major passes a step, with an activation budget that holds
    ``accum / passes`` micro-batches' boundaries: {passes: (trainer_log lines, output_dir)}."""
    import json
    import subprocess
    import sys

    import yaml

    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(shape))
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    g = torch.Generator().manual_seed(0)
    with (data / "rand.jsonl").open("w") as f:
        for _ in range(rows * accum * steps):
            ids = torch.randint(0, shape["vocab_size"], (seq,), generator=g).tolist()
            f.write(json.dumps({"input_ids": ids}) + "\n")
    info = {"rand": {"file_name": "rand.jsonl", "formatting": "tokenized"}}
    (data / "dataset_info.json").write_text(json.dumps(info))
    itemsize = 2 if bf16 else 4
    per_mb = (shape["num_hidden_layers"] + 1) * shape["hidden_size"] * itemsize * rows * seq
    out = {}
    for p in passes:
        cfg = {"model_name_or_path": str(model), "tiermem_init": "random", "dataset": "rand", "dataset_dir": str(data),
               "output_dir": str(tmp_path / f"out{p}"), "cutoff_len": seq, "per_device_train_batch_size": rows,
               "gradient_accumulation_steps": accum, "max_steps": steps, "learning_rate": 1e-5,
               "lr_scheduler_type": "constant", "max_grad_norm": 1.0, "logging_steps": 1, "bf16": bf16, "seed": 3,
               "tiermem_activation_budget": per_mb * (accum // p),
               "tiermem": {"tiers": {"gpu": {"device": device}},
                           "placement": placement or {k: "dram" for k in ("param", "grad", "master", "exp_avg",
                                                                           "exp_avg_sq")}}}
        path = tmp_path / f"train{p}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        r = subprocess.run([sys.executable, "-m", "trainer.cli", str(path)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        assert (f"each step runs as {p} layer-major passes" in r.stdout) == (p > 1), r.stdout[-2000:]
        log = [json.loads(line) for line in (tmp_path / f"out{p}" / "trainer_log.jsonl").read_text().splitlines()]
        out[p] = (log, tmp_path / f"out{p}")
    return out


def weight_errors(a_dir, b_dir) -> dict[str, float]:
    """Relative error (norm) of every exported tensor of ``b_dir`` against ``a_dir``'s, one tensor at a time."""
    from safetensors import safe_open

    def files(d):
        return {k: f for f in sorted(d.glob("*.safetensors")) for k in safe_open(f, "pt").keys()}

    fa, fb = files(a_dir), files(b_dir)
    assert set(fa) == set(fb)
    errs = {}
    for k in fa:
        x = safe_open(fa[k], "pt").get_tensor(k).float()
        y = safe_open(fb[k], "pt").get_tensor(k).float()
        errs[k] = float((y - x).norm() / x.norm().clamp_min(1e-12))
    return errs


@pytest.mark.parametrize("bf16", [True, False])
def test_several_passes_a_step_match_one_pass_on_cuda(tmp_path, bf16):
    """A step run as 2 or 4 layer-major passes (partial gradients to DRAM and back between them) gives the
    1-pass run's losses, gradient norms and exported weights, on the 8-layer Llama-3B shape: before the
    fix, the read-back raced the compute stream's kernels here (bf16: nan grad norms, loss 1e29; fp32:
    grad norm 1e7)."""
    rows = 4 if bf16 else 2  # fp32 matmuls are slow: half the tokens
    runs = multi_pass_runs(tmp_path, SHAPE_3B_8, bf16, rows=rows, accum=4, seq=4096)
    tol = 1e-3 if bf16 else 1e-5
    ref_log, ref_dir = runs[1]
    for p in (2, 4):
        log, out = runs[p]
        for want, got in zip(ref_log, log):
            for key in ("loss", "grad_norm"):
                assert abs(got[key] - want[key]) <= tol * abs(want[key]), f"{p} passes, step {got['current_steps']}: " \
                    f"{key} {got[key]} vs {want[key]}"
        errs = weight_errors(ref_dir, out)
        off = {k: f"{e:.1e}" for k, e in errs.items() if not e <= tol}
        assert not off, f"{p} passes: {len(off)} tensors differ: {off}"


def test_several_passes_with_the_state_in_hbm_match_one_pass_on_cuda(tmp_path):
    """Placement auto puts the 8-layer 3B shape's whole state in HBM: a step of 2 or 4 passes sums each
    group's gradient in its home in HBM over the passes (nothing goes out and comes back between them, no
    copy within HBM beyond the 1-pass run's: the random init writing the weights home) and gives the 1-pass
    run's losses, gradient norms and exported weights, in bf16 on CUDA."""
    import json

    runs = multi_pass_runs(tmp_path, SHAPE_3B_8, True, rows=4, accum=4, seq=4096, placement="auto")
    ref_log, ref_dir = runs[1]
    ref_copies = json.loads((ref_dir / "store_stats.json").read_text())["links"]["gpu->gpu"]["bytes"]  # (the init's)
    for p in (2, 4):
        log, out = runs[p]
        for want, got in zip(ref_log, log):
            for key in ("loss", "grad_norm"):
                assert abs(got[key] - want[key]) <= 1e-3 * abs(want[key]), \
                    f"{p} passes, step {got['current_steps']}: {key} {got[key]} vs {want[key]}"
        stats = json.loads((out / "store_stats.json").read_text())
        assert "gradient_partials" not in stats["waits_s"], stats["waits_s"]
        assert stats["links"]["gpu->gpu"]["bytes"] == ref_copies, (stats["links"]["gpu->gpu"], ref_copies)
        errs = weight_errors(ref_dir, out)
        off = {k: f"{e:.1e}" for k, e in errs.items() if not e <= 1e-3}
        assert not off, f"{p} passes: {len(off)} tensors differ: {off}"


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
def test_moe_grouped_experts_on_cuda_match_per_expert_matmuls():
    """Qwen3-30B-A3B's expert shapes (hidden 2048, 128 experts of intermediate 768, top-8 renormalised) over
    4096 tokens in bf16 on CUDA, two experts idle: torch's grouped matmuls and one matmul chain per expert
    (in fp32) give the same output and gradients to bf16's rounding."""
    from trainer.model.moe import experts, grouped_available, route

    g = torch.Generator(device="cuda").manual_seed(0)
    n, hidden, inter, n_exp = 4096, 2048, 768, 128
    h = torch.randn(n, hidden, device="cuda", generator=g).bfloat16()
    gate_w = torch.randn(n_exp, hidden, device="cuda", generator=g).bfloat16() * 0.02
    ws = [tuple((torch.randn(*s, device="cuda", generator=g) * 0.02).bfloat16()
                for s in ((inter, hidden), (inter, hidden), (hidden, inter))) for _ in range(n_exp)]
    assert grouped_available(h, inter)
    _, top_w, top_i = route(h, gate_w, 8, True)
    top_i = torch.where((top_i == 5) | (top_i == 77), 0, top_i)  # two experts get no token

    def run(grouped, dtype):
        leaves = [tuple(t.to(dtype).requires_grad_() for t in e) for e in ws]
        x = h.to(dtype).requires_grad_()
        y = experts(x, top_w.to(dtype), top_i, leaves, grouped=grouped)
        dy = torch.ones_like(y) / n
        grads = torch.autograd.grad(y, [x, *[t for e in leaves for t in e]], dy, allow_unused=True)
        return [y.float(), *[None if t is None else t.float() for t in grads]]

    got, want = run(True, torch.bfloat16), run(False, torch.float32)
    for i, (a, b) in enumerate(zip(got, want)):
        if b is None:  # an idle expert: no gradient either way (or zeros from the grouped kernels)
            assert a is None or not a.any(), i
            continue
        scale = b.abs().max().item()
        assert (a - b).abs().max().item() <= 2e-2 * scale + 1e-6, (i, (a - b).abs().max().item(), scale)


@pytest.mark.parametrize("window", [128, None])
def test_sink_attention_through_flex_matches_the_materialised_scores(window, monkeypatch):
    """gpt-oss's attention on CUDA (flex attention compiled, the sinks from its log-sum-exp, whose gradient its
    backward takes) gives the output and gradients of the materialised fp32 scores (the CPU's kernel), at 1024
    tokens with 64 heads over 8 KV heads, a sliding window of 128 and full attention."""
    from trainer.model.attention import attention

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, h, 1024, 64, device="cuda", generator=g) for h in (64, 8, 8))
    sinks = torch.randn(64, device="cuda", generator=g)
    dy = torch.randn(2, 64, 1024, 64, device="cuda", generator=g)

    def run(flex: str):
        monkeypatch.setenv("TIERMEM_FLEX_ATTENTION", flex)
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        y = attention(*leaves, window)
        return [y, *torch.autograd.grad(y, leaves, dy)]

    for name, a, b in zip(["output", "q", "k", "v", "sinks"], run("1"), run("0")):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
def test_gpt_oss_grouped_experts_on_cuda_match_per_expert_matmuls():
    """gpt-oss-120B's expert shapes (hidden 2880, 128 experts of intermediate 2880, top-4, stacked as stored)
    over 2048 tokens in bf16 on CUDA: the grouped matmuls and one matmul chain per expert (in fp32) give the same
    output and gradients to bf16's rounding."""
    from trainer.model.moe import grouped_available, route_top_logits, stacked_experts

    g = torch.Generator(device="cuda").manual_seed(0)
    n, hidden, inter, n_exp = 2048, 2880, 2880, 128
    h = torch.randn(n, hidden, device="cuda", generator=g).bfloat16()
    router_w = (torch.randn(n_exp, hidden, device="cuda", generator=g) * 0.02).bfloat16()
    router_b = (torch.randn(n_exp, device="cuda", generator=g) * 0.02).bfloat16()
    ws = [(torch.randn(*s, device="cuda", generator=g) * 0.02).bfloat16()
          for s in ((n_exp, hidden, 2 * inter), (n_exp, 2 * inter), (n_exp, inter, hidden), (n_exp, hidden))]
    assert grouped_available(h, inter)
    _, top_w, top_i = route_top_logits(h, router_w, router_b, 4)

    def run(grouped, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in ws]
        x = h.to(dtype).requires_grad_()
        y = stacked_experts(x, top_w.to(dtype), top_i, *leaves, 1.702, 7.0, grouped=grouped)
        grads = torch.autograd.grad(y, [x, *leaves], torch.ones_like(y) / n)
        return [y.float(), *[t.float() for t in grads]]

    for i, (a, b) in enumerate(zip(run(True, torch.bfloat16), run(False, torch.float32))):
        scale = b.abs().max().item()
        assert (a - b).abs().max().item() <= 2e-2 * scale + 1e-6, (i, (a - b).abs().max().item(), scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_long_row_in_chunks_on_cuda_matches_the_whole_layer_in_less_memory(dtype):
    """One Llama-3.1-8B layer over a row of 32,768 tokens in chunks of 4,096 (the attention through the fused SDPA
    kernels) against the whole layer on CUDA: the output, the input's and the weights' gradients agree (bf16 to its
    rounding), and (bf16) the backward's peak memory is well under the whole layer's (its 14336-wide activations)."""
    from tests.test_planner import SHAPE_8B
    from trainer.model.config import model_config_from_dict
    from trainer.model.stages import TemplateStages
    from trainer.model.weights import all_weights, init_weight

    dev = torch.device("cuda")
    cfg = model_config_from_dict(dict(SHAPE_8B, num_hidden_layers=1))
    stages = TemplateStages(cfg, dtype, dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    w = {lw.local: init_weight(lw, cfg, gen, dev).to(dtype) for lw in all_weights(cfg) if lw.group == 0}
    t = 32768 if dtype == torch.bfloat16 else 8192
    x = torch.randn(1, t, cfg.hidden_size, device=dev, dtype=dtype, generator=gen)
    gy = torch.randn(x.shape, device=dev, dtype=dtype, generator=gen) * 1e-3
    ctx = stages.contexts([torch.zeros(1, t, dtype=torch.long, device=dev)], [None], 1, False)[0]
    out = {}
    for chunk in (t // 8, None):
        cfg.seq_chunk = chunk if chunk else 1 << 30
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        y = stages.layer(0, w, x, ctx)
        gx, gws = stages.layer_backward(0, w, x, gy.clone(), ctx)
        torch.cuda.synchronize()
        out[chunk] = (y, gx, [g.float() for g in gws], torch.cuda.max_memory_allocated() - base)
    (y, gx, gws, peak), (y0, gx0, gws0, peak0) = out[t // 8], out[None]
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for name, a, b in [("y", y, y0), ("gx", gx, gx0), *zip(w, gws, gws0)]:
        err = float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))
        assert err <= tol, f"{name}: relative error {err:.2e}"
    if dtype == torch.bfloat16:  # (fp32 at a quarter of the row: the weights' fp32 gradients weigh as much)
        assert peak < 0.6 * peak0, (peak, peak0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_kept_long_rows_layer_on_cuda_backpropagates_as_the_recompute(dtype):
    """One Llama-3.1-8B layer over a row of 32,768 tokens (bf16; fp32 8,192) in chunks, kept: its attention's
    graph from the forward (the fused SDPA kernels) backpropagates as the recompute does (the fused backward
    accumulates in an order of its own: to rounding), and holds about 2.5 hidden-wide tensors a token (4.5 where
    the kernel takes k and v expanded to q's heads), not the whole layer's graph (over 20)."""
    from tests.test_planner import SHAPE_8B
    from trainer.model.config import model_config_from_dict
    from trainer.model.stages import TemplateStages
    from trainer.model.weights import all_weights, init_weight

    dev = torch.device("cuda")
    cfg = model_config_from_dict(dict(SHAPE_8B, num_hidden_layers=1))
    t = 32768 if dtype == torch.bfloat16 else 8192
    cfg.seq_chunk = t // 8
    stages = TemplateStages(cfg, dtype, dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    w = {lw.local: init_weight(lw, cfg, gen, dev).to(dtype) for lw in all_weights(cfg) if lw.group == 0}
    x = torch.randn(1, t, cfg.hidden_size, device=dev, dtype=dtype, generator=gen)
    gy = torch.randn(x.shape, device=dev, dtype=dtype, generator=gen) * 1e-3
    ctx = stages.contexts([torch.zeros(1, t, dtype=torch.long, device=dev)], [None], 1, False)[0]
    y0 = stages.layer(0, w, x, ctx)
    gx0, gws0 = stages.layer_backward(0, w, x, gy.clone(), ctx)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        y, graph = stages.layer_graph(0, w, x, ctx)
    held = torch.cuda.memory_allocated() - base - y.numel() * y.element_size()
    gx, gws = stages.graph_backward(graph, gy.clone())
    assert torch.equal(y, y0)  # (the same forward kernels)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for name, a, b in [("gx", gx, gx0), *zip(w, gws, gws0)]:
        err = float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))
        assert err <= tol, f"{name}: relative error {err:.2e}"
    hidden = t * cfg.hidden_size * x.element_size()
    assert 2 * hidden <= held <= 5 * hidden, (held, hidden)  # (q, k, v, the output, the log-sum-exp)


@pytest.mark.parametrize("where", ["gpu", "dram"])
def test_activations_in_dram_on_cuda_train_as_plain_pytorch(tmp_path, where):
    """fp32 training on CUDA with every layer's input in the pinned arena between the forward and the backward (or
    on the GPU), against the CPU reference loop, to cuBLAS's rounding."""
    from safetensors.torch import load_file

    from tests.test_train_parity import reference_training, run_cli
    from tests.tiny_models import save_tiny_model, write_tokenized_dataset

    model_dir = save_tiny_model("llama", tmp_path / "model")
    data_dir = tmp_path / "data"
    name = write_tokenized_dataset(data_dir)
    ref = reference_training(model_dir, data_dir, name, [])
    tiermem = {"tiers": {"gpu": {"device": "cuda"}, "dram": {"budget": "256MiB"}}}
    assert run_cli(tmp_path, model_dir, data_dir, name, tiermem, tiermem_activations=where, tiermem_seq_chunk=8) == 0
    got = load_file(tmp_path / "out" / "model.safetensors")
    for n, t in got.items():
        err = (t - ref[n]).norm() / ref[n].norm()
        assert err <= (1e-3 if n.endswith("k_proj.bias") else 1e-4), f"{n}: {err:.2e}"


def test_a_flips_finite_check_is_read_off_the_default_stream(tmp_path, monkeypatch):
    """The GPU worker of a service's run flips each group's out-of-place update on a thread of its own, which reads
    the group's finite check there (issue 43): on a stream of the flips' own, not the thread's default stream, where
    an attached trainer's forward computes and the read waited for every kernel queued (the worker waits for the
    flip of the group before last, the forward for the worker: the GPU idle between layers). Here the service's own
    GPU worker redoes the update its trainer owed, as when a trainer dies."""
    from tests.test_service_hbm_units import HBM, _ok, _service
    from tiermem.optim.store_adamw import StoreAdamW

    read_on, check = [], StoreAdamW._nonfinite
    monkeypatch.setattr(StoreAdamW, "_nonfinite", staticmethod(
        lambda c: read_on.append(torch.cuda.current_stream()) or check(c)))
    svc, client, theirs, hello = _service(tmp_path, HBM, device="cuda")
    try:
        _ok(svc.dispatch(client, hello))
        _ok(svc.dispatch(client, {"op": "init", "id": 2, "run": "r1", "step": 0}))
        _ok(svc.dispatch(client, {"op": "commit", "id": 3, "run": "r1", "step": 1, "lr": 0.1}))
        assert svc.run.owed == {0}
        with svc.lock:
            svc._trainer_left(svc.run)  # (the service's GPU worker updates group 0 out of place, then flips it)
        svc.run.wait()
        assert svc.run.state.updated == 1 and svc.run.store.catalog.version(0) == 1
        assert read_on and all(s != torch.cuda.default_stream() for s in read_on), read_on
        svc._close_run(keep=False)
    finally:
        theirs.close()
        svc.release()


def test_a_ranks_part_of_the_services_hbm_is_mapped_at_its_base_on_cuda():
    """The service's device tier of several ranks on CUDA (both parts on this GPU here; on cuda:r with several
    GPUs): another process maps part 1 by CUDA IPC at its base, as rank 1's trainer does, and writes through it;
    the service reads those bytes at the group's extent, and part 0 is untouched."""
    import json
    import subprocess
    import sys

    from tests.procs import ROOT, child_env
    from tiermem.tiers.hbm_parts import PART_SPAN, PartedGpuTier, Parts
    from tiermem.tiers.hbm_share import OwnedBlock

    dev = torch.device("cuda", 0)
    blocks = [OwnedBlock(1 << 20, dev), OwnedBlock(1 << 20, dev)]
    tier = PartedGpuTier(Parts(blocks, [1 << 20, 1 << 20], {"a": 0, "b": 1}))
    a, b = tier.allocate_for("a", 4096), tier.allocate_for("b", 4096)
    desc = tier.describe_part(1)
    assert desc["base"] == PART_SPAN and b.offset >= PART_SPAN
    code = ("import json, sys, torch\nfrom tiermem.tiers.gpu import GpuTier\nfrom tiermem.tiers.extents import Extent\n"
            "t = GpuTier.map_shared(json.loads(sys.argv[1]), torch.device('cuda', 0), 512, 2)\n"
            f"t.view(Extent({b.offset}, 4096)).fill_(5)\ntorch.cuda.synchronize()\nt.close()\n")
    subprocess.run([sys.executable, "-c", code, json.dumps(desc)], check=True, cwd=ROOT, env=child_env(), timeout=120)
    assert (tier.view(b) == 5).all() and not tier.view(a).any()
    for blk in blocks:
        blk.close()
