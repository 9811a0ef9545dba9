"""A run attached to a service that no longer holds it (the service lost its arena, or was started ``--fresh``):
``overwrite_output_dir`` means what it means to Hugging Face, as in an embedded run. ``true`` starts over from
step 0 with the embedded run's one note, although the service names a checkpoint to resume from; ``false``
resumes from that checkpoint (or from output_dir's newest). The line a stopped attached run prints names a command
that continues the service's run, overwrite_output_dir: true or not. In-process: the service's threads and the
trainer in this interpreter."""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from tests.test_resume_cli import ROOT, quick, raise_ctrl_c, stop_at
from trainer.cli import main
from trainer.config import TrainConfig


def _config(out: Path, **over) -> TrainConfig:
    return TrainConfig(model_name_or_path="m", dataset="d", output_dir=str(out), **over)


def _checkpoints(out: Path, *steps: int) -> None:
    for step in steps:
        (out / f"checkpoint-{step}").mkdir(parents=True)
        (out / f"checkpoint-{step}" / "checkpoint.json").write_text("{}")


@pytest.mark.parametrize("overwrite,explicit", [(False, False), (True, False), (True, True), (False, True)])
def test_the_checkpoint_the_service_names_is_resumed_unless_overwriting(tmp_path, overwrite, explicit):
    """The service lost a run's state and named its newest checkpoint: the trainer resumes from it, saying so,
    unless overwrite_output_dir is set (a fresh start, silent here: the run says it once, as an embedded run
    does); a resume_from_checkpoint given wins either way, and the trainer says so."""
    from trainer.outputs.resume import find_resume

    out = tmp_path / "out"
    _checkpoints(out, 2, 4)
    cfg = _config(out, overwrite_output_dir=overwrite,
                  resume_from_checkpoint=str(out / "checkpoint-2") if explicit else None)
    own = out / "checkpoint-2" if explicit else None if overwrite else out / "checkpoint-4"
    said = []
    assert find_resume(cfg, out, None, said.append) == own and not said  # nothing named
    named = {"checkpoint": str(out / "checkpoint-4"), "step": 5}
    assert find_resume(cfg, out, named, said.append) == own
    if overwrite and not explicit:
        assert not said
    else:
        assert len(said) == 1 and "checkpoint-4" in said[0] and ("resume_from_checkpoint" in said[0]) == explicit
    said.clear()
    gone = {"checkpoint": str(out / "checkpoint-6"), "step": 7}  # removed since: say so, then as without
    assert find_resume(cfg, out, gone, said.append) == own
    assert len(said) == (0 if overwrite and not explicit else 1) and all("checkpoint-6" in s for s in said)


@pytest.mark.parametrize("overwrite", [True, False])
def test_a_stopped_attached_runs_command_continues_the_services_run(tmp_path, overwrite):
    """The same command with overwrite_output_dir: true would discard the service's run (the quickstart sets it):
    the command the line names unsets it."""
    from trainer.run.reached import Reached, stop_line

    out = tmp_path / "out"
    reached = Reached()
    reached.began(out, 0, 6, None, service=True, lead=True)
    reached.stepped(3)
    cfg = _config(out, overwrite_output_dir=overwrite, tiermem_server="default")
    typed = ["tiermem_server=default"] + (["overwrite_output_dir=true"] if overwrite else [])
    line = stop_line("interrupted", reached, cfg, "my.yaml", typed)
    assert line == ("interrupted at step 3 of 6; the service keeps the run's state: continue with: tiermem-train "
                    "my.yaml tiermem_server=default" + (" overwrite_output_dir=false" if overwrite else "")), line


@contextmanager
def _service(tmp_path: Path, sock: Path, fresh: bool = False):
    """`tiermem serve` in this process (the CPU stand-in, every kind of state in the arena), listening on ``sock``;
    what it says is collected in the list it yields."""
    from tiermem.service.server import Service

    path = tmp_path / "serve.yaml"
    (tmp_path / "shm").mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump({
        "name": "lost", "placement": dict.fromkeys(("param", "grad", "master", "exp_avg", "exp_avg_sq"), "dram"),
        "optimizer": {"gpu_share": 0},
        "tiers": {"gpu": {"device": "cpu"}, "dram": {"path": str(tmp_path / "shm"), "budget": "64MiB"},
                  # (its directory holds the run record and journal: this test's, not the user's state directory)
                  "nvme": {"path": str(tmp_path / "nvme"), "budget": "1MiB", "backend": "posix"}}}))
    said: list[str] = []
    svc = Service(str(path), str(sock), fresh, say=said.append)
    try:
        svc.listen()
        yield said
    finally:
        svc.shutdown()
        svc.release()


@pytest.mark.slow
@pytest.mark.parametrize("how,overwrite", [("arena gone", True), ("--fresh", True), ("--fresh", False)])
def test_a_run_the_service_lost_starts_over_under_overwrite_output_dir(tmp_path, capsys, monkeypatch, how, overwrite):
    """The quickstart attached, stopped at step 3 after checkpoint-2; the service then loses the run (its arena
    removed, as a reboot does to /dev/shm; or started with --fresh). The same command (overwrite_output_dir: true)
    starts over from step 0 with the embedded run's one note, as it does where the service still holds the run
    (it had resumed from the checkpoint the service names); with overwrite_output_dir=false it resumes from
    checkpoint-2 (test_service.py: the one the service names, after the arena is gone)."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "qs"
    with tempfile.TemporaryDirectory(prefix="tm-") as d:  # (short: Unix socket paths are limited to 107 bytes)
        sock = Path(d) / "s.sock"
        args = quick(out, "save_steps=2", f"tiermem_server={sock}")
        with _service(tmp_path, sock), monkeypatch.context() as m:
            stop_at(m, 4, raise_ctrl_c)
            assert main(args) == 130
        if how == "arena gone":
            for arena in (tmp_path / "shm").glob("*.arena"):
                arena.unlink()
        with _service(tmp_path, sock, fresh=how == "--fresh") as said:
            capsys.readouterr()
            assert main(args + [f"overwrite_output_dir={str(overwrite).lower()}"]) == 0
            printed = capsys.readouterr().out
    lost = "is gone" in said[0] and "checkpoint-2" in said[0]
    assert lost == (how == "arena gone"), said
    notes = [line for line in printed.splitlines() if line.startswith("note: overwrite_output_dir")]
    if overwrite:
        assert len(notes) == 1 and "this run starts over from step 0" in notes[0], printed
        assert "resumed from" not in printed and "done: 6 steps in " in printed, printed
        assert len(list(out.glob("previous-*/train_results.json"))) == 0  # (the stopped run had not written it)
        assert len(list(out.glob("previous-*/trainer_log.jsonl"))) == 1
    else:
        assert not notes and f"resumed from {out}/checkpoint-2 at step 2" in printed, printed
        assert "done: 4 steps this run (6 in all)" in printed, printed
