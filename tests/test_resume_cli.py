"""A run that stops before its end, as a user meets it on the command line: Ctrl-C, SIGTERM or an error after
steps ran print one line with the step reached, the newest checkpoint (or why there is none) and the exact command
that continues; that command continues; ``overwrite_output_dir: true`` over an earlier run says what it replaces
and sets the earlier run's outputs aside; a resumed run's ``done:`` line counts this run's steps and the run's."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.procs import child_env, ctrl_c_works
from tiermem.errors import StorageError
from trainer.cli import main
from trainer.run import stepping

ROOT = Path(__file__).resolve().parent.parent


def quick(out: Path, *extra: str) -> list[str]:
    """The quickstart, shortened, as typed."""
    return ["configs/quickstart.yaml", f"output_dir={out}", "max_steps=6", "eval_strategy=no", "plot_loss=false",
            "logging_steps=1", *extra]


def stop_at(monkeypatch, at: int, how) -> None:
    """Step ``at`` (1-based) stops the run with ``how()`` before it is taken (the checkpoint being saved
    finished first: the stop lands after it, whatever this machine's speed)."""
    real = stepping.Steps.take

    def take(self, step, saving):
        if step + 1 == at:
            if saving.saver is not None:
                saving.saver.wait()
            how()
        return real(self, step, saving)

    monkeypatch.setattr(stepping.Steps, "take", take)


def continue_with(line: str) -> list[str]:
    """The arguments of the command a stop line names."""
    words = shlex.split(line.split("with: ", 1)[1])
    assert words[0] == "tiermem-train"
    return words[1:]


def raise_ctrl_c():
    raise KeyboardInterrupt


def test_ctrl_c_names_the_step_the_checkpoint_and_the_command(tmp_path, capsys, monkeypatch):
    """The quickstart sets overwrite_output_dir (the same command starts over): the command resumes by name."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "qs"
    stop_at(monkeypatch, 4, raise_ctrl_c)
    assert main(quick(out, "save_steps=2")) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"tiermem-train: interrupted at step 3 of 6; newest checkpoint {out}/checkpoint-2; "
                          "continue with: tiermem-train configs/quickstart.yaml "), err
    assert err.rstrip().endswith(f"logging_steps=1 save_steps=2 resume_from_checkpoint={out}/checkpoint-2"), err


@pytest.mark.slow
def test_the_command_a_stop_names_continues_and_done_counts_this_runs_steps(tmp_path, capsys, monkeypatch):
    """An error after steps ran: its line, then the stop line; without overwrite_output_dir the same command
    resumes from the newest checkpoint; the resumed run's done: line counts its own steps and the run's."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "qs"

    def disk_full():
        raise StorageError("writing the log failed: no space left on device")

    stop_at(monkeypatch, 4, disk_full)
    args = quick(out, "save_steps=2", "overwrite_output_dir=false")
    assert main(args) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "tiermem-train: error: writing the log failed: no space left on device", err
    assert err[1] == (f"tiermem-train: stopped at step 3 of 6; newest checkpoint {out}/checkpoint-2; continue with: "
                      f"{shlex.join(['tiermem-train', *args])}"), err
    monkeypatch.undo()
    monkeypatch.chdir(ROOT)
    assert main(continue_with(err[1])) == 0
    printed = capsys.readouterr().out
    assert f"resumed from {out}/checkpoint-2 at step 2" in printed
    assert "done: 4 steps this run (6 in all) in " in printed, printed


def test_sigterm_stops_as_ctrl_c_does_and_says_no_checkpoint_was_saved(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "qs"
    stop_at(monkeypatch, 3, lambda: os.kill(os.getpid(), signal.SIGTERM))
    before = signal.getsignal(signal.SIGTERM)
    args = quick(out, "save_steps=null")
    assert main(args) == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before  # (put back after the run)
    err = capsys.readouterr().err
    assert err == ("tiermem-train: terminated (SIGTERM) at step 2 of 6; no checkpoint was saved (save_steps is not "
                   "set); start again from step 0 with: " + shlex.join(["tiermem-train", *args]) + "\n"), err
    assert not any(out.glob("checkpoint-*"))


def test_a_stop_says_why_there_is_no_checkpoint(tmp_path, capsys, monkeypatch):
    """The quickstart saves every 50 steps: a 6-step run of it saves none, and the line says so."""
    monkeypatch.chdir(ROOT)
    stop_at(monkeypatch, 2, raise_ctrl_c)
    assert main(quick(tmp_path / "qs")) == 130
    err = capsys.readouterr().err
    assert err.startswith("tiermem-train: interrupted at step 1 of 6; no checkpoint is saved in this run "
                          "(save_steps: 50, beyond its 6); start again from step 0 with: tiermem-train "), err


def test_an_error_before_training_began_is_one_line_still(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(quick(tmp_path / "qs", "learning_rate=fast")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tiermem-train: error: ") and "step" not in err, err


@pytest.mark.slow
def test_overwrite_output_dir_sets_the_earlier_runs_outputs_aside(tmp_path, capsys, monkeypatch):
    """A rerun of the quickstart (overwrite_output_dir: true) starts over, says what it replaces, and moves the
    earlier run's model, results, log and plot into previous-<time>/; checkpoints and the user's files stay."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "qs"
    args = quick(out, "max_steps=2", "save_steps=2", "plot_loss=true")
    assert main(args) == 0
    first_log = (out / "trainer_log.jsonl").read_text()
    (out / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert main(args + ["max_steps=3"]) == 0
    printed = capsys.readouterr().out
    aside = sorted(out.glob("previous-*"))
    assert len(aside) == 1, list(out.iterdir())
    note = [line for line in printed.splitlines() if line.startswith("note: overwrite_output_dir")]
    assert len(note) == 1 and "starts over from step 0" in note[0] and str(aside[0]) in note[0], printed
    assert "model.safetensors, train_results.json, trainer_log.jsonl, training_loss.png and " in note[0]
    for name in ("model.safetensors", "train_results.json", "trainer_log.jsonl", "training_loss.png",
                 "config.json", "all_results.json"):
        assert (aside[0] / name).is_file(), name
    assert (aside[0] / "trainer_log.jsonl").read_text() == first_log
    assert [json.loads(r)["current_steps"] for r in (out / "trainer_log.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert (out / "notes.txt").read_text() == "mine" and (out / "checkpoint-2" / "checkpoint.json").is_file()
    assert "done: 3 steps in " in printed  # (a fresh start: no "this run")


@pytest.mark.slow
@pytest.mark.parametrize("sig,code,how", [(signal.SIGINT, 130, "interrupted"),
                                          (signal.SIGTERM, 143, "terminated (SIGTERM)")])
def test_a_real_ctrl_c_names_the_command_that_continues(tmp_path, sig, code, how):
    """SIGINT, as a terminal sends it (or SIGTERM, as kill does), to a run held inside step 5 after checkpoint-4."""
    out = tmp_path / "qs"
    args = quick(out, "max_steps=8", "save_steps=4")
    proc = subprocess.Popen([sys.executable, "-m", "trainer.cli", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=ctrl_c_works,
                            env=child_env(TIERMEM_TEST_HOLD_AT="forward:5"))
    try:
        while not (out / "checkpoint-4" / "checkpoint.json").is_file():
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    assert len(err.strip().splitlines()) == 1, err  # (one line: nothing else on stderr)
    line = err.strip()
    assert line == (f"tiermem-train: {how} at step 4 of 8; newest checkpoint {out}/checkpoint-4; continue with: "
                    f"{shlex.join(['tiermem-train', *args, f'resume_from_checkpoint={out}/checkpoint-4'])}"), err
