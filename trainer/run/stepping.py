"""One step of the loop: its rows (this rank's share of each micro-batch), the learning rate, the executor's step
(the GPU running out of memory said in one line that names where in the step), the step's line and log, and the
notes the first step prints."""

from __future__ import annotations

import time

import torch

from tiermem.errors import BudgetError
from tiermem.sizes import format_size
from trainer.data.batches import collate
from trainer.planning.placing import activation_budget, activations_home, kept_layers, piece_rows
from trainer.run import pieces
from trainer.run.executor import Executor, NonFiniteStep, StepResult
from trainer.run.preference import PreferenceHead, pair_pieces, pref_loss_of
from trainer.run.schedule import lr_factor


def make_executor(job, session, ranks) -> Executor:
    """The run's step executor, over its store and optimizer, with the plan's activation budget, kept layers and
    pieces (several ranks: the gradients reduced to their owners)."""
    cfg, plan, store = job.cfg, job.store_plan, session.store
    dpo = cfg.stage == "dpo"
    rows = pair_pieces(piece_rows(cfg, plan)) if dpo else piece_rows(cfg, plan)  # (stage dpo: whole pairs)
    executor = Executor(store, job.mcfg, job.dtype, session.optimizer, cfg.max_grad_norm, cfg.loss_chunk_tokens,
                        activation_budget(cfg, store, plan), kept_layers(cfg, plan), reducer=ranks.reducer(),
                        piece_rows=rows, act_host=activations_home(cfg, plan))
    if dpo:
        # (several ranks: the step's pairs and figures are the world's)
        executor.objective = PreferenceHead(pref_loss_of(cfg), ranks.world if ranks.size > 1 else None)
    return executor


class Steps:
    """The run's steps, from ``start``: what each takes and what it says; ``elapsed()`` counts from the first."""

    def __init__(self, job, executor: Executor, ranks, report, start: int, say):
        self.job, self.executor, self.ranks, self.report = job, executor, ranks, report
        self.start, self.say = start, say
        self.rows_seen = 0  # rows of every rank, since the start
        self.lr = 0.0  # the learning rate of the step being taken
        self.t0 = time.perf_counter()
        # the step's figures kept before the optimizer takes it (a committed step's figures must outlive a
        # trainer killed before it logs them)
        executor.before_commit = lambda n, result: report.pending(n, result, self.lr, job.plan.epoch_of(n),
                                                                  self.elapsed())

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def take(self, step: int, saving) -> StepResult:
        """Take step ``step`` (0-based). A step whose loss or norm is not finite is not applied: the last good
        update and its checkpoint (``saving``) still finish before it is raised."""
        cfg, job, executor = self.job.cfg, self.job, self.executor
        mbs = job.plan.rows_of_step(step)
        self.rows_seen += sum(len(idx) for idx in mbs)
        batches = [self.batch(idx) for idx in self.ranks.my_rows(mbs, cfg.per_device_train_batch_size)]
        self.lr = cfg.learning_rate * lr_factor(cfg.lr_scheduler_type, step, job.total, job.warmup)
        try:
            return executor.step(batches, step, self.lr)
        except NonFiniteStep:  # not applied: the last good update and its checkpoint still finish
            saving.finish_good()
            raise
        except torch.OutOfMemoryError:
            raise BudgetError(
                f"the GPU ran out of memory in step {step + 1} ({len(batches)} micro-batches of "
                f"{cfg.micro_rows} rows x up to {cfg.cutoff_len} tokens, as "
                f"{executor.last_passes or 1} layer-major passes, beside the state kept in HBM; in the "
                f"{executor.phase}{_where(executor)}); lower "
                "per_device_train_batch_size, tiermem_physical_batch_size or cutoff_len, "
                "tiermem_activation_budget (a step then runs as "
                "several layer-major passes)" + (", tiermem_keep_activations" if executor.last_kept
                                                 else "") + " or tiers.gpu.budget") from None

    def batch(self, idx: list[int]):
        """The micro-batch of examples ``idx`` (stage dpo: pairs, their rows chosen then rejected, and the
        reference's figures of those rows after the mask)."""
        rows = self.job.rows
        r = rows.rows_of(idx)
        b = collate([rows.input_ids[i] for i in r], [rows.labels[i] for i in r], pad_id(self.job.mcfg))
        return b if self.job.reference is None else (*b, self.job.reference.of(idx))

    def notes(self, step: int) -> None:
        """What the run's first step showed: the layers that kept their activations, the pieces a micro-batch
        runs as, the passes a step runs as."""
        if step != self.start:
            return
        cfg, executor, plan, say = self.job.cfg, self.executor, self.job.store_plan, self.say
        if cfg.tiermem_keep_activations not in (0, "auto"):  # (auto: the plan says)
            asked = f"the {cfg.tiermem_keep_activations}"
            say(f"note: the activations of {executor.last_kept} layers are kept ({asked} "
                "tiermem_keep_activations asks for; only layers whose weights live in HBM can be, none with "
                "a load-balancing loss): their backward skips the recompute")
        rows = cfg.micro_rows  # (stage dpo: two rows a pair)
        if pieces.told(rows, executor.piece_rows) and not (plan is not None and plan.piece_rows):
            say(f"note: {pieces.told(rows, executor.piece_rows)} (tiermem_physical_batch_size)")  # (else the plan's)
        if executor.last_passes > 1:
            say(f"note: a step's boundary activations exceed the activation budget "
                f"({format_size(executor.activation_budget)}): each step runs as {executor.last_passes} "
                "layer-major passes, gradients adding up in the store between them")

    def log(self, step: int, result: StepResult) -> None:
        """The step's line (every logging_steps) and its figures for the stats file."""
        job = self.job
        self.report.step(step + 1, result, self.lr, job.plan.epoch_of(step + 1), self.elapsed(),
                         step + 1 == job.total, job.cfg.logging_steps)


def _where(executor) -> str:
    """Where in a step the executor is (for an out-of-memory line): " of layer 7, pass 2 of 13"."""
    layer = "" if executor.layer is None else (f" of layer {executor.layer}" if isinstance(executor.layer, int)
                                                else f" ({executor.layer})")
    passes = f", pass {executor.at_pass} of {executor.last_passes}" if (executor.last_passes or 1) > 1 else ""
    return layer + passes


def pad_id(mcfg) -> int:
    """The id padded positions take (any id of the vocabulary: they are masked out of the loss and of attention)."""
    pad = mcfg.pad_token_id
    return pad if pad is not None and 0 <= pad < mcfg.vocab_size else 0
