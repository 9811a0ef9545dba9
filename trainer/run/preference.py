"""Stage dpo in the run: the preference loss as the executor's head objective, and the reference model's
log-probabilities, computed once before the first step and kept (docs/preference.md).

The head (``PreferenceHead``): a micro-batch's rows come in pairs (row 2k chosen, 2k+1 rejected, pieces of whole
pairs), so each pair's loss is complete within the piece that holds it. For each piece the head first computes
every row's summed log-probability over its trained tokens (no gradient: the final norm and LM head per row,
chunked over tokens as the cross-entropy is), then the pairs' losses (``trainer.model.pref_loss``) and their
derivative by each row's log-probability, then the head's backward with each row's cross-entropy weighted by
minus that derivative (d loss / d theta = sum over rows of d loss / d logp_row x d logp_row / d theta). A step's
loss is the mean over all of its pairs, so the weights carry 1 / (the step's pairs): accumulation over
micro-batches, pieces and passes gives one big batch's gradient. The cost: the head's forward once more.

The reference (``Reference``): DPO, IPO and hinge compare with a frozen reference model. Its summed
log-probability of every row is computed once before training (``prepare_reference``), by a forward pass over
every pair through the same executor, with the weights of ``ref_model`` loaded into the store for it (and the
starting weights loaded back after), or, when ``ref_model`` is unset, with the starting weights themselves before
the first update. The figures (one float a row) are saved in every checkpoint (``tiermem_reference.json``), with
a digest of the rows they belong to, and a resume reads them back rather than recompute them from weights that
have moved. A run attached to a service also keeps them in its output_dir (the same file) as soon as they are
computed: a rerun that continues the service's run (not a checkpoint) after its trainer was killed reads them there.

Several ranks: a step's pairs are split over the ranks (whole pairs each), and the head weights every rank's
pairs by 1 / (the pairs of the whole step, summed over the ranks), as SFT's loss counts the whole step's tokens;
the logged figures are sums over the ranks divided by that count. The reference's pass gives each rank every
world-size-th micro-batch, and the figures are summed over the ranks (each row's is one rank's, the others add
0), so every rank holds all of them, the lead to save them. With ``ref_model`` the host's first rank loads its
weights into the shared store and the starting ones back, the ranks waiting for each other around the pass.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tiermem.errors import ConfigError
from trainer.data.batches import collate
from trainer.model.pref_loss import NAMES, PrefLoss

REFERENCE_FILE = "tiermem_reference.json"


def pref_loss_of(cfg) -> PrefLoss:
    return PrefLoss(cfg.pref_loss, cfg.pref_beta, cfg.pref_ftx, cfg.dpo_label_smoothing, cfg.simpo_gamma)


def pair_pieces(rows: int | None) -> int | None:
    """Rows of a piece holding whole pairs: ``rows`` rounded up to an even number (None stays None)."""
    return None if rows is None else max(2, rows + rows % 2)


def describe(cfg, n_pairs: int | None = None) -> str:
    """The run's start line (and ``tiermem plan``'s) about its preference loss and its reference."""
    loss = pref_loss_of(cfg)
    head = f"stage dpo: {NAMES[loss.kind]}, pref_beta {loss.beta:g}" + (
        f", pref_ftx {loss.ftx:g}" if loss.ftx else "") + (f", simpo_gamma {loss.simpo_gamma:g}"
                                                            if loss.kind == "simpo" else "")
    if not loss.uses_reference:
        return head + "; no reference model"
    ref = cfg.ref_model or "the starting model"
    pairs = "every pair" if n_pairs is None else f"the {n_pairs} pairs"
    return (head + f"; reference: {ref}, its log-probabilities computed once before the first step (a forward "
            f"over {pairs}) and kept in checkpoints")


class PreferenceHead:
    """The executor's head objective of stage dpo (see the module's docstring)."""

    def __init__(self, loss: PrefLoss, world=None):
        """``world`` (``trainer.parallel.dist.World``, several ranks): the step's pairs and figures are the
        world's sums."""
        self.loss, self.world = loss, world
        self._sums: dict[str, torch.Tensor] = {}
        self._pairs = 0

    def begin(self, batches: list) -> float:
        """A step over ``batches`` (this rank's) begins: the scale of its pairs' summed losses (1 / the step's
        pairs, every rank's)."""
        pairs = sum(b[0].shape[0] for b in batches) // 2
        self._pairs = pairs if self.world is None else int(self.world.sum([pairs])[0])
        self._sums = {}
        return 1.0 / max(self._pairs, 1)

    def figures(self) -> dict[str, float]:
        """The step's figures, each a mean over its pairs (every rank's)."""
        if self.world is None:
            return {k: float(v) / max(self._pairs, 1) for k, v in self._sums.items()}
        keys = self.loss.logged()
        got = self.world.sum([float(self._sums.get(k, 0.0)) for k in keys])
        return {k: v / max(self._pairs, 1) for k, v in zip(keys, got)}

    def head_loss_backward(self, model, batch):
        """The head's loss and backward over the piece ``batch`` (its rows in pairs), with the stages' signature
        (``model.head_loss_backward``): (summed pair losses, grad of h, head grads, tied grad)."""

        def run(h, targets, w, tied, scale, chunk, acc=None, tied_acc=None):
            rows = h.shape[0]
            if rows % 2:
                raise ValueError("a piece of stage dpo holds whole pairs")
            with torch.no_grad():
                ce = torch.stack([model.head_loss(h[r: r + 1], targets[r: r + 1], w, tied, chunk) for r in range(rows)])
            lengths = (targets != -100).sum(1)
            ref = batch[4].to(h.device) if len(batch) > 4 else None
            sums = (-ce).detach().requires_grad_()
            with torch.enable_grad():
                losses, figures = self.loss.pair_losses(sums, lengths, ref)
                total = losses.sum()
                (g,) = torch.autograd.grad(total * scale, [sums])
            for k in self.loss.logged():
                self._sums[k] = self._sums.get(k, 0.0) + figures[k].sum()
            grads_h = []
            for r in range(rows):  # (each row's cross-entropy weighted by -d loss / d logp_row)
                _, gh, acc, tied_acc = model.head_loss_backward(h[r: r + 1], targets[r: r + 1], w, tied, -g[r], chunk,
                                                                acc=acc, tied_acc=tied_acc)
                grads_h.append(gh)
            return total.detach(), torch.cat(grads_h), acc, tied_acc

        return run


@dataclass
class Reference:
    """The reference model's summed log-probability of every row (pair k: rows 2k, 2k+1), and where from."""

    sums: list[float]
    source: str  # the reference model's directory, or "the starting model"
    digest: str  # of the rows they belong to

    def of(self, idx: list[int]) -> torch.Tensor:
        """The figures of pairs ``idx``, by row (chosen, rejected of each)."""
        return torch.tensor([self.sums[r] for i in idx for r in (2 * i, 2 * i + 1)], dtype=torch.float32)

    def state(self) -> dict:
        return {"sums": self.sums, "source": self.source, "digest": self.digest}


def rows_digest(rows) -> str:
    """A digest of the training rows' ids and labels (the reference's figures belong to exactly these)."""
    h = hashlib.sha256()
    for ids, labels in zip(rows.input_ids, rows.labels):
        h.update(np.asarray(ids, dtype=np.int64).tobytes() + b"|")
        h.update(b"-" if labels is None else np.asarray(labels, dtype=np.int64).tobytes() + b"|")
    return h.hexdigest()


def check_ref_model(cfg, mcfg, model_config) -> None:
    """``ref_model`` is a model of the trained one's shapes (its weights are loaded into the same store), checked
    before anything is written; ``model_config(path)`` reads one."""
    if cfg.stage != "dpo" or cfg.ref_model is None or not pref_loss_of(cfg).uses_reference:
        return
    from trainer.outputs.checkpoint import signature
    from trainer.outputs.weights_io import check_weight_files

    if cfg.tiermem_init == "random":
        raise ConfigError("ref_model with tiermem_init: random is not supported yet (the starting weights are "
                          "drawn, not read back after the reference's pass); unset ref_model to compare with them")
    ref = model_config(Path(cfg.ref_model))
    if signature(ref) != signature(mcfg) or ref.generic != mcfg.generic:
        raise ConfigError(f"ref_model {cfg.ref_model}: its weights' names and shapes differ from the model's "
                          f"({cfg.model_name_or_path}); the reference must be the same architecture and size")
    check_weight_files(ref, cfg.ref_model)


def prepare_reference(job, session, executor, start: int, ranks, say, console=None) -> Reference | None:
    """The reference's figures of the run (None: the loss needs none): read from the checkpoint resumed, or from
    output_dir when the run continues a service's run, or computed now, before the first update, with
    ``ref_model``'s weights or the starting ones (a bar on ``console``); ``ranks``: the run's
    (``trainer.parallel.ranks``)."""
    cfg = job.cfg
    if cfg.stage != "dpo" or not pref_loss_of(cfg).uses_reference:
        return None
    digest = rows_digest(job.rows)
    if job.resume is not None:
        return _from_checkpoint(job.resume, digest)
    if session.continues_at:  # (the service's run has moved from the starting weights: read when it attached)
        return job.reference
    source = cfg.ref_model or "the starting model"
    # (a ref_model that is the model trained: its weights are the starting ones, already in the store)
    other = cfg.ref_model is not None and Path(cfg.ref_model).resolve() != Path(job.model_dir).resolve()
    if other:
        _swap(job, session, ranks, Path(cfg.ref_model))
    t0 = time.perf_counter()
    if console is None:
        sums, tokens = _forward(job, executor, start, ranks)
    else:
        from trainer.outputs.report import progress_bar

        with progress_bar(console) as bar:
            task = bar.add_task("reference log-probabilities", total=job.rows.examples)
            sums, tokens = _forward(job, executor, start, ranks, lambda n: bar.advance(task, n))
    seconds = time.perf_counter() - t0
    if other:
        _swap(job, session, ranks, job.model_dir)  # (the starting weights back)
    flops = 2 * job.n_params * tokens
    say(f"reference log-probabilities of {job.rows.examples} pairs ({source}): {tokens:,} tokens in {seconds:.2f}s, "
        f"{flops / max(seconds, 1e-9) / 1e12:.3g} TFLOP/s (forward: 2 x params x tokens)")
    reference = Reference(sums, str(source), digest)
    if not session.embedded and ranks.lead:  # (a rerun that continues the service's run reads them there)
        _write(job.out / REFERENCE_FILE, reference.state())
    return reference


def _swap(job, session, ranks, model_dir: Path) -> None:
    """The compute copy of ``model_dir``'s weights in the store: loaded by the process that fills it (several
    ranks: the host's first), the ranks waiting for each other before (no rank still reads the weights before)
    and after (every rank reads these)."""
    ranks.world.barrier()
    if ranks.fills_store:
        _load_param(job, session, model_dir, ranks.held())
    ranks.world.barrier()


def _load_param(job, session, model_dir: Path, names: set | None) -> None:
    from trainer.outputs.weights_io import import_weights

    import_weights(session.store, job.mcfg, model_dir, {"param": job.dtype}, names=names)


def _forward(job, executor, version: int, ranks, progress=None) -> tuple[list[float], int]:
    """Every row's summed log-probability with the weights of ``version``, a step's micro-batches at a time (the
    pieces the executor computes at once; several ranks: every world-size-th micro-batch each, the figures
    summed over the ranks); (the figures by row, the non-padding tokens). ``progress(pairs)``: this rank's."""
    from trainer.run import pieces
    from trainer.run.stepping import pad_id

    cfg, rows = job.cfg, job.rows
    bs, group = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps
    pairs = list(range(rows.examples))
    mbs = ranks.shard([pairs[i: i + bs] for i in range(0, len(pairs), bs)])
    sums = [0.0] * (2 * rows.examples)
    tokens = 0
    for g in range(0, len(mbs), group):
        batches, order = [], []
        for idx in mbs[g: g + group]:
            r = rows.rows_of(idx)
            order += r
            batches.append(collate([rows.input_ids[i] for i in r], [rows.labels[i] for i in r], pad_id(job.mcfg)))
        cut = pieces.cut(batches, executor.piece_rows)
        tokens += sum(b[2] for b in cut)
        mine = [-float(x) for ce in executor.forward_losses(cut, version, per_row=True) for x in ce]
        for r, v in zip(order, mine, strict=True):
            sums[r] = v
        if progress is not None:
            progress(sum(len(idx) for idx in mbs[g: g + group]))
    if ranks.size > 1:  # (each row's figure is one rank's: the others add 0.0, exactly)
        *sums, tokens = ranks.sum([*sums, tokens])
    return sums, int(tokens)


def _from_checkpoint(path: Path, digest: str) -> Reference:
    f = Path(path) / REFERENCE_FILE
    if not f.is_file():
        raise ConfigError(f"{path} holds no reference log-probabilities ({REFERENCE_FILE}): it is not a stage dpo "
                          "checkpoint; train from its model (model_name_or_path) instead of resuming")
    return _read(f, digest, "resume with the data it was trained on")


def kept_reference(job, step: int) -> Reference | None:
    """The figures an attached run kept in its output_dir, when a rerun continues the service's run at ``step`` > 0
    (read as it attaches, before training begins: a run without them cannot continue); None: it needs none."""
    cfg = job.cfg
    if cfg.stage != "dpo" or not pref_loss_of(cfg).uses_reference or not step:
        return None
    out, digest = job.out, rows_digest(job.rows)
    f = Path(out) / REFERENCE_FILE
    if not f.is_file():
        raise ConfigError(f"{out} holds no reference log-probabilities ({REFERENCE_FILE}), which the service's run "
                          f"at step {step} was trained with; rerun with overwrite_output_dir: true to start afresh")
    return _read(f, digest, "rerun with overwrite_output_dir: true to start afresh")


def _read(f: Path, digest: str, fix: str) -> Reference:
    data = json.loads(f.read_text())
    if data.get("digest") != digest:
        raise ConfigError(f"{f.parent}: its reference log-probabilities are of other rows than this run's (the "
                          f"dataset, template or cutoff_len changed); {fix}")
    return Reference([float(x) for x in data["sums"]], str(data.get("source")), digest)


def _write(f: Path, state: dict) -> None:
    """``state`` as JSON at ``f``, whole or not at all (a trainer killed while writing it leaves the old file)."""
    tmp = f.with_name(f.name + ".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, f)
