"""The GPU tools' code paths, run on the CPU stand-in (their figures come from the GPU machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import child_env

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_profile_step_splits_a_step_by_kind_and_sets_it_against_the_ceiling(tmp_path):
    """tools/profile_step.py on the tiny shape: a table of operator time by kind whose rows add up to the
    total, the step's compute and its standalone ceiling, a Chrome trace and the JSON."""
    out = tmp_path / "p.json"
    run = subprocess.run([sys.executable, "tools/profile_step.py", "--shape", "tiny", "--batch", "1", "--accum", "2",
                          "--seq", "64", "--warmup", "1", "--trace", str(tmp_path / "t.json"), "--json", str(out)],
                         cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "matmul" in run.stdout and "standalone ceiling of the same schedule" in run.stdout
    assert "TFLOP/s (6 N tokens; " in run.stdout and " with causal attention)" in run.stdout  # (issue 39 item 4)
    res = json.loads(out.read_text())
    assert res["kinds_ms"]["matmul"] > 0 and abs(sum(res["kinds_ms"].values()) - res["total_ms"]) < 1e-6
    assert res["compute_s"] > 0 and res["ceiling_s"] > 0
    assert res["ceiling_before_s"] > 0 and "timed before the run's steps" in run.stdout
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]


def test_profile_step_refuses_a_real_shape_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    run = subprocess.run([sys.executable, "tools/profile_step.py", "--shape", "3b"], cwd=ROOT, env=child_env(),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "needs a CUDA GPU" in run.stderr


@pytest.mark.slow
def test_the_gpt_oss_shape_is_planned_at_the_depth_the_gpu_check_trains(tmp_path, capsys):
    """tools/make_shape_run.py's gpt-oss-120B at 3 layers (tools/gpu_model_check.sh) is a template model with its
    sliding windows alternating, and `tiermem plan` places its 64 x 4096-token step on the H200 machine's figures
    (HBM and DRAM, no NVMe)."""
    from tiermem.cli.main import main as tiermem

    run = subprocess.run([sys.executable, "tools/make_shape_run.py", "--shape", "gpt-oss-120b", "--layers", "3",
                          "--dir", str(tmp_path), "--accum", "64", "--steps", "1", "--seq", "16"], cwd=ROOT,
                         env=child_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    from trainer.model.config import load_model_config

    cfg = load_model_config(tmp_path / "model")
    assert cfg.family == "gpt_oss" and cfg.windows == (128, None, 128) and cfg.rope["rope_type"] == "yarn"
    assert tiermem(["plan", str(tmp_path / "train.yaml"), "cutoff_len=4096", "--probe", "h200"]) == 0
    said = capsys.readouterr().out
    assert "gpt_oss, 10.80 B params, 3 layers" in said and "64 x 1 rows x 4096 tokens" in said, said


@pytest.mark.slow
@pytest.mark.parametrize("shape,args,said", [
    ("qwen3-next-80b-a3b", ["--layers", "6"], "qwen3_next, 10.51 B params, 6 layers"),
    ("deepseek-v3", ["--layers", "5", "--experts", "64"], "deepseek_v3, 9.70 B params, 5 layers")])
def test_the_generic_shapes_are_planned_at_the_depth_the_gpu_check_trains(tmp_path, capsys, shape, args, said):
    """tools/gpu_model_check.sh's moe-plan mode: make_shape_run.py's Qwen3-Next-80B-A3B and DeepSeek-V3 shapes (the
    generic path, from config.json alone) reduced as the GPU check trains them, planned by `tiermem plan` on the
    H200 machine's figures."""
    from tiermem.cli.main import main as tiermem

    run = subprocess.run([sys.executable, "tools/make_shape_run.py", "--shape", shape, *args, "--dir", str(tmp_path),
                          "--accum", "64", "--steps", "1", "--seq", "16"], cwd=ROOT, env=child_env(),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert tiermem(["plan", str(tmp_path / "train.yaml"), "cutoff_len=4096", "--probe", "h200"]) == 0
    out = capsys.readouterr().out
    assert said in out and "64 x 1 rows x 4096 tokens" in out and "predicted step" in out, out


@pytest.mark.slow
def test_the_dpo_shape_run_is_pairs_and_planned_as_two_rows_a_pair(tmp_path, capsys):
    """make_shape_run.py --stage dpo: tokenized pairs (a prompt masked, two responses), stage dpo; `tiermem plan`
    counts a micro-batch of one pair as 2 rows and says where the reference comes from (the 8B DPO measurement's
    setup, README's GPU command)."""
    from tiermem.cli.main import main as tiermem

    run = subprocess.run([sys.executable, "tools/make_shape_run.py", "--shape", "8b", "--dir", str(tmp_path), "--stage",
                          "dpo", "--accum", "8", "--steps", "1", "--seq", "16"], cwd=ROOT, env=child_env(),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    pair = json.loads((tmp_path / "data" / "tokens.jsonl").read_text().splitlines()[0])
    assert pair["chosen_input_ids"][:4] == pair["rejected_input_ids"][:4] and pair["chosen_labels"][:4] == [-100] * 4
    assert tiermem(["plan", str(tmp_path / "train.yaml"), "cutoff_len=2048", "--probe", "h200"]) == 0  # (the GPU's)
    out = capsys.readouterr().out
    assert "8 x 2 rows x 2048 tokens" in out and "stage dpo: DPO (sigmoid)" in out, out


@pytest.mark.slow
def test_a_service_benchmark_cut_short_leaves_no_arena(tmp_path):
    """tools/bench_service.py stopped by SIGTERM (the GPU machine's `timeout`) during its attached run stops its
    service and removes the stores' arenas: a 100 GiB arena left in /dev/shm made the next command's plan fail."""
    import os
    import signal

    shm = tmp_path / "shm"
    shm.mkdir()
    bench = subprocess.Popen([sys.executable, "tools/bench_service.py", "--small", "--planned", "--seq", "64",
                              "--batch", "1", "--accum", "1", "--steps", "400", "--layers", "2", "--shm", str(shm)],
                             cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        said = []
        for line in bench.stdout:  # (the embedded run done, the attached one starting)
            said.append(line)
            if line.startswith("embedded:"):
                break
        deadline = 300
        while not (shm / "bench-service.arena").exists() and deadline > 0 and bench.poll() is None:
            deadline -= 1
            subprocess.run(["sleep", "1"])
        assert (shm / "bench-service.arena").exists(), "".join(said)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        bench.kill()
    assert not [p for p in os.listdir(shm) if not p.endswith(".lock")], os.listdir(shm)
