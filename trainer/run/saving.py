"""The run's checkpoints, as the loop sees them: the lead's saver (``trainer.outputs.saver.Saver``) writes
checkpoint-N while training goes on; another rank that keeps state in its HBM writes its part of it
(``trainer.parallel.checkpoint_part``); the other ranks' updates wait until the lead has read the state it saves;
several hosts first bring the state of their groups to the lead's store."""

from __future__ import annotations

from trainer.outputs import checkpoint as ckpt
from trainer.outputs import hf_outputs as hf
from trainer.outputs.saver import Saver, lineage_for
from trainer.run.preference import REFERENCE_FILE
from trainer.run.when import save_due, saves


class Saving:
    def __init__(self, job, session, ranks, out, say, config):
        """``out``: where this process writes; ``config()``: the run's config as it runs (tiermem_state.json's)."""
        self.job, self.session, self.ranks, self.out, self.config = job, session, ranks, out, config
        self.saved: dict[int, str] = {}  # checkpoints written, for trainer_state.json's best_model_checkpoint
        self.saver = self.part = None
        cfg = job.cfg
        if not saves(cfg):
            return
        if ranks.lead:
            lineage = lineage_for(out, job.resume, session.continues_at)  # (save_total_limit prunes its own)
            self.saver = Saver(session.store, job.mcfg, out, job.model_dir, job.dtype, cfg.bf16, cfg.save_only_model,
                               cfg.save_total_limit, say, lineage=lineage, resumed=job.resume)
            ranks.hook_saver(self.saver, cfg.save_only_model)
            session.optimizer.set_gate(self.saver.gate)
        elif not cfg.save_only_model:  # (this rank writes the state its HBM holds, if it holds any)
            self.part = ranks.part_saver(job)

    @property
    def lineage(self) -> str | None:
        """The lineage of the checkpoints this process writes (None: it writes none)."""
        return self.saver.lineage if self.saver is not None else None

    def after(self, done: int) -> None:
        """Step ``done`` is taken: checkpoint-``done`` begins when it is due."""
        job, cfg = self.job, self.job.cfg
        plan, total = job.plan, job.total
        if not (saves(cfg) and save_due(cfg, done, plan.steps_per_epoch, total)):
            return
        self.ranks.gather_state(done)
        if self.saver is None and self.ranks.follows_saves:  # (the lead saves: update done + 1 waits for its reading)
            self.session.optimizer.expect_save(done)
            if self.part is not None:  # (this rank writes the state its HBM holds)
                self.part.begin(done)
        if self.saver is not None:
            self.session.refresh_layout()
            self.saved[done] = str(self.out / f"checkpoint-{done}")
            own = {"global_step": done, "epoch": plan.epoch_of(done), "total_steps": total,
                   "rng": ckpt.rng_state(), "config": self.config()}
            hf_state = hf.trainer_state(cfg, hf.log_rows(self.out, done), done, total, plan.epoch_of(done),
                                        plan.steps_per_epoch, job.n_params, checkpoints=self.saved)
            files = {"trainer_state.json": hf_state, "tiermem_state.json": own}
            if job.reference is not None:  # (stage dpo: a resume reads them back)
                files[REFERENCE_FILE] = job.reference.state()
            self.saver.begin(done, files)

    def finish(self) -> None:
        """The last update done (every rank's, before the lead exports: the export reads it) and the last
        checkpoint written."""
        self.session.optimizer.wait()
        if self.part is not None:
            self.part.wait()
        self.ranks.gather_state(self.job.total)
        self.ranks.wait_all(self.job.total)
        if self.saver is not None:
            self.saver.wait()

    def finish_good(self) -> None:
        """A step failed unapplied: the last good update and its checkpoint still finish."""
        self.session.optimizer.wait()
        if self.saver is not None:
            self.saver.wait()
        if self.part is not None:
            self.part.wait()

    def settle(self) -> None:
        """Training stops on an error: a checkpoint already read out of the store is still worth writing."""
        if self.saver is not None:
            self.saver.settle()
        if self.part is not None:
            self.part.settle()
