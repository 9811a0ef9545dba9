"""A service that keeps state in HBM (issue 43), on the CPU stand-in: its "HBM" is host memory the service owns (a
memfd its trainer maps), so the same code paths run as on a GPU. An attached run with state there ends with the
embedded run's weights; kill -9 of the trainer (mid-update included) loses nothing; kill -9 of the service loses
the HBM: the run comes back from its last checkpoint (durability: checkpoint) or from the copies in DRAM
(durability: step), bit-identical either way."""

from __future__ import annotations

import signal

import pytest

from tests.test_service import _wait_for_steps, env, losses, same  # noqa: F401 - (env: the fixture)
from tiermem.cli.top import read_service

pytestmark = pytest.mark.slow  # services in subprocesses

HBM = {"param": "gpu", "grad": "gpu", "master": "gpu", "exp_avg": "gpu", "exp_avg_sq": "gpu"}
HBM_GRAD_DRAM = dict(HBM, grad="dram")  # (durability: step keeps the gradients in the arena)
MIXED = {"param": "gpu", "grad": "dram", "master": "gpu", "exp_avg": "gpu", "exp_avg_sq": "dram"}


@pytest.mark.parametrize("placement,share", [(HBM, 0), (MIXED, 0.5)])
def test_an_attached_run_with_state_in_the_services_hbm_ends_as_embedded(env, placement, share):  # noqa: F811
    """Every kind in the service's HBM (every group is then the trainer's GPU worker's, whatever the share), or
    part of each group there beside the arena; the weights are the embedded run's, which the parity tests hold
    to plain PyTorch's."""
    ref = env.reference()
    svc = env.service(placement=placement, share=share)
    try:
        run = env.train("hbm")
        assert run.returncode == 0, run.stderr
        assert "store: gpu: " in run.stdout, run.stdout  # (the trainer's store holds the service's HBM)
        if placement is HBM:
            assert "this trainer's GPU updates 5 of 5 groups" in run.stdout, run.stdout
        assert "durability: checkpoint" in svc.text
        assert same(env.weights("hbm"), ref)
    finally:
        assert svc.stop() == 0


def test_unclipped_updates_in_hbm_read_the_gradients_home_and_leave_it_for_a_redo(env):  # noqa: F811 - fixture
    """max_grad_norm 0: the fused AdamW then leaves the gradient as it is, so the trainer's GPU worker updates
    from the gradient's home in the service's HBM, not from a copy; killed mid-update (group 1's new state written,
    not flipped to), the service redoes the update from that home: the run ends as the embedded one."""
    ref = env.reference(max_grad_norm=0)
    svc = env.service(placement=HBM)
    try:
        killed = env.train("run", kill_at="update:3:1", max_grad_norm=0)
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        again = env.train("run", max_grad_norm=0)
        assert again.returncode == 0, again.stderr
        assert "groups the trainer left" in svc.text
        assert same(env.weights("run"), ref)
    finally:
        assert svc.stop() == 0


@pytest.mark.parametrize("durability", ["checkpoint", "step"])
def test_trainer_killed_with_state_in_hbm_continues_bit_identically(env, durability):  # noqa: F811 - fixture
    """kill -9 of the trainer in the backward, after committing, and mid-update (group 0's new state written to
    the new places in HBM, not flipped to): the same command continues the service's run, bit-identical to an
    uninterrupted one, every step's line as that run's."""
    ref = env.reference()
    placement = HBM if durability == "checkpoint" else HBM_GRAD_DRAM
    svc = env.service(placement=placement, durability=durability, env={"TIERMEM_TEST_SLOW_UPDATE": "0.03"})
    try:
        straight = env.train("straight")
        assert straight.returncode == 0, straight.stderr
        assert same(env.weights("straight"), ref)
        for point, resumes_at in [("backward:3", 2), ("optimizer:3", 3), ("update:4:0", 4)]:
            name = point.replace(":", "")
            killed = env.train(name, kill_at=point)
            assert killed.returncode == -signal.SIGKILL, killed.stderr
            said = read_service(env.sock)["service"]["durability"]  # (what `tiermem top` shows)
            assert said.startswith(f"durability: {durability} ("), said
            again = env.train(name)
            assert again.returncode == 0, again.stderr
            assert f"continuing the service's run at step {resumes_at}" in again.stdout, again.stdout
            assert same(env.weights(name), ref), point
            assert losses(env.tmp / name) == losses(env.tmp / "straight"), point
        assert "groups the trainer left" in svc.text  # (the service redid what a killed trainer owed)
    finally:
        assert svc.stop() == 0


@pytest.mark.parametrize("point", ["update:3:1", "mirror:3:1"])
def test_service_killed_with_durability_step_comes_back_from_its_copies(env, point):  # noqa: F811 - fixture
    """durability: step: the service dies with group 1's update 3 written in HBM, not journaled: before its copy in
    DRAM is made (the flip is where it dies), or with that copy half written; the restarted service puts every
    group's state back from the copies of its journaled version (group 1's update 2: the other copy), redoes update
    3 from the gradients in the arena, and the run ends bit-identically."""
    ref = env.reference()
    svc = env.service(placement=HBM_GRAD_DRAM, durability="step", env={"TIERMEM_TEST_KILL_AT": point})
    assert "durability: step" in svc.text
    lost = env.train("run")
    assert svc.proc.wait(timeout=60) == -signal.SIGKILL
    assert lost.returncode == 1 and "lost the tiermem service" in lost.stderr, lost.stderr
    svc = env.service(placement=HBM_GRAD_DRAM, durability="step")
    try:
        assert "put back the state kept in HBM from its copies in DRAM" in svc.text, svc.text
        assert "finishing update 3 of" in svc.text and "step 3 committed" in svc.text, svc.text
        again = env.train("run")
        assert again.returncode == 0, again.stderr
        assert "continuing the service's run at step 3" in again.stdout, again.stdout
        assert same(env.weights("run"), ref)
    finally:
        assert svc.stop() == 0


def test_service_killed_with_durability_checkpoint_resumes_from_a_checkpoint(env):  # noqa: F811 - the fixture
    """durability: checkpoint: the service dies mid-update 5 and its HBM with it; the restarted service says the
    run's state is gone and names checkpoint-4; the rerun trainer resumes from there and ends bit-identically."""
    _killed_in_update_5_resumes_from_checkpoint_4(env, "update:5:0", placement=HBM)


def _killed_in_update_5_resumes_from_checkpoint_4(env, point: str, **service) -> None:  # noqa: F811 - the fixture
    """The service (``service``: its settings) killed at ``point`` of update 5 under durability: checkpoint with state
    in its HBM: the trainer saved checkpoint-4 before stopping, the restarted service says the state is gone and
    names it, and the rerun resumes from it, ending as the embedded run."""
    ref = env.reference()
    svc = env.service(**service, env={"TIERMEM_TEST_KILL_AT": point})
    lost = env.train("run", save_steps=2, extra_env={"TIERMEM_TEST_SLOW_SAVE": "0.4"})
    assert svc.proc.wait(timeout=60) == -signal.SIGKILL and lost.returncode == 1, lost.stderr
    assert "saved checkpoint-4 before stopping" in lost.stdout, lost.stdout + lost.stderr
    svc = env.service(**service)
    try:
        assert "kept in HBM died with the last service process" in svc.text and "checkpoint-4" in svc.text, svc.text
        again = env.train("run", save_steps=2)
        assert again.returncode == 0, again.stderr
        assert "checkpoint-4 at step 4" in again.stdout, again.stdout
        assert same(env.weights("run"), ref)
    finally:
        assert svc.stop() == 0


def test_a_service_stopped_cleanly_keeps_the_state_in_hbm_for_its_next_start(env):  # noqa: F811 - fixture
    """SIGTERM of the service (durability: checkpoint) while the trainer runs: the update in flight finishes, the
    service writes its HBM block beside the arena (its stop line names the file, and how to free it) and the next
    start reads it back: the run continues where it stood, bit-identically, with no checkpoint."""
    ref = env.reference()
    svc = env.service(placement=HBM, env={"TIERMEM_TEST_SLOW_UPDATE": "0.1"})
    trainer = env.start_train("run")
    _wait_for_steps(trainer, env.tmp / "run" / "trainer_log.jsonl", 2)
    assert svc.stop(signal.SIGTERM) == 0
    assert "wrote the state kept in HBM to" in svc.text, svc.text
    stopped, hbm = [ln for ln in svc.text.splitlines() if "stopped; run " in ln][-1], next(env.tmp.glob("shm/*.hbm"))
    assert f", {hbm} " in stopped and f" and rm {hbm}" in stopped, stopped  # (what it keeps, how to free it)
    trainer.communicate(timeout=60)
    svc = env.service(placement=HBM)
    try:
        assert "put back the state kept in HBM from" in svc.text and "recovered run" in svc.text, svc.text
        assert not list((env.tmp / "shm").glob("*.hbm"))  # (read back, then removed)
        again = env.train("run")
        assert again.returncode == 0, again.stderr
        assert "continuing the service's run at step" in again.stdout, again.stdout
        assert same(env.weights("run"), ref)
    finally:
        assert svc.stop() == 0


def test_the_services_cpu_updates_in_place_where_its_crash_loses_the_run(env):  # noqa: F811 - the fixture
    """Planned with part of the state in the service's HBM (its tiers.gpu.budget caps the room: the embedding and
    layer 0 there, layers 1-2 and the head in DRAM) under durability: checkpoint, a crash of the service loses the
    run's state anyway (it resumes from its newest checkpoint), so the service's CPU worker updates its groups in
    DRAM in place, as an embedded run's does (no undo copy, no new places: about 3x its crash-safe rate on the H200
    host); the weights are the embedded run's. Killed in such an update (group 2's new state written in place, not
    journaled), the service comes back saying the state is gone, and the rerun resumes from checkpoint-4
    bit-identically."""
    ref = env.reference()
    svc = env.service(placement="auto", gpu_budget="900KiB")
    try:
        run = env.train("whole")
        assert run.returncode == 0, run.stderr
        assert "plan: gpu 240.0 KiB: param+grad+exp_avg+exp_avg_sq of embed, layers 0; dram " in run.stdout, run.stdout
        assert "the service's CPU worker updates its 3 groups in place" in svc.text, svc.text
        assert "undo_copy" not in svc.text, svc.text  # (its update split: no undo copy taken)
        assert same(env.weights("whole"), ref)
    finally:
        assert svc.stop() == 0
    _killed_in_update_5_resumes_from_checkpoint_4(env, "update:5:2", placement="auto", gpu_budget="900KiB")
