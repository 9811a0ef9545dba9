"""The run's weights into its store: the service's run as it stands, a checkpoint, the pretrained weights or a
random initialisation; with several ranks the host's first rank fills the shared store, each rank the state it
keeps in its own HBM, and every rank starts at the same step."""

from __future__ import annotations

import torch

from trainer.model.weights import group_order
from trainer.outputs import checkpoint as ckpt
from trainer.outputs.report import progress_bar
from trainer.outputs.weights_io import import_weights, init_weights, load_buffers
from trainer.run.job import Job


def load_weights(job: Job, session, ranks, console, say) -> int:
    """The run's weights into the store: the service's run as it stands, a checkpoint, the pretrained
    weights or a random initialisation; returns the step training starts at."""
    cfg, store, plan = job.cfg, session.store, job.plan
    if job.resume is not None or cfg.tiermem_init == "pretrained":  # (a generic-path model's untrained buffers)
        load_buffers(job.mcfg, job.resume or job.model_dir)
    if session.continues_at is not None:
        start = session.continues_at
        say(f"continuing the service's run at step {start} (epoch {plan.epoch_of(start):.2f})")
        return start
    if not ranks.fills_store:  # (the host's first rank fills the shared store)
        return _follow(job, session, ranks)
    kinds = {"param": job.dtype, **({"master": torch.float32} if cfg.bf16 else {})}
    start = 0
    with progress_bar(console) as progress:
        what = "resuming" if job.resume else "initialising" if cfg.tiermem_init == "random" else "loading"
        task = progress.add_task(f"{what} weights", total=job.n_params)
        adv = lambda n: progress.advance(task, n)
        held = ranks.held()
        if job.resume is not None:
            start = ckpt.load(store, job.resume, job.mcfg, job.dtype, cfg.bf16, adv)
            ckpt.set_rng_state(ckpt.tiermem_state(job.resume).get("rng", {}))
        elif cfg.tiermem_init == "random":
            init_weights(store, job.mcfg, kinds, cfg.seed, store.device, adv, names=held)
        else:
            import_weights(store, job.mcfg, job.model_dir, kinds, adv, names=held)
    session.loaded(start)
    ranks.tell_start(start)
    ranks.all_loaded(start, group_order(job.mcfg))
    if job.resume is not None:
        say(f"resumed from {job.resume} at step {start} (epoch {plan.epoch_of(start):.2f})")
    return start


def _follow(job: Job, session, ranks) -> int:
    """A rank that does not fill the store: the step the others start at, the state it keeps in its HBM."""
    start = ranks.told_start()
    names = ranks.own_hbm()
    if names:  # (the state this rank keeps in its HBM)
        _load_own_hbm(job, session, names)
    if job.resume is not None:
        ckpt.set_rng_state(ckpt.tiermem_state(job.resume).get("rng", {}))
    ranks.all_loaded(start, group_order(job.mcfg))
    return start


def _load_own_hbm(job: Job, session, names: set) -> None:
    """Several ranks: the state this rank keeps in its HBM, from the checkpoint resumed (its moments and master
    weights) or the model (its master weights; the moments start at zero)."""
    cfg, store = job.cfg, session.store
    if job.resume is not None:
        ckpt.load(store, job.resume, job.mcfg, job.dtype, cfg.bf16, only=names)
    elif cfg.bf16 and cfg.tiermem_init == "random":
        init_weights(store, job.mcfg, {"master": torch.float32}, cfg.seed, store.device, names=names)
    elif cfg.bf16:
        import_weights(store, job.mcfg, job.model_dir, {"master": torch.float32}, names=names)
