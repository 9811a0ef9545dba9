"""The checkpoint a run resumes from: ``resume_from_checkpoint``, the one a service that lost the run's state
names, or (as LLaMA-Factory) the newest complete one in ``output_dir``; checked whole and this model's before
anything is touched, with a note for each key the rerun changed."""

from __future__ import annotations

import os
from pathlib import Path

from tiermem.errors import ConfigError
from tiermem.schema import to_plain
from trainer.outputs import checkpoint as ckpt
from trainer.outputs import config_changes
from trainer.outputs.output_dir import interrupted_run
from trainer.outputs.weights_io import check_weight_files


def checked_resume(cfg, out: Path, mcfg, model_dir: Path, named: dict | None = None, say=None,
                   loads: bool = True) -> Path | None:
    """The checkpoint to resume from (checked whole and this model's) and, for a fresh start from
    pretrained weights, that the weight files are there: before anything is touched. ``loads``: this process
    loads the checkpoint (the check of its large files starts now, in the background)."""
    resume = find_resume(cfg, out, named, say)
    if resume is not None:
        ckpt.check(resume, mcfg, model_dir, background=loads, trust_old=cfg.tiermem_trust_old_checkpoints)
        if say is not None:  # (what the rerun changed: a note each, and it goes on with the new values)
            for line in config_changes.notes(resume, ckpt.tiermem_state(resume).get("config"), to_plain(cfg)):
                say(line)
    if cfg.tiermem_init == "pretrained" and resume is None:
        check_weight_files(mcfg, model_dir)
    return resume


def find_resume(cfg, out: Path, named: dict | None = None, say=None) -> Path | None:
    """The checkpoint to resume from: ``resume_from_checkpoint``, else (as LLaMA-Factory) none when
    overwrite_output_dir is set (Hugging Face's meaning, attached or not: the run starts over, even when the
    service lost the run's state and ``named`` a checkpoint), else the one the service ``named``, else the newest
    complete checkpoint in output_dir. Refuses a non-empty output_dir that holds no checkpoint unless
    overwrite_output_dir is set. Says in one line why it does not take the named one for another."""
    if out.is_file():
        raise ConfigError(f"output_dir {out} is a file")
    above = out
    while not above.exists():
        above = above.parent
    if not above.is_dir():
        raise ConfigError(f"output_dir {out} cannot be made: {above} is a file")
    if not os.access(above, os.W_OK | os.X_OK):
        raise ConfigError(f"output_dir {out} cannot be written: {above} is not writable by this user")
    if named is None or (cfg.overwrite_output_dir and not cfg.resume_from_checkpoint):
        return _own_choice(cfg, out, say)  # (overwrite_output_dir: a fresh start, as an embedded run's, says so)
    say = say or print
    path = Path(str(named.get("checkpoint")))
    lost = f"the service lost this run's state (step {named.get('step')}) and named {path} to resume from"
    if cfg.resume_from_checkpoint and Path(cfg.resume_from_checkpoint).resolve() != path.resolve():
        say(f"{lost}; resuming from {cfg.resume_from_checkpoint} instead, as resume_from_checkpoint says")
        return Path(cfg.resume_from_checkpoint)
    if (path / "checkpoint.json").is_file():
        say(f"{lost}: resuming from it")
        return path
    fallback = _own_choice(cfg, out, say)
    say(f"{lost}, but it is no longer there; " + (f"resuming from {fallback}" if fallback else "starting from step 0"))
    return fallback


def _own_choice(cfg, out: Path, say=None) -> Path | None:
    """find_resume without a checkpoint named by the service."""
    if cfg.resume_from_checkpoint:
        return Path(cfg.resume_from_checkpoint)
    if cfg.overwrite_output_dir or not out.is_dir():
        return None
    found = ckpt.checkpoints(out)
    if found:
        return found[-1][1]
    if interrupted_run(out):  # (what a run of this tool left when it stopped before a checkpoint: replaced)
        (say or print)(f"note: output_dir {out} holds only what a tiermem-train run that stopped before its first "
                       "checkpoint left: this run starts from step 0 and replaces it")
    elif any(not p.name.startswith(".checkpoint-") for p in out.iterdir()):
        raise ConfigError(f"output_dir {out} already exists and is not empty (and holds no checkpoint to resume); "
                          "set overwrite_output_dir: true or choose another output_dir")
    return None
