"""The run's store and optimizer, opened by the run's ranks (``trainer.parallel.ranks``): this process's own (the
``tiermem`` config), or the service's that ``tiermem_server`` names (which also decides, for a run it does not
hold, the checkpoint to resume); and what the run says of them at start."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import torch

from tiermem.optim import AdamWConfig, OptimSettings
from tiermem.schema import to_plain
from tiermem.session import Session
from tiermem.sizes import format_size
from trainer.data.prepare import Rows
from trainer.model.weights import all_weights, group_order
from trainer.outputs import checkpoint as ckpt
from trainer.outputs.resume import checked_resume
from trainer.planning import run_plan
from trainer.planning.placing import step_shape
from trainer.run.preference import kept_reference
from trainer.state import state_specs


def open_training_session(job, ranks, say) -> Session:
    """The store and its optimizer: this process's (the ``tiermem`` config), or the service's that
    ``tiermem_server`` names (which also decides, for a run it does not hold, the checkpoint to resume)."""
    cfg, mcfg = job.cfg, job.mcfg
    settings = OptimSettings(AdamWConfig(cfg.adam_beta1, cfg.adam_beta2, cfg.adam_epsilon, cfg.weight_decay),
                             cfg.bf16, {w.name: w.decay for w in all_weights(mcfg)}, group_order(mcfg))
    specs = state_specs(mcfg, job.dtype)
    if not cfg.tiermem_server:
        return ranks.open_embedded(job, specs, settings, say)
    label = {"model": str(cfg.model_name_or_path), "output_dir": str(job.out.resolve())}
    workload, plan_input = run_plan.service_plan_input(mcfg, job.dtype, step_shape(job), cfg.loss_chunk_tokens,
                                                       cfg.tiermem_physical_batch_size, cfg.tiermem_keep_activations)
    run_id = run_identity(cfg, mcfg, job.dtype, job.rows)
    # (overwrite_output_dir as Hugging Face means it: the run starts afresh, the service's run of it discarded)
    session = ranks.attach(specs, settings, cfg.tiermem_server, run_id, label, plan_input,
                           fresh=cfg.overwrite_output_dir)
    try:
        say(attach_line(session))
        if session.replaced is not None:
            say(f"note: overwrite_output_dir: the service's run of this output_dir (at step {session.replaced}) is "
                "discarded; this run starts at step 0 (overwrite_output_dir: false continues a service's run)")
        if session.service_plan is not None:  # the service planned the run (as an embedded run plans)
            job.store_plan = run_plan.from_service(session.service_plan, specs, workload,
                                                   cfg.micro_rows)  # (stage dpo: two rows a pair)
            run_plan.keep_activations(job.store_plan, cfg.tiermem_keep_activations, mcfg)  # (a number: as embedded)
            for line in run_plan.lines(job.store_plan):
                say(line)
        if session.continues_at is None:  # a new run in the service (from the checkpoint it names, if it lost one)
            job.resume = checked_resume(cfg, job.out, mcfg, job.model_dir, session.named_checkpoint, say,
                                        loads=ranks.loads_checkpoint)
        else:  # (stage dpo: the reference's figures the service's run was trained with)
            job.reference = kept_reference(job, session.continues_at)
    except BaseException:
        session.close()
        raise
    return session


# keys that do not change what a run computes: a rerun that differs only in them continues the run
NOT_IDENTITY = {"logging_steps", "save_steps", "save_only_model", "save_total_limit", "plot_loss", "report_to",
                "overwrite_output_dir", "overwrite_cache", "preprocessing_num_workers", "tiermem_server",
                "tiermem_cache_dir", "resume_from_checkpoint", "eval_strategy", "eval_steps",
                "per_device_eval_batch_size", "eval_dataset", "save_strategy", "logging_first_step", "logging_dir",
                "do_eval", "metric_for_best_model", "tiermem_dist_timeout", "tiermem_trust_old_checkpoints",
                # how the layers are computed, not what: the same math (kept graphs bit for bit; compiled kernels
                # to rounding)
                "tiermem_keep_activations", "torch_compile", "torch_compile_backend", "torch_compile_mode"}


def run_identity(cfg, mcfg, dtype: torch.dtype, rows: Rows) -> str:
    """A digest of what the run computes: the model's tensors, the settings that change the math, the rows."""
    data = hashlib.sha256()
    for ids, labels in zip(rows.input_ids, rows.labels):
        data.update(np.asarray(ids, dtype=np.int64).tobytes())
        data.update(b"|" if labels is None else np.asarray(labels, dtype=np.int64).tobytes())
        data.update(b"\n")
    settings = {k: v for k, v in to_plain(cfg).items() if k not in NOT_IDENTITY}
    ident = {"model": ckpt.signature(mcfg), "dtype": str(dtype), "settings": settings, "data": data.hexdigest()}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:32]


def attach_line(session: Session) -> str:
    """What an attached run says at start: the service, whether it holds the run, how the update is split."""
    mine, groups = session.updated_here, session.optimizer.groups
    split = (f"this trainer's GPU updates {len(mine)} of {len(groups)} groups ({span(mine)}), the service "
             "the others" if mine else "the service updates every group")
    at = session.continues_at
    return (f"attached to the tiermem service at {session.server}"
            + (f" (its run is at step {at})" if at is not None else " (a new run)") + f"; {split}")


def span(groups: list) -> str:
    """Groups named briefly: ``embed, 0-3, 5``."""
    parts, run = [], []
    for g in groups + [None]:
        if isinstance(g, int) and run and g == run[-1] + 1:
            run.append(g)
            continue
        if run:
            parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [g] if isinstance(g, int) else []
        if g is not None and not isinstance(g, int):
            parts.append(str(g))
    return ", ".join(parts)


def describe_store(store, say) -> None:
    """The store's line at start: each tier's state by kind, and the GPU's streaming slots."""
    parts = [f"{tier}: " + ", ".join(f"{k} {format_size(v)}" for k, v in kinds.items())
             for tier, kinds in store.bytes_by_tier().items() if kinds]
    n, nbytes = store.slots()
    say("store: " + "; ".join(parts) + f"; {n} GPU slots of {format_size(nbytes)}")
