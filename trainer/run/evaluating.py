"""The run's evaluations: the mean loss over the evaluation rows when eval_strategy says (steps, epoch), and once
more at the end with do_eval (Hugging Face's ``trainer.evaluate()`` after training); several ranks take every
world-size-th micro-batch each and add up their sums."""

from __future__ import annotations

import time

from trainer.data.batches import collate
from trainer.outputs import hf_outputs as hf
from trainer.run.stepping import pad_id
from trainer.run.when import eval_due


class Evaluation:
    def __init__(self, job, executor, ranks, report):
        self.job, self.executor, self.ranks, self.report = job, executor, ranks, report
        self.last: tuple | None = None  # (step, loss, seconds) of the latest evaluation

    def after(self, done: int, elapsed) -> None:
        """Step ``done`` is taken: evaluate when it is due (before its checkpoint: its trainer_state holds it);
        ``elapsed()``: the run's seconds so far."""
        job = self.job
        if eval_due(job.cfg, done, job.plan.steps_per_epoch, job.total):
            self._run(done, elapsed)

    def final(self, elapsed) -> dict | None:
        """do_eval: the evaluation after training (the last step's when it was just evaluated), as
        eval_results.json has it; None without do_eval."""
        job, cfg = self.job, self.job.cfg
        if not cfg.do_eval:
            return None
        if self.last is None or self.last[0] != job.total:
            self._run(job.total, elapsed)
        return hf.eval_metrics(self.last[1], self.last[2], len(job.eval_rows),
                               -(-len(job.eval_rows) // cfg.per_device_eval_batch_size),
                               job.plan.epoch_of(job.total), cfg.stage)

    def _run(self, version: int, elapsed) -> None:
        job = self.job
        t0 = time.perf_counter()
        loss = evaluate(self.executor, job.eval_rows, job.cfg, job.mcfg, version, self.ranks)
        self.last = (version, loss, time.perf_counter() - t0)
        self.report.eval(version, loss, job.plan.epoch_of(version), elapsed())


def evaluate(executor, rows, cfg, mcfg, version: int, ranks) -> float:
    """Mean loss over every trained token of ``rows``, with the weights after ``version`` updates; the
    micro-batches go layer-major in groups of gradient_accumulation_steps (the activations of a step). Several
    ranks take every world-size-th micro-batch each and add up their sums."""
    bs, group = cfg.per_device_eval_batch_size, cfg.gradient_accumulation_steps
    mbs = ranks.shard([list(range(i, min(i + bs, len(rows)))) for i in range(0, len(rows), bs)])
    total, count = 0.0, 0
    for g in range(0, len(mbs), group):
        batches = [collate([rows.input_ids[i] for i in idx], [rows.labels[i] for i in idx], pad_id(mcfg))
                   for idx in mbs[g: g + group]]
        s, n = executor.evaluate(batches, version)
        total, count = total + s, count + n
    total, count = ranks.sum([total, count])
    return total / max(count, 1)
