"""What a run writes besides its checkpoints. At its start: output_dir's lock (the lead's; an earlier run's outputs
set aside first under overwrite_output_dir), training_args.yaml (the config as it runs), the plan as
tiermem_plan.json (replayable: ``tiermem plan --workload FILE``), TensorBoard's writer, the step log
(``trainer.outputs.report``) and the stats file ``tiermem top`` follows. At its end: the exported
model, the results files and trainer_state.json, the loss plots and store_stats.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

from tiermem.plan.planner import DISCARDED_AT_END
from tiermem.store.stats import StatsFile
from trainer.config import decided_activations, resolved
from trainer.outputs import checkpoint as ckpt
from trainer.outputs import hf_outputs as hf
from trainer.outputs.output_dir import OutputLock, set_aside
from trainer.outputs.report import Reporter, plot_loss, progress_bar
from trainer.outputs.tensorboard import open_writer
from trainer.outputs.weights_io import export_model
from trainer.planning import run_plan
from trainer.planning.flops import flops_per_token
from trainer.planning.placing import activation_budget, kept_layers, piece_rows


class RunOutputs:
    def __init__(self, job, session, out: Path, say):
        self.job, self.session, self.out, self.say = job, session, out, say
        self.lock = self.tb = self.report = self.stats = None
        self.budget = None

    def start(self, lead: bool) -> None:
        """Take ``out`` (the lead: its lock), write what the run starts with."""
        job, out, say = self.job, self.out, self.say
        cfg, store, plan = job.cfg, self.session.store, job.store_plan
        out.mkdir(parents=True, exist_ok=True)
        if lead:  # (held until the run ends: a second run on output_dir is refused, and touches nothing here)
            self.lock = OutputLock.take(out, say)
            if cfg.overwrite_output_dir and job.resume is None and self.session.continues_at is None:
                set_aside(out, say)  # (the earlier run's outputs: out of the new run's way, with a note)
        ckpt.remove_partial(out)
        self.budget = activation_budget(cfg, store, plan)
        self.tb = open_writer(cfg, out) if lead else None  # report_to: tensorboard (sets cfg.logging_dir)
        rows = piece_rows(cfg, plan) or cfg.per_device_train_batch_size
        if rows < 2 * cfg.micro_rows:  # (else several micro-batches merged, as decided)
            rows = min(rows, cfg.per_device_train_batch_size)
        args = dict(self.config(), tiermem_model_path="generic" if job.mcfg.generic else "template",
                    torch_compile=job.mcfg.compile is not None, tiermem_keep_activations=kept_layers(cfg, plan),
                    tiermem_physical_batch_size=rows, tiermem_seq_chunk=decided_chunk(cfg, rows),
                    tiermem_activations=decided_activations(cfg, plan.act_host if plan is not None else 0,
                                                             job.mcfg.num_layers))
        (out / "training_args.yaml").write_text(yaml.safe_dump(args, sort_keys=False))
        if plan is not None and plan.prediction is not None:  # (replayable: tiermem plan --workload FILE)
            told = run_plan.report(plan, cfg.gradient_accumulation_steps)
            (out / "tiermem_plan.json").write_text(json.dumps(told, indent=1, default=str) + "\n")
            if told["advice"]:  # (what `tiermem plan` would advise: more tokens a step, more DRAM, a faster disk)
                say(f"plan: advice: {told['advice']}")

    def config(self) -> dict:
        """The config as it runs: the store's with every auto decided, the activation budget in bytes."""
        store = self.session.store
        return resolved(self.job.cfg, store, self.budget)

    def log(self, start: int, pauses) -> Reporter:
        """The step line and trainer_log.jsonl, from step ``start`` (``pauses``: the collector's, logged)."""
        cfg = self.job.cfg
        active = self.job.mcfg.num_params(active=True)  # what a token computes with (a sparse model's top-k experts)
        attention = flops_per_token(self.job.mcfg, cfg.cutoff_len)[1]
        self.report = Reporter(self.out, self.job.total, active, self.say, resume_step=start,
                               sink=self.tb.record if self.tb else None, first_step=cfg.logging_first_step,
                               attention_flops=attention)
        self.report.pauses = pauses
        return self.report

    def follow(self, executor, watcher) -> None:
        """The stats file (tiermem top --run, a service's top): the store's snapshot and the run's progress."""
        self.executor, self.watcher = executor, watcher
        self.stats = StatsFile(self.out / "tiermem_stats.json", self.session.store, self._live,
                               sink=self.session.progress_sink)

    def _live(self) -> dict:
        store, optimizer, report = self.session.store, self.session.optimizer, self.report
        active = self.job.mcfg.num_params(active=True)
        opt = {"last_update_s": optimizer.last_step_seconds, "split": optimizer.last_split,
               "gpu_share": optimizer.gpu_share, "cpu_groups": store.config.optimizer.cpu_groups}
        tps = report.live.get("tokens_per_s", 0.0)
        tflops = 6 * active * tps / 1e12
        return dict(report.live, phase=self.executor.phase, layer=self.executor.layer, optimizer=opt,
                    alloc_retries=_alloc_retries(store), tflops=tflops,
                    tflops_attention=tflops + report.attention_flops * tps / 1e12, plan=self.watcher.live())

    def finish(self, console, runtime: float, start: int, rows_seen: int, final_eval: dict | None,
               saved: dict) -> dict:
        """The lead's end of a whole run: the model exported, the results and the state written, the lock let go;
        the results."""
        job, session, out = self.job, self.session, self.out
        cfg, store, plan, total = job.cfg, session.store, job.plan, job.total
        session.refresh_layout()
        if session.embedded:  # (the service keeps its state) the disk's room goes to the export
            store.discard_stored(DISCARDED_AT_END)
        with progress_bar(console) as progress:
            task = progress.add_task("exporting", total=job.n_params)
            export_model(store, job.mcfg, out, "master" if cfg.bf16 else "param", job.dtype, job.model_dir,
                         lambda n: progress.advance(task, n))
        results = self.report.results(plan.epoch_of(total), runtime, max(total - start, 1), rows_seen)
        hf.save_metrics(out, "train", results)
        if final_eval is not None:
            hf.save_metrics(out, "eval", final_eval)
        hf.write_state(out / "trainer_state.json",
                       hf.trainer_state(cfg, hf.log_rows(out), total, total, plan.epoch_of(total),
                                        plan.steps_per_epoch, job.n_params, final=results, checkpoints=saved))
        if cfg.plot_loss:
            plot_loss(out, self.report.losses)
            if self.report.eval_losses:
                plot_loss(out, self.report.eval_losses, "eval_loss")
        final = dict(store.stats(), alloc_retries=_alloc_retries(store))
        (out / "store_stats.json").write_text(json.dumps(final, indent=1, default=str) + "\n")
        self.report.live.update(finished=True, train_loss=results["train_loss"], train_runtime=runtime, eta_s=0.0)
        self.stats.close()
        self.stats = None
        session.finished()
        steps = f"{total - start} steps this run ({total} in all)" if start else f"{total} steps"
        self.say(f"done: {steps} in {runtime:.1f}s, train_loss {results['train_loss']:.4f}; model saved to {out}")
        self.lock.release(finished=True)
        return results

    def close(self) -> None:
        """Whatever the run's end: the stats file stopped, the lock let go (a run that stopped before its end
        leaves the lock file: ``trainer.outputs.output_dir``), TensorBoard's file closed."""
        if self.stats is not None:
            self.stats.close()
        if self.lock is not None:
            self.lock.release(finished=False)
        if self.tb is not None:
            self.tb.close()


def _alloc_retries(store) -> int:
    """The CUDA caching allocator's retries so far (an allocation that freed the cache first), 0 on a CPU."""
    on_cuda = store.device.type == "cuda"
    return torch.cuda.memory_stats(store.device).get("num_alloc_retries", 0) if on_cuda else 0


def decided_chunk(cfg, rows: int) -> int:
    """tiermem_seq_chunk as the run takes it for a piece of ``rows`` full-length rows: the tokens a layer computes at
    once (all of the piece's when its rows run whole)."""
    from trainer.model.chunked import chunk_of

    setting = None if cfg.tiermem_seq_chunk == "auto" else cfg.tiermem_seq_chunk
    chunk = chunk_of(setting, rows, cfg.cutoff_len)
    return rows * (cfg.cutoff_len if chunk is None else chunk)
