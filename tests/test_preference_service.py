"""Stage dpo attached to a service (`tiermem serve`, CPU): the reference's figures computed before the first step
as an embedded run computes them and kept in output_dir (tiermem_reference.json); a trainer killed mid-run
(forward, optimizer) and rerun continues the service's run with those figures, bit-identical to the uninterrupted
and the embedded run, every step's line and figures included; two ranks attached, one killed, continue as one
embedded process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from tests.procs import ROOT, child_env
from tests.test_preference_parity import write_pairs
from tests.test_service import PLACEMENT, Service
from tests.test_train_dp import assert_same_weights, ranks
from tests.tiny_models import save_tiny_model
from trainer.cli import main

pytestmark = pytest.mark.slow  # services in subprocesses

FIGURES = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "sft_loss")


@pytest.fixture
def env(tmp_path):
    save_tiny_model("llama", tmp_path / "model")
    write_pairs(tmp_path / "data", n_pairs=14, seed=5)
    (tmp_path / "shm").mkdir()
    sock = Path(tempfile.mkdtemp(prefix="tm-")) / "s.sock"  # (Unix socket paths are limited to 107 bytes)
    svc = tmp_path / "serve.yaml"
    svc.write_text(yaml.safe_dump({
        "name": f"dpo{os.getpid()}", "placement": PLACEMENT, "optimizer": {"gpu_share": 0.5, "cpu_groups": "spread"},
        "tiers": {"gpu": {"device": "cpu"}, "dram": {"path": str(tmp_path / "shm"), "budget": "64MiB"},
                  "nvme": {"path": str(tmp_path / "nvme"), "budget": "64MiB", "backend": "posix"}}}))

    def config(name: str, attached: bool = True, per_device: int = 2, **over) -> Path:
        cfg = dict(model_name_or_path=str(tmp_path / "model"), stage="dpo", dataset="pairs",
                   dataset_dir=str(tmp_path / "data"), output_dir=str(tmp_path / name),
                   per_device_train_batch_size=per_device, gradient_accumulation_steps=2, max_steps=6,
                   learning_rate=1e-2, lr_scheduler_type="cosine", warmup_steps=1, weight_decay=0.1,
                   max_grad_norm=0.5, seed=7, logging_steps=1, bf16=False, pref_beta=0.5, pref_ftx=0.3,
                   overwrite_output_dir=False)
        if attached:
            cfg["tiermem_server"] = str(sock)
        else:
            cfg["tiermem"] = {"tiers": {"gpu": {"device": "cpu"}, "dram": {"budget": "64MiB"}},
                              "optimizer": {"gpu_share": 0}}
        cfg.update(over)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    service = Service(svc, sock, env={"TIERMEM_TEST_SLOW_UPDATE": "0.03"})  # (the update outlives the trainer)
    yield tmp_path, config, service
    assert service.stop() == 0, service.text
    for p in (tmp_path / "shm").glob("*"):
        p.unlink()


def _train(path: Path, kill_at: str | None = None) -> subprocess.CompletedProcess:
    env = child_env(**({"TIERMEM_TEST_KILL_AT": kill_at} if kill_at else {}))
    return subprocess.run([sys.executable, "-m", "trainer.cli", str(path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def _log(out: Path) -> list[list]:
    rows = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    return [[r["current_steps"], *(r[k] for k in FIGURES)] for r in rows]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_a_killed_attached_trainer_continues_with_the_kept_reference_bit_identically(env):
    tmp, config, svc = env
    assert main([str(config("embedded", attached=False))]) == 0
    embedded = load_file(tmp / "embedded" / "model.safetensors")
    straight = _train(config("straight"))
    assert straight.returncode == 0, straight.stderr
    assert "(a new run)" in straight.stdout and "reference log-probabilities of 14 pairs" in straight.stdout
    assert _same(load_file(tmp / "straight" / "model.safetensors"), embedded)
    kept = json.loads((tmp / "straight" / "tiermem_reference.json").read_text())
    assert len(kept["sums"]) == 28 and kept["source"] == "the starting model"
    for point, resumes_at in (("forward:3", 2), ("optimizer:3", 3)):
        name = point.replace(":", "")
        killed = _train(config(name), kill_at=point)
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        assert (tmp / name / "tiermem_reference.json").is_file()
        again = _train(config(name))
        assert again.returncode == 0, again.stderr
        assert f"continuing the service's run at step {resumes_at}" in again.stdout, again.stdout
        assert "reference log-probabilities of" not in again.stdout  # (read back, not computed again)
        assert _same(load_file(tmp / name / "model.safetensors"), embedded), point
        assert _log(tmp / name) == _log(tmp / "straight"), point
    # its kept figures lost: the rerun says so in one line rather than compute them from weights that moved
    killed = _train(config("lost"), kill_at="forward:3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    (tmp / "lost" / "tiermem_reference.json").unlink()
    again = _train(config("lost"))
    err = again.stderr.strip().splitlines()
    assert again.returncode == 2 and len(err) == 1 and "holds no reference log-probabilities" in err[0], again.stderr
    svc.wait_for("finished at step 6")


def test_two_attached_ranks_one_killed_continue_as_one_embedded_process(env):
    """With a ref_model of its own: rank 0 loads its weights into the service's store for the pass and the
    starting ones back; rank 1 killed mid-step, the same command continues the service's run."""
    tmp, config, svc = env
    other = save_tiny_model("llama", tmp / "ref", seed=11)
    assert main([str(config("one", attached=False, per_device=4, ref_model=str(other)))]) == 0
    path = config("two", ref_model=str(other), tiermem_dist_timeout=300)  # (30 s: a slow rank under load)
    r = ranks(path, 2, TIERMEM_TEST_KILL_AT="backward:5", TIERMEM_TEST_KILL_RANK="1")
    assert r.returncode != 0, r.stderr[-3000:]
    svc.wait_for("the run's other ranks with it")
    r = ranks(path, 2)
    assert r.returncode == 0, (r.stderr[-3000:], svc.text)
    assert "continuing the service's run at step 4" in r.stdout, r.stdout
    assert_same_weights(tmp / "one", tmp / "two")
    svc.wait_for("finished at step 6")
