"""Several ranks attached to one service with state in HBM (issue 43), on the CPU through gloo: the service holds a
block for each rank ("HBM" in host memory on the stand-in), each group's state in its owner's; each rank maps its
own part. Two ranks against one embedded process with the same global batch: the same steps and weights, the same
checkpointed state (rank 1's part written by rank 1); a checkpoint written in parts resumes after the service's
crash under durability: checkpoint, and under durability: step the restarted service puts every rank's part back
from its copies (a killed rank: tests/test_train_dp.py, its service's run with state in HBM)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tests.test_service import Service
from tests.test_train_dp import STEP, assert_same_weights, one_process, ranks, service_config, tiny, write_cfg  # noqa: F401 (tiny: the fixture)
from tests.test_train_dp_hbm import same_state


def _service(tmp_path: Path) -> tuple[Service, Path]:
    sock = Path(tempfile.mkdtemp(prefix="tm-")) / "s.sock"  # (Unix socket paths are limited to 107 bytes)
    return Service(service_config(tmp_path, hbm=True), sock), sock


@pytest.mark.slow
def test_two_ranks_keep_their_state_in_the_services_hbm_and_match_one_process(tmp_path, tiny, capsys):  # noqa: F811
    """Each rank's groups' gradients and moments live in the service's block for that rank; the ranks' GPU workers
    update them there: the same steps, weights and checkpointed state as one embedded process; the checkpoint holds
    rank 1's part (state-rank1.zarr)."""
    ref = one_process(write_cfg(tmp_path, tiny, "one", 4, save_steps=3), capsys)
    svc, sock = _service(tmp_path)
    try:
        cfg = write_cfg(tmp_path, tiny, "two", 2, save_steps=3, tiermem_server=str(sock), tiermem=None)
        r = ranks(cfg, 2)
        assert r.returncode == 0, (r.stderr[-3000:], svc.text)
        assert STEP.findall(r.stdout) == ref and len(ref) == 6, (STEP.findall(r.stdout), ref)
        assert_same_weights(tmp_path / "one", tmp_path / "two")
        assert (tmp_path / "two" / "checkpoint-3" / "state-rank1.zarr").is_dir()
        same_state(tmp_path / "one" / "checkpoint-3", tmp_path / "two" / "checkpoint-3")
        svc.wait_for("finished at step 6")
        assert "rank 1 (pid" in svc.text and "detached" not in svc.text, svc.text
    finally:
        assert svc.stop() == 0, svc.text


@pytest.mark.slow
def test_a_checkpoint_written_in_parts_resumes_two_ranks_of_a_new_service(tmp_path, tiny, capsys):  # noqa: F811
    """A service's crash with state in its ranks' HBM (durability: checkpoint) loses it: the restarted service names
    the newest checkpoint, written in parts, and the same command resumes from there to the uninterrupted end."""
    one_process(write_cfg(tmp_path, tiny, "one", 4), capsys)
    svc, sock = _service(tmp_path)
    cfg = write_cfg(tmp_path, tiny, "two", 2, save_steps=2, tiermem_server=str(sock), tiermem=None)
    try:
        r = ranks(cfg, 2, TIERMEM_TEST_KILL_AT="backward:6", TIERMEM_TEST_KILL_RANK="0")
        whole = sorted((tmp_path / "two").glob("checkpoint-*"))
        assert r.returncode != 0 and whole and all((c / "state-rank1.zarr").is_dir() for c in whole), whole
    finally:
        svc.stop(9)
    svc = Service(service_config(tmp_path, hbm=True), sock)
    try:
        assert "died with the last service process" in svc.text, svc.text
        r = ranks(cfg, 2)
        assert r.returncode == 0, (r.stderr[-3000:], svc.text)
        assert f"resumed from {whole[-1]}" in r.stdout, r.stdout
        assert_same_weights(tmp_path / "one", tmp_path / "two")
    finally:
        assert svc.stop() == 0, svc.text


@pytest.mark.slow
def test_a_service_killed_with_durability_step_puts_every_ranks_part_back(tmp_path, tiny, capsys):  # noqa: F811
    """durability: step with state in two ranks' parts of the service's HBM: the service dies flipping group 1's
    update 3 (rank 1's part; its new state written, not journaled); the restarted one makes the blocks anew, puts
    each group's journaled version back from its copies in the arena, redoes update 3, and the same command
    continues the run there, ending as one embedded process."""
    import signal

    one_process(write_cfg(tmp_path, tiny, "one", 4), capsys)
    sock = Path(tempfile.mkdtemp(prefix="tm-")) / "s.sock"
    conf = service_config(tmp_path, hbm=True, durability="step")
    svc = Service(conf, sock, env={"TIERMEM_TEST_KILL_AT": "update:3:1"})
    cfg = write_cfg(tmp_path, tiny, "two", 2, tiermem_server=str(sock), tiermem=None)
    r = ranks(cfg, 2)
    assert svc.proc.wait(timeout=60) == -signal.SIGKILL and r.returncode != 0, svc.text
    svc = Service(conf, sock)
    try:
        assert "from its copies in DRAM" in svc.text and "step 3 committed" in svc.text, svc.text
        r = ranks(cfg, 2)
        assert r.returncode == 0, (r.stderr[-3000:], svc.text)
        assert "continuing the service's run at step 3" in r.stdout, r.stdout
        assert_same_weights(tmp_path / "one", tmp_path / "two")
    finally:
        assert svc.stop() == 0, svc.text
