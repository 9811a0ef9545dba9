"""The ``tiermem`` command on a machine without CUDA: probe runs and says so; bad input exits 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "tiermem.cli", *args], capture_output=True, text=True, cwd=cwd)


@pytest.mark.slow
def test_probe_json(tmp_path):
    disk = tmp_path / "new"  # created, as tiers.nvme.path is when its parent exists
    r = run("probe", "--size", "4MiB", "--reps", "1", "--json", "--save", str(tmp_path / "p.json"),
            "--nvme-path", str(disk))
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    saved = json.loads((tmp_path / "p.json").read_text())  # (a machine file, the probe's rows beside)
    assert saved["rows"] == result["rows"] and saved["host"]["memory"] == result["machine"]["ram"]
    from tiermem.plan.machine_file import load_machine

    m = load_machine(tmp_path / "p.json")  # (what tiermem plan --machine reads: the disk and CPU as measured)
    assert m.nvme_read == pytest.approx(saved["nvme"][0]["read"] * 1e9) and "cpu_adamw" not in m.assumed
    rows = {row["link"]: row for row in result["rows"]}
    assert rows["arena -> NVMe (posix)"]["tiermem"] > 0 and rows["arena -> NVMe (posix)"]["ratio"] > 0
    assert rows["NVMe -> arena (posix)"]["raw"] > 0
    assert rows["CPU AdamW"]["tiermem"] > 0 and rows["CPU compute copy"]["tiermem"] > 0
    if not torch.cuda.is_available():
        assert rows["arena -> GPU"]["note"] == "no CUDA on this machine"
    assert disk.is_dir() and not list(disk.glob("*.nvme"))  # the probe cleans up


@pytest.mark.slow
def test_bad_input_exits_2(tmp_path):
    (tmp_path / "c.yaml").write_text("not a directory")
    for args in (["probe", "--size", "lots"], ["probe", "--nvme-path", str(tmp_path / "no" / "parent")],
                 ["probe", "--nvme-path", str(tmp_path / "c.yaml")],
                 ["probe", "--size", "10"]):
        r = run(*args)
        assert r.returncode == 2, args
        assert r.stderr.startswith("tiermem: error:") and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
