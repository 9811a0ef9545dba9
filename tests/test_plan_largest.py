"""``tiermem plan --machine FILE --largest CFG`` (issue 41): the largest depth of a model family that trains on
a described machine: that depth plans, one more is refused, and the answer leads the plan's lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_machine_file import SMALL, cli, train_yaml, write

from tiermem.errors import BudgetError

ROOT = Path(__file__).parent.parent
# the 8B shape's layers (0.22 B params, 3.9 GB of state each) on a machine of 64 GiB of host memory and one
# 40 GB disk: a few dozen layers
TIGHT = dict(SMALL, gpu={"memory": "80GiB", "bf16_tflops": 989}, host={"memory": "64GiB", "cores": 16, "adamw": 4},
             nvme=[{"read": 3, "write": 2, "size": "40GB"}])


def plan_at(cfg: Path, machine: Path, depth: int):
    """``tiermem plan``'s plan of ``cfg``'s model at ``depth`` layers on ``machine`` (BudgetError: refused)."""
    from trainer.plan_cli import _args, plan

    return plan(_args([str(cfg), "--machine", str(machine)]), depth)


def test_the_largest_depth_plans_and_one_more_does_not(tmp_path, capsys):
    cfg, machine = train_yaml(tmp_path), write(tmp_path, TIGHT)
    rc, out, err = cli(capsys, "plan", "--machine", machine, "--largest", cfg, "--json")
    assert rc == 0, err
    data = json.loads(out)
    n = data["largest"]["layers"]
    assert data["model"]["layers"] == n and data["largest"]["config_layers"] == 32 and 1 < n
    assert data["largest"]["refused_layers"] == n + 1 and "does not fit" in data["largest"]["refused"]
    plan_at(cfg, machine, n)
    with pytest.raises(BudgetError):
        plan_at(cfg, machine, n + 1)
    rc, out, err = cli(capsys, "plan", "--machine", machine, "--largest", cfg)
    first = out.splitlines()[0]
    assert first.startswith(f"largest: {n} layers (") and "tokens/s" in first and "with attention" in first
    assert "MFU" in first and out.splitlines()[1].startswith(f"  {n + 1} layers do not:")


def test_largest_takes_overrides(tmp_path, capsys):
    """key=value overrides apply to every depth planned: a smaller DRAM budget, fewer layers."""
    cfg, machine = train_yaml(tmp_path, nvme=False), write(tmp_path, TIGHT)
    depth = {}
    for budget in ("32GiB", "8GiB"):
        rc, out, err = cli(capsys, "plan", "--machine", machine, "--largest", cfg, "gradient_accumulation_steps=2",
                           f"tiermem.tiers.dram.budget={budget}", "--json")
        assert rc == 0, err
        data = json.loads(out)
        assert data["shape"]["micro_batches"] == 2 and data["tiers"]["dram"]["budget"] == int(budget[:-3]) << 30
        depth[budget] = data["largest"]["layers"]
    assert depth["8GiB"] < depth["32GiB"]


def test_a_machine_that_holds_more_than_searched_says_at_least(tmp_path, capsys):
    """The 3B shape at 2 layers on h200-1.5tb: 16 layers (8x the config's) still fit: "at least"."""
    cfg = train_yaml(tmp_path, "3b", num_hidden_layers=2)
    rc, out, err = cli(capsys, "plan", "--machine", ROOT / "configs/machines/h200-1.5tb.yaml", "--largest", cfg)
    assert rc == 0, err
    assert out.startswith("largest: 16 layers") and "(at least: 16 layers" in out.splitlines()[1]


def test_nothing_fits_is_one_line(tmp_path, capsys):
    cfg = train_yaml(tmp_path, nvme=False)
    tiny = write(tmp_path, dict(TIGHT, gpu={"memory": "8GiB", "bf16_tflops": 989}, host={"memory": "8GiB",
                                                                                         "cores": 8}))
    rc, out, err = cli(capsys, "plan", "--machine", tiny, "--largest", cfg)
    assert rc == 2 and err.count("\n") == 1 and "not one layer of this model trains" in err, err


@pytest.mark.parametrize("argv,needle", [
    (["--largest", "X.yaml"], "give --machine FILE too"),
    (["Y.yaml", "--machine", "M.yaml", "--largest", "X.yaml"], "give no other config"),
    ([], "give a training YAML"),
])
def test_largest_arguments_that_do_not_go_together(capsys, argv, needle):
    rc, out, err = cli(capsys, "plan", *argv)
    assert rc == 2 and err.count("\n") == 1 and needle in err, err
