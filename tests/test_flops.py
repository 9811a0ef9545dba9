"""The FLOPs a token the figures count (issue 39 item 4): 6·N beside attention's, causal (the s² term halved),
each layer at its own window; the same count in the planner's workload, the step line and trainer_log.jsonl."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tiermem.plan.flops import attended_keys, attention_flops_per_token
from trainer.model.config import model_config_from_dict
from trainer.planning.flops import flops_per_token

sys.path.insert(0, str(Path(__file__).parent.parent / "tools"))
from make_shape_run import SHAPES  # noqa: E402


def test_causal_attention_is_half_the_square_and_a_window_caps_it():
    assert attended_keys(4096) == 2048
    assert attended_keys(4096, 8192) == 2048  # (a window longer than the row: plain causal)
    assert attended_keys(4096, 128) == 128 - 128 * 128 / (2 * 4096)
    assert attention_flops_per_token([(4096, None)] * 32, 131072) == 12 * 4096 * 65536 * 32


def test_the_8b_shape_at_a_128k_row_counts_attention_by_hand():
    """Llama-3.1-8B: 32 layers of 32 x 128 query width; at 131,072 tokens a row attention adds 12·q·s/2 a layer
    (103 GFLOP a token) to 6·N (48 GFLOP): the long row's 124 TFLOP/s by 6·N is 389 with attention."""
    cfg = model_config_from_dict(SHAPES["8b"])
    dense, attention = flops_per_token(cfg, 131072)
    assert dense == 6 * cfg.num_params(active=True) == 6 * 8_030_261_248
    assert attention == 32 * 12 * 4096 * 131072 / 2
    assert (dense + attention) / dense * 124 == pytest.approx(389, abs=1)


def test_gpt_oss_counts_its_sliding_layers_at_their_window():
    """gpt-oss-120b alternates sliding (128 tokens) and full layers, 64 heads of 64: at 4096-token rows, 18 layers
    attend 2048 keys a query and 18 attend 128 - 128²/8192."""
    cfg = model_config_from_dict(SHAPES["gpt-oss-120b"])
    _, attention = flops_per_token(cfg, 4096)
    q = 64 * 64
    assert attention == pytest.approx(18 * 12 * q * 2048 + 18 * 12 * q * (128 - 128 * 128 / 8192))


def test_the_planner_workload_carries_attention_and_its_tflops(tmp_path):
    """The workload the planner estimates holds both counts, its JSON round-trips them, and TFLOP/s with
    attention is (6·N + attention) tokens / seconds."""
    import torch

    from tiermem.plan.machine import Machine
    from tiermem.plan.planner import tflops
    from tiermem.plan.workload import Workload
    from trainer.planning.plan_workload import build

    cfg = model_config_from_dict(dict(SHAPES["8b"], num_hidden_layers=2))
    m = Machine.h200()
    m.gpu_attention_tflops = 400e12  # (attention's matmuls at their own rate)
    w = build(cfg, torch.bfloat16, 1, 8192, 2, m, torch.device("cpu"), 4096, time_it=False)
    assert w.attention_flops_per_token == 2 * 12 * 4096 * 4096
    assert Workload.from_json(json.loads(json.dumps(w.to_json()))).attention_flops_per_token == \
        w.attention_flops_per_token
    assert tflops(w, 2.0, attention=True) == pytest.approx(
        (w.flops_per_token + w.attention_flops_per_token) * w.tokens / 2.0 / 1e12)
    assert tflops(w, 2.0) == pytest.approx(w.flops_per_token * w.tokens / 2.0 / 1e12)
    # (the estimate's layer forward: its matmuls at the GPU's rate and a third of its attention's training count
    # at attention's)
    f = (2 * cfg.layer_params(0, active=True) / m.gpu_tflops + 12 * 4096 * 4096 / 3 / 400e12) * w.tokens
    # (and its backward three times that, with the layer's cost a piece for each of the 2 micro-batches)
    assert w.piece_seconds == pytest.approx(cfg.layer_params(0) / m.gpu_piece_rate)
    assert w.fwd[0] == pytest.approx(f) and w.bwd[0] == pytest.approx(3 * f + 2 * w.piece_seconds)
    assert "attention's at 400" in w.timed


def test_the_step_line_and_trainer_log_report_tflops_with_attention(tmp_path):
    from trainer.outputs.report import Reporter
    from trainer.run.executor import StepResult

    lines = []
    rep = Reporter(tmp_path, 1, 1_000_000_000, lines.append, attention_flops=2e9)
    rep.step(1, StepResult(1.0, 1.0, 100_000, 1.0, 0.0, 0.0, {}), 0.1, 1.0, 1.0, True, 1)
    # 100k tokens/s: 6e9 FLOP a token by 6·N = 600 TFLOP/s; with attention 8e9 = 800
    assert "600 TFLOP/s (800 with attention)" in lines[-1]
    record = json.loads((tmp_path / "trainer_log.jsonl").read_text().splitlines()[-1])
    assert record["tflops"] == 600 and record["tflops_attention"] == 800


def test_tiermem_top_shows_tflops_with_attention_beside():
    """A run's snapshot with ``tflops_attention`` (the stats file's, checked by its shape) shows both figures."""
    from test_top import SNAPSHOT, frame

    from tiermem.store.stats import _RUN, _part

    run = {**SNAPSHOT["run"], "tflops_attention": 231.25}
    assert _part(run, "run", _RUN) is None
    assert "tflops_attention" in _part({**run, "tflops_attention": "fast"}, "run", _RUN)  # (a figure it checks)
    text = " ".join(frame({**SNAPSHOT, "run": run}).split())
    assert "210 TFLOP/s (231 with attention)" in text
