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
