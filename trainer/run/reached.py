"""Where a run got to, and the one line a run that stops before its end prints (Ctrl-C, SIGTERM, an error after
its steps began): the step it reached, its newest checkpoint (or that none was saved, and why) and the exact
command that continues from there.

The loop fills a ``Reached`` as it goes (``began``, ``stepped``, ``settled``); the command line prints
``stop_line`` when the run stops. The command it names is the one typed, with ``resume_from_checkpoint=`` the
newest checkpoint added where the same command would not resume from it (``overwrite_output_dir: true`` starts
over; a ``resume_from_checkpoint`` of the config names an older one); for a run attached to a service, which keeps
its state, ``overwrite_output_dir=false`` added where the config sets it (true would discard the service's run).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path


class Terminated(BaseException):
    """SIGTERM reached a run of one process: it stops as on Ctrl-C (a BaseException: no ``except Exception`` of
    the run takes it for an error of its own)."""


@dataclass
class Reached:
    """What a stop line needs: filled by the loop (the lead's ``out``), read by the command line."""

    out: Path | None = None
    total: int = 0
    start: int = 0
    step: int | None = None  # steps done so far (the run's count); None: training had not begun
    checkpoint: Path | None = None  # the newest complete checkpoint the run can continue from (or resumed from)
    service: bool = False  # attached to a service, which keeps the run's state
    lead: bool = True
    lineage: str | None = field(default=None, repr=False)

    def began(self, out: Path, start: int, total: int, resume: Path | None, service: bool, lead: bool) -> None:
        """Training begins at step ``start`` of ``total`` (``resume``: the checkpoint it resumed from)."""
        self.out, self.start, self.step, self.total = Path(out), start, start, total
        self.checkpoint, self.service, self.lead = resume, service, lead

    def stepped(self, done: int) -> None:
        self.step = done

    def settled(self, lineage: str | None, model_only: bool) -> None:
        """The run stops and its saves are settled: the newest complete checkpoint of its ``lineage`` (the one
        it resumed from when it wrote none), unless checkpoints hold the model only (they cannot resume)."""
        if lineage is None or model_only or self.out is None:
            return
        from trainer.outputs.checkpoint import checkpoints
        from trainer.outputs.saver import lineage_of

        ours = [p for _, p in checkpoints(self.out) if lineage_of(p) == lineage]
        if ours:
            self.checkpoint = ours[-1]


def stop_line(how: str, reached: Reached, cfg, config: str, overrides: list[str]) -> str:
    """The line a stopped run prints after ``tiermem-train: `` (``how``: interrupted, terminated (SIGTERM),
    stopped), for the run of ``cfg`` typed as ``tiermem-train config overrides``."""
    if reached.step is None:
        return f"{how} before training began; start again with: {command(config, overrides)}"
    where = f"{how} at step {reached.step} of {reached.total}"
    if reached.service:  # (overwrite_output_dir: true would discard the service's run: unset in the command)
        unset = "overwrite_output_dir=false" if cfg.overwrite_output_dir else None
        return f"{where}; the service keeps the run's state: continue with: {command(config, overrides, unset)}"
    if reached.checkpoint is None:
        return f"{where}; {why_none(cfg, reached)}; start again from step 0 with: {command(config, overrides)}"
    same = resumes_from(cfg, reached.out) == Path(reached.checkpoint).resolve()
    extra = None if same else f"resume_from_checkpoint={reached.checkpoint}"
    return (f"{where}; newest checkpoint {reached.checkpoint}; continue with: "
            f"{command(config, overrides, extra)}")


def why_none(cfg, reached: Reached) -> str:
    """Why a run that stopped has no checkpoint to continue from."""
    if cfg.save_only_model:
        return "no checkpoint to continue from (save_only_model: checkpoints hold the model only)"
    if cfg.save_strategy == "no" or (cfg.save_strategy == "steps" and not cfg.save_steps):
        return "no checkpoint was saved (save_steps is not set)"
    if cfg.save_strategy == "steps":
        first = (reached.start // cfg.save_steps + 1) * cfg.save_steps
        if first > reached.total:
            return f"no checkpoint is saved in this run (save_steps: {cfg.save_steps}, beyond its {reached.total})"
        return f"no checkpoint was saved yet (save_steps: {cfg.save_steps}, the first due at step {first})"
    return "no checkpoint was saved yet (save_strategy: epoch)"


def resumes_from(cfg, out: Path | None) -> Path | None:
    """The checkpoint the same config resumes from (as ``trainer.outputs.resume`` chooses it), resolved."""
    if cfg.resume_from_checkpoint:
        return Path(cfg.resume_from_checkpoint).resolve()
    if cfg.overwrite_output_dir or out is None or not out.is_dir():
        return None
    from trainer.outputs.checkpoint import checkpoints

    found = checkpoints(out)
    return found[-1][1].resolve() if found else None


def command(config: str, overrides: list[str], extra: str | None = None) -> str:
    """``tiermem-train config overrides`` as a shell takes it; ``extra`` (``key=value``) replaces any override of
    its key."""
    key = extra.split("=", 1)[0] if extra else None
    keep = [o for o in overrides if o.split("=", 1)[0].strip() != key]
    return shlex.join(["tiermem-train", config, *keep, *([extra] if extra else [])])
