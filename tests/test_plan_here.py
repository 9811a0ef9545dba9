"""`tiermem plan` on a machine without a GPU: it plans for the machine a probe file describes, or for this machine's
own figures (the CPU stand-in's, measured; fixed here, so the test does not turn on this machine's speed), and says
which, every figure in words."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tiermem.plan import here
from tiermem.plan.machine import H200
from trainer.plan_cli import main as plan_main
from trainer.planning.run_plan import updates_split

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="plans of a machine without a GPU")

# a fixed description of this machine's CPU: 50 GFLOP/s of matmuls, 5 GB/s memory copies, CPU AdamW 0.2 G params/s
FIXED = {"matmul_rate": lambda *a: 50e9, "memcpy_rates": lambda *a: {"h2d": 5e9, "d2h": 5e9},
         "adamw_rate": lambda *a: (2e8, "fused", 2), "copy_rate": lambda *a: 4e8}


def plan(argv, capsys) -> tuple[int, str, str]:
    rc = plan_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def fixed_cpu(monkeypatch):
    monkeypatch.chdir(ROOT)
    for name, fn in FIXED.items():
        monkeypatch.setattr(here, name, fn)


def test_without_a_gpu_or_a_probe_file_the_plan_is_for_this_machine_in_words(fixed_cpu, capsys):
    rc, text, err = plan(["configs/quickstart.yaml"], capsys)
    assert rc == 0, err
    assert "machine: this machine's own figures (no GPU here: the CPU stand-in computes; measured now)" in text
    assert "compute: estimated from FLOPs at 0.05 TFLOP/s (the machine's figure)" in text, text
    assert "520 TFLOP/s" not in text and "131.0 GiB usable HBM" not in text  # (no H200 compute or HBM mixed in)
    # (a CPU's rates in significant digits, not rounded to 0 TFLOP/s)
    assert " 0 TFLOP/s" not in text and "(0 with" not in text and "of 0.05 TFLOP/s" in text, text
    assert "updates: GPU 6 groups, CPU 0 groups" in text
    for key in H200:  # every figure in words, none by its name in the code
        assert key == "ram" or key not in text, (key, text)
    assert "the disk" not in text  # (the quickstart has no storage tier: its disk's figures are of no use)
    rc, js, _ = plan(["configs/quickstart.yaml", "--json"], capsys)
    data = json.loads(js)
    assert data["machine"]["gpu_tflops"] == 50e9 and data["machine"]["cpu_adamw"] == 2e8
    # the quickstart's ~5 GFLOP a step (its 0.9 M params, 1,024 tokens, the recompute) at 50 GFLOP/s: a tenth of a
    # second, as its steps on a CPU take (the H200's figures predicted 0.00 s)
    assert 0.05 < data["prediction"]["step_seconds"] < 0.5, data["prediction"]


def test_a_probe_files_machine_is_named_and_this_disks_budget_is_said_not_mixed_in(fixed_cpu, capsys, tmp_path):
    probe = json.loads((ROOT / "tests/golden/probe_h200.json").read_text())
    probe["machine"].pop("disk_free", None)  # (a probe file made without a disk to measure)
    (tmp_path / "p.json").write_text(json.dumps(probe))
    rc, text, err = plan(["configs/quickstart.yaml", "--probe", tmp_path / "p.json",
                          f"tiermem.tiers.nvme.path={tmp_path / 'nvme'}"], capsys)
    assert rc == 0, err
    assert f"machine: the one the probe file {tmp_path / 'p.json'} describes; not measured, the H200 machine's " \
           "figures for " in text, text
    assert "this machine's free disk space (the figures have none of theirs: set tiers.nvme.budget" in text, text
    assert not (tmp_path / "nvme").exists()  # (nothing made)


def test_this_machines_figures_are_measured_and_the_rest_said_to_be_assumed(monkeypatch):
    monkeypatch.setattr(here, "adamw_rate", FIXED["adamw_rate"])  # (its first fused step takes seconds to set up)
    m = here.cpu_machine(gpu_budget=1 << 30)
    assert m.gpu_memory == 1 << 30 and m.gpu_tflops > 0 and m.h2d > 0 and m.cpu_copy > 0
    assert m.gpu_adamw == m.cpu_adamw == 2e8
    assert set(m.assumed) == {"copy_drag", "cpu_in_run", "duplex", "nvme_both", "nvme_read", "nvme_write"}
    assert here.in_words(["duplex", "cpu_adamw"]) == "the link both ways at once, CPU AdamW"


def test_the_split_of_the_updates_counts_in_words():
    assert updates_split(1, 6) == "GPU 1 group, CPU 5 groups"
    assert updates_split(0, 1) == "GPU 0 groups, CPU 1 group"


def test_probe_h200_plans_for_the_h200_machines_figures_without_a_probe_file(fixed_cpu, capsys):
    """`--probe h200`: the H200 machine's figures by name (the shapes' plans in tools/ run anywhere so)."""
    rc, text, err = plan(["configs/quickstart.yaml", "--probe", "h200"], capsys)
    assert rc == 0, err
    assert "machine: the H200 machine's figures (docs/measurements.md), as --probe h200 asks\n" in text, text
    assert "compute: estimated from FLOPs at 520 TFLOP/s" in text and "131.0 GiB usable HBM" in text
