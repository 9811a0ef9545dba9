"""tools/bench_long.py (issue 39): a long row's step against the ceiling of its schedule's kernels timed alone, on
the CPU stand-in (the figures come from the GPU machine): the table's figures agree, and the kernels are counted as
often as the chunked layer really runs them."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent.parent / "tools"))
import bench_long  # noqa: E402


class _Count(TorchDispatchMode):
    """The matmuls and the attention's kernels that run under it."""

    def __init__(self):
        super().__init__()
        self.seen: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "scaled_dot_product" in name:
            self.seen["attention backward" if "backward" in name else "attention forward"] += 1
        elif name.split(".")[1] in ("mm", "bmm", "addmm"):
            self.seen["matmul"] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("seq_chunk,kept", [(16, False), (16, True), (None, False), (None, True)])
def test_the_schedule_counts_what_a_layers_forward_and_backward_run(seq_chunk, kept):
    """One layer's forward and its backward with recompute, counted at the dispatcher: the attention's forward
    twice and its backward once; the projections' matmuls as layer_schedule says (q/k/v three times forward in a
    row cut into chunks: 31 matmuls a chunk; a whole row's 28). A kept layer (tiermem_keep_activations) runs the
    attention's forward once, q/k/v twice over chunks (28 a chunk), and recomputes nothing of a whole row (21)."""
    from trainer.model.config import model_config_from_dict
    from trainer.model.select import model_stages
    from trainer.model.weights import layer_weights

    cfg = model_config_from_dict(bench_long.TINY)
    cfg.seq_chunk = seq_chunk
    stages = model_stages(cfg, torch.float32, torch.device("cpu"))
    w = {lw.local: torch.randn(lw.shape) * 0.05 for lw in layer_weights(cfg, 0)}
    ids = torch.randint(0, cfg.vocab_size, (1, 64))
    ctx = stages.contexts([ids], [None], 1, True)[0]
    x = torch.randn(1, 64, cfg.hidden_size)
    with _Count() as count:
        if kept:
            with torch.no_grad():
                _, graph = stages.layer_graph(0, w, x, ctx)
            stages.graph_backward(graph, torch.randn_like(x))
        else:
            with torch.no_grad():
                stages.layer(0, w, x, ctx)
            stages.layer_backward(0, w, x, torch.randn_like(x), ctx)
    planned = bench_long.layer_schedule(cfg, 1, 64, kept)
    said: Counter = Counter()
    for (name, _), calls in planned.items():
        said[name if name.startswith("attention") else "matmul"] += calls
    assert said == count.seen
    assert said["attention forward"] == (1 if kept else 2) and said["attention backward"] == 1
    assert said["matmul"] == {(16, False): 31 * 4, (16, True): 28 * 4, (None, False): 28, (None, True): 21}[
        seq_chunk, kept]
    steps = Counter()
    for k in bench_long.schedule(cfg, 1, 64, 4096, kept=1):  # (a step of 2 layers, one kept)
        steps[k.name] += k.calls
    assert steps["attention forward"] == 3 and steps["attention backward"] == 2


def test_bench_long_runs_on_the_cpu_stand_in_and_its_table_adds_up(tmp_path, capsys):
    out = bench_long.main(["--shape", "tiny", "--seq", "64", "--seq-chunk", "16", "--steps", "1",
                           "--out", str(tmp_path)])
    res = json.loads((tmp_path / "bench_long.json").read_text())
    assert res["ceiling_s"] == pytest.approx(out["ceiling_s"]) and res["ceiling_s"] > 0 and res["step_s"] > 0
    assert res["step_over_ceiling"] == pytest.approx(res["step_s"] / res["ceiling_s"])
    assert sum(res["gap_split_s"].values()) == pytest.approx(res["step_s"] - res["ceiling_s"], abs=1e-9)
    assert res["ceiling_s"] == pytest.approx(sum(k["seconds"] * k["calls"] for k in res["kernels"]))
    assert res["tflops_attention"] > res["tflops"] > 0
    layers, chunks = res["layers"], 64 // 16
    calls = Counter()
    for k in res["kernels"]:
        calls[k["name"]] += k["calls"]
    assert calls["attention forward"] == 2 * layers and calls["attention backward"] == layers
    assert calls["q_proj forward"] == 3 * chunks * layers and calls["gate_proj forward"] == 2 * chunks * layers
    assert calls["down_proj weight grad"] == calls["k_proj input grad"] == chunks * layers
    assert calls["lm_head forward"] == calls["lm_head weight grad"] == 1  # (64 tokens: one loss chunk)
    printed = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("step / ceiling") for line in printed[-12:])
    assert printed[-1].strip().startswith("between the executor's steps")
