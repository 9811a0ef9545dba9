"""Long rows (issue 39): a decoder layer run in sequence chunks (``trainer.model.chunked``) is the same function as
the whole layer, its gradients too; a run whose rows are cut into chunks trains plain PyTorch's weights."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import hf_config
from tiermem.tiers.base import DEVICE, HOST
from trainer.model import chunked
from trainer.model.config import model_config_from_dict
from trainer.model.stages import TemplateStages
from trainer.model.weights import all_weights, init_weight

transformers = pytest.importorskip("transformers")


def tiny(family: str, **extra):
    raw = hf_config(family, **extra).to_dict()
    raw["architectures"] = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                             "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}[family]]
    return model_config_from_dict(raw)


def layer_weights(cfg, i: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for w in all_weights(cfg):
        if w.group == i:
            t = init_weight(w, cfg, gen, torch.device("cpu"))
            out[w.local] = t + 0.1 * torch.randn(t.shape, generator=gen)  # (norms and biases off their init)
    return out


def test_chunk_of_cuts_long_rows_only_and_evenly():
    assert chunked.chunk_of(None, 1, 16384) is None and chunked.chunk_of(None, 4, 4096) is None
    assert chunked.chunk_of(None, 1, 524288) == 8192 and chunked.chunk_of(None, 1, 131072) == 8192
    c = chunked.chunk_of(None, 1, 20000)  # (three equal chunks of at most 8192)
    assert c == 6667 and len(chunked.spans(20000, c)) == 3
    assert chunked.chunk_of(64, 1, 64) is None and chunked.chunk_of(64, 2, 50) == 25
    assert chunked.chunk_of(16, 1, 50) == 13 and chunked.spans(50, 13)[-1] == (39, 50)
    assert chunked.chunk_of(4, 8, 10) == 1  # (more rows than the chunk's tokens: a token of each row at a time)


@pytest.mark.parametrize("family,layer", [("llama", 0), ("qwen2", 1), ("qwen3", 0), ("qwen3_moe", 0),
                                          ("gpt_oss", 0), ("gpt_oss", 1)])
def test_a_layer_in_chunks_is_the_whole_layer(family, layer):
    """Forward and recomputing backward of a layer over 2 rows of 50 tokens in chunks of 13 tokens (the last one
    shorter) against the whole layer, fp32: the output, the input's gradient and every weight's (biases, q/k
    norms, experts, gpt-oss's sinks and its sliding window of layer 0)."""
    cfg = tiny(family)
    cfg.seq_chunk = 26  # (2 rows: 13 tokens of each)
    stages = TemplateStages(cfg, torch.float32, torch.device("cpu"))
    w = layer_weights(cfg, layer)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 50, cfg.hidden_size, generator=gen)
    gy = torch.randn(x.shape, generator=gen)
    ctx = stages.contexts([torch.zeros(2, 50, dtype=torch.long)], [None], 1, False)[0]
    assert stages.chunk(x, ctx) == 13
    y = stages.layer(layer, w, x, ctx)
    gx, gw = stages.layer_backward(layer, w, x, gy.clone(), ctx)  # (the chunked backward writes over its gy)
    cfg.seq_chunk = 1000  # (the whole layer)
    assert stages.chunk(x, ctx) is None
    y0 = stages.layer(layer, w, x, ctx)
    gx0, gw0 = stages.layer_backward(layer, w, x, gy, ctx)
    assert torch.allclose(y, y0, rtol=1e-5, atol=1e-5)
    assert torch.allclose(gx, gx0, rtol=1e-5, atol=1e-5)
    assert len(gw) == len(gw0) == len(w)
    for name, a, b in zip(w, gw, gw0):
        assert a.dtype == torch.float32
        err = (a - b.float()).norm() / b.float().norm().clamp_min(1e-12)
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("family,layer", [("llama", 0), ("gpt_oss", 0)])  # (gpt-oss's 0: sinks, a window)
def test_a_kept_layer_in_chunks_backpropagates_as_the_recompute_bit_for_bit(family, layer):
    """A kept layer over a row cut into chunks keeps its attention's graph from the forward (q, k, v, the output,
    gpt-oss's sinks): its backward runs neither the q/k/v nor the attention's forward again, and gives the
    recomputing backward's output, input gradient and weight gradients exactly (fp32)."""
    cfg = tiny(family)
    cfg.seq_chunk = 26
    stages = TemplateStages(cfg, torch.float32, torch.device("cpu"))
    w = layer_weights(cfg, layer)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 50, cfg.hidden_size, generator=gen)
    gy = torch.randn(x.shape, generator=gen)
    ctx = stages.contexts([torch.zeros(2, 50, dtype=torch.long)], [None], 1, False)[0]
    y0 = stages.layer(layer, w, x, ctx)
    gx0, gw0 = stages.layer_backward(layer, w, x, gy.clone(), ctx)
    with torch.no_grad():
        y, graph = stages.layer_graph(layer, w, x, ctx)
    seen = []
    real = chunked.pre_attention

    def pre(*a):
        seen.append(torch.is_grad_enabled())
        return real(*a)

    stages._parts = (pre, stages._parts[1])
    gx, gw = stages.graph_backward(graph, gy.clone())
    assert seen == [True] * 4  # (each of the 4 chunks's q/k/v once, with its graph for its backward: none without)
    assert torch.equal(y, y0) and torch.equal(gx, gx0)
    for name, a, b in zip(w, gw, gw0):
        assert torch.equal(a, b), name


def test_the_mlp_is_never_whole(monkeypatch):
    """The feed-forward of a chunked layer sees one chunk at a time, in the forward and the backward's recompute."""
    cfg = tiny("llama")
    cfg.seq_chunk = 16
    stages = TemplateStages(cfg, torch.float32, torch.device("cpu"))
    w = layer_weights(cfg, 0)
    seen = []
    real = chunked.post_attention

    def post(w_, x, a, c):
        seen.append(x.shape[1])
        return real(w_, x, a, c)

    stages._parts = (chunked.pre_attention, post)
    x = torch.randn(1, 40, cfg.hidden_size)
    ctx = stages.contexts([torch.zeros(1, 40, dtype=torch.long)], [None], 1, False)[0]
    stages.layer(0, w, x, ctx)
    stages.layer_backward(0, w, x, torch.ones_like(x), ctx)
    assert seen == [14, 14, 12] * 2


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_rows_cut_into_chunks_train_plain_pytorchs_weights(tmp_path, monkeypatch, family):
    """tiermem_seq_chunk 8 over micro-batches of 2 rows of up to 20 tokens: every layer's forward and backward run
    in chunks of at most 4 tokens of each row; 5 fp32 steps (accumulation, clipping, moments on NVMe) end with plain
    PyTorch's weights, losses and norms."""
    import json

    from tests.test_train_parity import assert_same_weights, nvme_moments, reference_training, run_cli
    from tests.tiny_models import save_tiny_model, write_tokenized_dataset

    model_dir = save_tiny_model(family, tmp_path / "model")
    data_dir = tmp_path / "data"
    name = write_tokenized_dataset(data_dir)
    norms: list[float] = []
    losses: list[float] = []
    ref = reference_training(model_dir, data_dir, name, norms, losses)
    calls = {"forward": 0, "backward": 0}
    for fn in calls:
        real = getattr(chunked, fn)

        def counted(*a, _real=real, _fn=fn, **k):
            calls[_fn] += 1
            assert a[-2] <= 4  # (the chunk: 8 tokens over 2 rows)
            return _real(*a, **k)

        monkeypatch.setattr(chunked, fn, counted)
    assert run_cli(tmp_path, model_dir, data_dir, name, nvme_moments(tmp_path), tiermem_seq_chunk=8) == 0
    assert calls["forward"] > 0 and calls["backward"] > 0, calls
    assert_same_weights(tmp_path / "out", ref, tied=family == "qwen3")
    log = [json.loads(line) for line in (tmp_path / "out" / "trainer_log.jsonl").read_text().splitlines()]
    assert [r["grad_norm"] for r in log] == pytest.approx(norms, rel=1e-5)
    assert [r["loss"] for r in log] == pytest.approx(losses, rel=1e-5)


@pytest.mark.slow  # (two parity runs and plain PyTorch: seconds)
def test_kept_layers_over_rows_cut_into_chunks_train_the_recomputes_weights(tmp_path, capsys, monkeypatch):
    """tiermem_keep_activations over rows cut into chunks (tiermem_seq_chunk 8): every layer keeps its attention graph
    (the plan says so); the run ends with the recomputing run's weights bit for bit, and plain PyTorch's to rounding."""
    from safetensors.torch import load_file

    from tests.test_train_parity import assert_same_weights, reference_training, run_cli
    from tests.tiny_models import save_tiny_model, write_tokenized_dataset

    model_dir = save_tiny_model("llama", tmp_path / "model")
    data_dir = tmp_path / "data"
    name = write_tokenized_dataset(data_dir)
    ref = reference_training(model_dir, data_dir, name, [])
    roomy = {"tiers": {"gpu": {"device": "cpu", "budget": "64MiB"}, "dram": {"budget": "64MiB"}}}
    kept = []
    real = chunked.forward

    def forward(*a, keep=False, **k):
        kept.append(keep)
        return real(*a, keep=keep, **k)

    monkeypatch.setattr(chunked, "forward", forward)
    runs = {}
    for keep in (0, 3):  # (3: every layer; what auto chooses at this toy size is the cost model's near-tie)
        out = tmp_path / f"k{keep}"
        assert run_cli(tmp_path, model_dir, data_dir, name, roomy, output_dir=str(out), tiermem_seq_chunk=8,
                       tiermem_keep_activations=keep) == 0
        said = capsys.readouterr().out
        runs[keep] = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
        assert_same_weights(out, ref, tied=False)
    assert "the activations of layers 0-2 kept (no recompute)" in said, said
    assert True in kept and False in kept  # (the rows were cut into chunks, kept in the second run)
    assert all(torch.equal(runs[3][n], runs[0][n]) for n in runs[0])


def test_a_bad_seq_chunk_and_a_load_balancing_loss_over_chunks_are_refused(tmp_path, capsys):
    """tiermem_seq_chunk must be a number of tokens or auto; a MoE model whose load-balancing loss is on, with rows
    that would be cut, stops in one line (exit code 2) before anything is read."""
    from tests.test_train_parity import run_cli
    from tests.tiny_models import save_tiny_model, write_tokenized_dataset

    data_dir = tmp_path / "data"
    name = write_tokenized_dataset(data_dir)
    model_dir = save_tiny_model("llama", tmp_path / "model")
    assert run_cli(tmp_path, model_dir, data_dir, name, {"tiers": {"gpu": {"device": "cpu"}}},
                   tiermem_seq_chunk=0) == 2
    assert "tiermem_seq_chunk must be a number of tokens (1 or more) or auto, got 0" in capsys.readouterr().err
    moe_dir = save_tiny_model("qwen3_moe", tmp_path / "moe")
    assert run_cli(tmp_path, moe_dir, data_dir, name, {"tiers": {"gpu": {"device": "cpu"}}},
                   tiermem_seq_chunk=8) == 2
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if "error" in x]
    assert len(line) == 1 and "over rows cut into sequence chunks (4 tokens a row) is not supported yet" in line[0], err
    for rows in (1, 4):  # (a micro-batch cut into pieces, and two merged: the statistics are a micro-batch's)
        assert run_cli(tmp_path, moe_dir, data_dir, name, {"tiers": {"gpu": {"device": "cpu"}}},
                       tiermem_physical_batch_size=rows) == 2
        line = [x for x in capsys.readouterr().err.splitlines() if "error" in x]
        assert len(line) == 1 and f"moe_aux_loss_coef) with tiermem_physical_batch_size {rows} is not supported yet" \
            in line[0], line


@pytest.mark.parametrize("budget,chunk", [(None, None), pytest.param("1KiB", None, marks=pytest.mark.slow),
                                          pytest.param(None, 8, marks=pytest.mark.slow)])
def test_activations_in_dram_train_the_same_weights_as_on_the_gpu_and_plain_pytorch(tmp_path, monkeypatch, capsys,
                                                                                    budget, chunk):
    """tiermem_activations: dram puts every layer's input of a step in the arena (written as the forward leaves the
    layer, read back ahead of its backward), in one pass or (a small activation budget) a pass a micro-batch, with
    the layers whole or in sequence chunks (tiermem_seq_chunk 8): 5 fp32 steps end with plain PyTorch's weights,
    and with the very bits of the same run with its activations on the GPU; the plan says where they went, the
    store counted their bytes."""
    import json

    from safetensors.torch import load_file

    from tests.test_train_parity import assert_same_weights, reference_training, run_cli
    from tests.tiny_models import save_tiny_model, write_tokenized_dataset
    from trainer.run import offload

    model_dir = save_tiny_model("llama", tmp_path / "model")
    data_dir = tmp_path / "data"
    name = write_tokenized_dataset(data_dir)
    ref = reference_training(model_dir, data_dir, name, [])
    seen = {"reserved": 0, "taken": 0}
    real_take = offload.Stash.take

    def take(self, i, mb, here):
        got = real_take(self, i, mb, here)
        seen["taken"] += i in self.host
        seen["reserved"] = max(seen["reserved"], self.store.reserved().get("dram", 0))
        return got

    monkeypatch.setattr(offload.Stash, "take", take)
    weights = {}
    for where in ("dram", "gpu"):
        tiermem = {"tiers": {"gpu": {"device": "cpu", "budget": "256MiB"}, "dram": {"budget": "256MiB"}}}
        out = tmp_path / f"out-{where}"
        over = {"tiermem_activation_budget": budget} if budget else {}
        over.update({"tiermem_seq_chunk": chunk} if chunk else {})
        assert run_cli(tmp_path, model_dir, data_dir, name, tiermem, output_dir=str(out),
                       tiermem_activations=where, **over) == 0
        said = capsys.readouterr().out
        assert ("each step runs as 2 layer-major passes" in said) == (budget is not None), said
        assert ("boundary activations: every layer's input in dram" in said) == (where == "dram"), said
        assert_same_weights(out, ref, tied=False)
        weights[where] = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
        # (on the CPU stand-in the executor's tensors are host memory: the copies are the arena's own link's)
        moved = json.loads((out / "store_stats.json").read_text())["links"]["dram->dram"]["bytes"]
        assert (moved > 0) == (where == "dram"), moved
        if where == "dram":
            assert seen["taken"] > 0 and seen["reserved"] > 0, seen
            seen["taken"] = 0
    assert seen["taken"] == 0  # (the GPU run wrote nothing out)
    for k, v in weights["gpu"].items():
        assert torch.equal(v, weights["dram"][k]), k


def test_the_planner_places_boundary_activations_in_dram_where_one_pass_does_not_hold_them_on_the_gpu():
    """A step of 16 micro-batches whose boundary activations (8 GiB a layer) do not fit HBM beside a model whose
    state does not either: with activations on the GPU it takes several passes (each moving the streamed layers'
    partial gradients both ways); on auto the planner puts layers' inputs in DRAM (written out and read back over the
    link, which the cost model counts) and runs fewer passes, predicted faster, within every budget; a row too long
    for HBM at any number of passes (one micro-batch) is planned only so."""
    from tests.test_planner import GiB, machine, specs_for, store_cfg, workload
    from tiermem.plan.planner import plan_step

    layers = 8
    specs = specs_for(layers, 600_000_000, 100_000_000)
    m = machine(gpu_memory=80 * GiB)
    budgets = {"gpu": None, "dram": 200 * GiB, "nvme": 200 * GiB}
    w = workload(layers, tokens=16 * 65536, micro_batches=16, boundary=(layers + 1) * 4096 * 2)
    assert w.layer_boundary_bytes(1) == 8 * GiB  # (a layer's input, all 16 micro-batches)

    def plan(activations, wl=w):
        return plan_step(specs, store_cfg(), wl, m, budgets, cuda=True, activations=activations)

    on_gpu, auto, dram = plan(DEVICE), plan("auto"), plan(HOST)
    assert on_gpu.passes > 1 and on_gpu.act_host == 0
    assert auto.act_host > 0 and auto.passes < on_gpu.passes and auto.prediction.step < on_gpu.prediction.step
    assert dram.act_host == layers
    for p in (auto, dram):
        one = w.layer_boundary_bytes(p.passes)
        assert p.act_host_bytes >= p.act_host * one and p.need()["dram"] <= budgets["dram"]
        assert p.need()["gpu"] + p.activation_bytes <= p.hbm_room
        # (each boundary in DRAM goes out and comes back every pass: the link's bytes count it)
        assert p.prediction.bytes["d2h"] >= p.passes * p.act_host * one
        assert p.prediction.bytes["h2d"] >= p.passes * p.act_host * one
    assert on_gpu.prediction.bytes["d2h"] < dram.prediction.bytes["d2h"]
    # one long row: its boundaries (72 GiB) never fit beside the state and working set on the GPU
    row = workload(layers, tokens=1 << 20, micro_batches=1, boundary=(layers + 1) * 4096 * 2, working=10 * GiB)
    with pytest.raises(Exception, match="do not fit|does not fit"):
        plan(DEVICE, row)
    long = plan("auto", row)
    assert long.act_host >= 1 and long.passes == 1
    budgets["dram"] = 40 * GiB  # (DRAM short too: the refusal says the activations do not go to NVMe yet)
    with pytest.raises(Exception, match=r"boundary activations in DRAM were tried too; on NVMe they are not supported"):
        plan("auto", row)


def test_the_store_reserves_room_for_activations_and_counts_it():
    """Store.reserve / put / get / unreserve: a tensor written to an extent of the arena comes back bit for bit;
    stats() counts the reserved bytes as the kind "activations" of the tier until they are freed; no room is one
    line (BudgetError)."""
    from tiermem.config import load_store_config
    from tiermem.errors import BudgetError
    from tiermem.specs import TensorSpec
    from tiermem.store.store import Store

    cfg = load_store_config({"tiers": {"gpu": {"device": "cpu"}, "dram": {"budget": "64MiB"}},
                             "placement": {"param": "dram"}})
    specs = [TensorSpec("w", (1000,), torch.float32, "param", 0),
             TensorSpec("room", (4096,), torch.float32, "param", 1)]
    with Store.open(cfg, specs) as store:  # (the arena is sized for the specs: "room" gives its place back)
        store.delete("room").result()
        x = torch.randn(3, 50, 7, dtype=torch.bfloat16)
        place = store.reserve("dram", x.numel() * 2)
        assert store.stats()["tiers"]["dram"]["by_kind"]["activations"] >= x.numel() * 2
        store.put(x, place).result()
        back = torch.empty_like(x)
        store.get(place, back).result()
        assert torch.equal(back, x)
        store.unreserve(place)
        assert "activations" not in store.stats()["tiers"]["dram"]["by_kind"] and store.reserved() == {}
        with pytest.raises(BudgetError, match="dram has no room for a boundary activation"):
            store.reserve("dram", 1 << 40)


def test_the_planner_counts_a_long_rows_layer_in_chunks():
    """The working set planned for one row of 524,288 tokens of the Llama-3.1-8B shape is the chunked layer's (its
    hidden-wide tensors and one chunk's feed-forward: under 45 GiB), not the whole layer's (its 14336-wide
    activations for every token: over 100 GiB); a short row's is as before. A long row's kept layer holds its
    attention's graph alone (q, k, v, the output in bf16, the log-sum-exp in fp32: 10.1 GiB at 524,288 tokens) and
    skips the q/k/v and attention's share of its forward (most of it at that length); a short row's the whole."""
    from tests.test_planner import SHAPE_8B, GiB
    from tiermem.plan.machine import Machine
    from trainer.planning import plan_workload

    cfg = model_config_from_dict(SHAPE_8B)
    m = Machine.h200("test")

    def build(seq):
        return plan_workload.build(cfg, torch.bfloat16, 1, seq, 1, m, torch.device("cpu"), 4096, time_it=False)

    long = build(524288)
    assert long.layer_work_bytes < 45 * GiB and long.kept_bytes == 524288 * ((2 * 4096 + 2 * 1024) * 2 + 4 * 32)
    assert 0.8 < long.kept_saves < 1
    cfg.seq_chunk = 1 << 20  # (no chunks: the whole layer)
    assert build(524288).layer_work_bytes > 100 * GiB
    cfg.seq_chunk = None
    short = build(4096)
    assert short.layer_work_bytes == 4096 * (14 * 4096 + 4 * 14336) * 2 and short.kept_bytes > 0
    assert short.kept_saves == 1


@pytest.mark.parametrize("weight_fp32", [False, True])
def test_the_final_norm_runs_in_the_loss_chunks_and_is_the_whole_rows(monkeypatch, weight_fp32):
    """The loss's final norm (fp32 inside) sees one loss chunk of tokens at a time, in the training step's loss and
    in the evaluation's: no fp32 copy of the whole row. The loss, the hidden state's gradient and the norm's and
    head's gradients are the whole row's norm's, fp32 (gpt-oss's norm weight multiplying in fp32 too)."""
    from trainer.model import layers

    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, 37, 16, generator=gen)
    targets = torch.randint(0, 50, (2, 37), generator=gen)
    targets[0, :5] = -100
    norm_w = 1 + 0.1 * torch.randn(16, generator=gen)
    head_w = torch.randn(50, 16, generator=gen)
    eps, scale = 1e-5, 0.01

    def whole():  # (the whole row's norm, then the head and cross-entropy)
        x, nw, hw = h.clone().requires_grad_(), norm_w.clone().requires_grad_(), head_w.clone().requires_grad_()
        logits = torch.nn.functional.linear(layers.rms_norm(x, nw, eps, weight_fp32), hw).float()
        loss = torch.nn.functional.cross_entropy(logits.view(-1, 50), targets.view(-1), ignore_index=-100,
                                                 reduction="sum")
        return (loss.detach(), *torch.autograd.grad(loss * scale, [x, nw, hw]))

    ref = whole()
    seen = []
    real = layers.rms_norm

    def norm(x, *a, **k):
        seen.append(x.numel() // x.shape[-1])
        return real(x, *a, **k)

    monkeypatch.setattr(layers, "rms_norm", norm)
    got = layers.head_loss_backward(h, targets, norm_w, head_w, eps, scale, 10, None, weight_fp32)
    assert seen and max(seen) <= 10 and sum(seen) == 74
    seen.clear()
    evaluated = layers.head_loss(h, targets, norm_w, head_w, eps, 10, weight_fp32)
    assert seen and max(seen) <= 10 and sum(seen) == 74
    assert torch.allclose(evaluated, ref[0], rtol=1e-6)
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
