"""A training run from a resolved config, in four steps: prepare (check everything, tokenize: ``trainer.run.job``),
open the store (``trainer.run.opening``), load the model into it (``trainer.run.loading``), train for the planned
steps and export the model (``train``, below). Every check that can fail on user input runs before anything is
written to ``output_dir``.

The loop is the parts it calls, each owning its state: the run's ranks (``trainer.parallel.ranks``, chosen once at
start), its outputs (``trainer.outputs.run_outputs``), the step (``trainer.run.stepping``), the plan watcher
(``trainer.run.watching``), the evaluations (``trainer.run.evaluating``) and the checkpoints
(``trainer.run.saving``).
"""

from __future__ import annotations

from rich.console import Console

from tiermem.session import Session
from trainer.config import TrainConfig
from trainer.outputs.report import progress_bar
from trainer.outputs.run_outputs import RunOutputs
from trainer.parallel.dist import World
from trainer.parallel.ranks import choose
from trainer.run.evaluating import Evaluation
from trainer.run.gc_pauses import GcPauses
from trainer.run.job import Job, prepare
from trainer.run.loading import load_weights
from trainer.run.opening import describe_store, open_training_session
from trainer.run.precision import tf32_mode
from trainer.run.preference import prepare_reference
from trainer.run.reached import Reached
from trainer.run.saving import Saving
from trainer.run.stepping import Steps, make_executor
from trainer.run.watching import PlanWatcher


def run(cfg: TrainConfig, console: Console | None = None, reached: Reached | None = None) -> dict:
    """The whole run: prepare (check, tokenize), open the store (embedded or the service's), load the
    weights, train, export. ``reached``: filled as the run goes (where it got to, when it stops before its end)."""
    ranks = choose(World.from_env(), cfg)
    with ranks.running(cfg):
        return _run(cfg, ranks.console(console), ranks, reached or Reached())


def _run(cfg: TrainConfig, console: Console, ranks, reached: Reached) -> dict:
    say = lambda text: console.print(text, soft_wrap=True, highlight=False)
    with tf32_mode(cfg, say):  # (tf32: set before anything is computed, put back at the end)
        return _stages(cfg, console, ranks, reached, say)


def _stages(cfg: TrainConfig, console: Console, ranks, reached: Reached, say) -> dict:
    ranks.enter("prepare")
    job = prepare(cfg, console, say, ranks)
    session = open_training_session(job, ranks, say)
    ranks.enter("train")
    try:
        describe_store(session.store, say)
        start = load_weights(job, session, ranks, console, say)
        reached.began(job.out, start, job.total, job.resume, not session.embedded, ranks.lead)
        return train(job, session, start, ranks, console, say, reached)
    except BaseException as e:
        session.stopping(e)
        raise
    finally:
        session.close()


def train(job: Job, session: Session, start: int, ranks, console: Console, say,
          reached: Reached | None = None) -> dict:
    """Steps ``start``..total (logging, checkpoints, evaluation), then the export; returns the results
    (``reached``: the steps done, the newest checkpoint when it stops before its end)."""
    reached = reached or Reached()
    out = ranks.output_dir(job.out)  # (the other ranks write to a scratch folder, removed at the end)
    pauses, outputs, executor, saving = GcPauses(), RunOutputs(job, session, out, say), None, None
    try:
        outputs.start(ranks.lead)  # output_dir's lock, training_args.yaml, the plan, TensorBoard
        executor = make_executor(job, session, ranks)
        job.reference = prepare_reference(job, session, executor, start, ranks, say, console)  # (dpo: before updates)
        report = outputs.log(start, pauses)
        watcher = PlanWatcher(job, session, ranks, out, start, report)
        outputs.follow(executor, watcher)  # the stats file
        saving = Saving(job, session, ranks, out, say, outputs.config)
        evaluation = Evaluation(job, executor, ranks, report)
        steps = Steps(job, executor, ranks, report, start, say)
        report.replay(job.cfg.logging_steps)  # steps a killed trainer took but did not log
        with progress_bar(console) as bar:
            task = bar.add_task("training", total=job.total, completed=start)
            for step in range(start, job.total):
                result = steps.take(step, saving)
                ranks.after_step(step + 1)  # (several hosts: every host's next forward reads the new weights)
                reached.stepped(step + 1)
                steps.notes(step)
                watcher.observe(step, result, say)
                steps.log(step, result)
                if step == start:  # (the setup's and the compile's objects: out of later collections' walk)
                    pauses.freeze()
                evaluation.after(step + 1, steps.elapsed)  # (before the save: its trainer_state holds it)
                saving.after(step + 1)
                bar.advance(task)
            saving.finish()
        runtime = steps.elapsed()
        final_eval = evaluation.final(steps.elapsed)
        if not ranks.lead:  # (the lead exports; this rank is done: its going away is no loss)
            ranks.rank_done()
            return {}
        return outputs.finish(console, runtime, start, steps.rows_seen, final_eval, saving.saved)
    except BaseException:
        if saving is not None:
            saving.settle()  # a checkpoint already read out of the store is still worth writing
            reached.settled(saving.lineage, job.cfg.save_only_model)
        raise
    finally:
        pauses.close()
        outputs.close()
        if executor is not None:
            executor.close()
        ranks.remove_scratch()
