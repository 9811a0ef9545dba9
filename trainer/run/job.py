"""A run's inputs, checked and prepared before any store is opened: the model's config, the checkpoint to resume
from, the rows tokenized (through the cache), the steps planned. Every check that can fail on user input (the
model directory, the data, the placement under the budgets) runs before anything is written to ``output_dir``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.text import Text

from tiermem.errors import ConfigError, printable
from trainer.config import TrainConfig
from trainer.data.batches import StepPlan
from trainer.data.prepare import Rows, load_rows, split_eval
from trainer.data.registry import resolve
from trainer.model import chunked
from trainer.model.config import ModelConfigError, load_balancing_coef
from trainer.model.select import load_model
from trainer.outputs.output_dir import check_free
from trainer.outputs.report import progress_bar
from trainer.outputs.resume import checked_resume
from trainer.outputs.tensorboard import check_logging_dir
from trainer.planning.placing import check_placement
from trainer.run.preference import check_ref_model, describe
from trainer.run.schedule import warmup_steps
from trainer.state import store_settings, wants_cuda


@dataclass
class Job:
    """A run's inputs, checked and prepared before any store is opened."""

    cfg: TrainConfig
    mcfg: object
    model_dir: Path
    out: Path
    rows: Rows
    eval_rows: Rows | None
    plan: StepPlan
    total: int
    warmup: int
    dtype: torch.dtype
    resume: Path | None  # the checkpoint an embedded run resumes from
    store_plan: object = None  # the planner's plan of an embedded run (tiermem.plan.placement.Plan)
    reference: object = None  # stage dpo: the reference's log-probabilities (trainer.run.preference.Reference)

    @property
    def n_params(self) -> int:
        return self.mcfg.num_params()


def prepare(cfg: TrainConfig, console: Console, say, ranks) -> Job:
    """Check the model and the config, pick the checkpoint to resume from, tokenize the data, plan the steps;
    nothing is written to output_dir. With several ranks (``ranks``: ``trainer.parallel.ranks``), rank 0
    tokenizes first (into the cache), the others after it."""
    model_dir = Path(cfg.model_name_or_path)
    mcfg = model_config(model_dir, cfg)
    ranks.check_model(cfg, mcfg)
    check_ref_model(cfg, mcfg, model_config)
    if mcfg.sliding_window is not None and cfg.cutoff_len > mcfg.sliding_window:
        raise ConfigError(f"cutoff_len {cfg.cutoff_len} exceeds the model's sliding_window {mcfg.sliding_window}; "
                          "sliding-window attention is not supported yet: lower cutoff_len")
    out = Path(cfg.output_dir)
    if ranks.lead and out.is_dir():  # one run per output_dir: another's holds its lock (trainer.outputs.output_dir)
        check_free(out)
    # an attached run picks its checkpoint once the service has said whether it holds the run
    resume = None if cfg.tiermem_server else checked_resume(cfg, out, mcfg, model_dir, say=say,
                                                            loads=ranks.loads_checkpoint)
    check_logging_dir(cfg)
    if cfg.plot_loss:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError("plot_loss: true needs matplotlib (pip install matplotlib)") from None
    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    if not cfg.tiermem_server:  # the placement under the budgets, before any data is read
        check_placement(cfg, mcfg, dtype, ranks)
    for note in [*cfg.notes, *mcfg.notes]:
        say(note)
    torch.manual_seed(cfg.seed)
    with ranks.lead_first():
        rows, eval_rows = prepare_data(cfg, mcfg, model_dir, console)
    show_example(rows, model_dir, say)
    # a step's rows: those of one process with per_device_train_batch_size x world size rows a micro-batch
    plan = StepPlan(rows.examples, cfg.per_device_train_batch_size * ranks.size, cfg.gradient_accumulation_steps,
                    cfg.seed)
    total = plan.total_steps(cfg.num_train_epochs, cfg.max_steps)
    warmup = warmup_steps(total, cfg.warmup_steps, cfg.warmup_ratio)
    job = Job(cfg, mcfg, model_dir, out, rows, eval_rows, plan, total, warmup, dtype, resume)
    if (eval_rows is not None or cfg.eval_steps is not None) and cfg.eval_strategy == "no" and not cfg.do_eval:
        say("note: evaluation data or eval_steps is set but eval_strategy is no: no evaluation will run")
    if cfg.template is not None and all(e.formatting == "tokenized" for e in resolve(cfg.dataset, cfg.dataset_dir)):
        say(f"note: template '{cfg.template}' is not used: tokenized datasets come rendered already")
    active = mcfg.num_params(active=True)
    say(f"[bold]tiermem-train[/]: {mcfg.family} {job.n_params / 1e6:,.1f}M params"
        + (f" ({active / 1e6:,.1f}M active)" if active != job.n_params else "")
        + (" (generic path)" if mcfg.generic else "") + f", {mcfg.num_layers} layers, "
        f"{'bf16' if cfg.bf16 else 'fp32'}; {rows.examples} training {'pairs' if rows.pairs else 'rows'}"
        + (f", {len(eval_rows)} evaluation rows" if eval_rows is not None else "")
        + f"; {total} steps of {cfg.per_device_train_batch_size}x{cfg.gradient_accumulation_steps}"
        + ranks.label + f" {'pairs' if rows.pairs else 'rows'} (warmup {warmup})")
    if cfg.stage == "dpo":
        say(describe(cfg, rows.examples))
    return job


def model_config(model_dir: Path, cfg: TrainConfig | None = None, depth: int | None = None):
    """The model's config.json read (for the path that computes it: ``tiermem_model_path``; scaled by
    ``rope_scaling`` for cutoff_len as LLaMA-Factory scales it), with the run's
    load-balancing loss weight (``moe_aux_loss_coef``) and whether its layers are compiled (``torch_compile``);
    its problems reported as the user's (one line, exit code 2). ``depth``: the same family at that many
    decoder layers (``tiermem plan --largest``)."""
    try:
        mcfg = (load_model(model_dir, depth=depth) if cfg is None else
                load_model(model_dir, cfg.tiermem_model_path, cfg.rope_scaling, cfg.cutoff_len, depth))
    except ModelConfigError as e:
        raise ConfigError(str(e)) from None
    if cfg is None:
        return mcfg
    mcfg.compile = compile_choice(cfg, mcfg)
    mcfg = load_balancing_coef(mcfg, cfg.moe_aux_loss_coef)
    if not mcfg.generic:
        mcfg.seq_chunk = None if cfg.tiermem_seq_chunk == "auto" else cfg.tiermem_seq_chunk
        cut = chunked.chunk_of(mcfg.seq_chunk, cfg.per_device_train_batch_size, cfg.cutoff_len)
        if cut is not None and mcfg.moe is not None and mcfg.moe.aux_loss_coef:
            raise ConfigError(chunked.router_refusal(cut))
    rows = cfg.tiermem_physical_batch_size
    if mcfg.moe is not None and mcfg.moe.aux_loss_coef and isinstance(rows, int) and rows != cfg.micro_rows:
        raise ConfigError(f"a load-balancing loss (moe_aux_loss_coef) with tiermem_physical_batch_size {rows} is not "
                          "supported yet: its statistics are a micro-batch's, and pieces of another size would count "
                          f"them otherwise; set tiermem_physical_batch_size: auto (or {cfg.micro_rows}), or "
                          "moe_aux_loss_coef: 0")
    return mcfg


def compile_choice(cfg: TrainConfig, mcfg):
    """torch_compile for this run: (backend, mode) or None; auto compiles on CUDA (the store's compute device, or
    an attached trainer's GPU)."""
    from trainer.model.compiled import CompileError, choose

    on_cuda = torch.cuda.is_available() and (bool(cfg.tiermem_server) or wants_cuda(store_settings(cfg.tiermem)))
    try:
        return choose(cfg.torch_compile, cfg.torch_compile_backend, cfg.torch_compile_mode, mcfg, on_cuda)
    except CompileError as e:
        raise ConfigError(str(e)) from None


def prepare_data(cfg: TrainConfig, mcfg, model_dir: Path, console: Console):
    """The training rows and the evaluation rows (or None), tokenized through the cache, with a bar."""
    say = lambda text: console.print(text, soft_wrap=True, highlight=False)

    def load(names: str, what: str) -> Rows:
        with progress_bar(console) as progress:
            task = progress.add_task(f"tokenizing {what}", total=None)
            rows = load_rows(names, cfg, mcfg, model_dir, lambda n: progress.advance(task, n),
                             lambda text: progress.update(task, description=f"tokenizing {what} ({text})"), say)
        say(f"{what}: {rows.examples} {'pairs' if rows.pairs else 'rows'} from {', '.join(rows.sources)}"
            + (" (from the cache)" if rows.from_cache else "")
            + (f"; {rows.dropped} dropped with nothing to predict" if rows.dropped else "")
            + (f"; {rows.skipped} bad rows skipped" if rows.skipped else ""))
        return rows

    rows = load(cfg.dataset, "training data")
    eval_rows = load(cfg.eval_dataset, "evaluation data") if cfg.eval_dataset else None
    if cfg.val_size > 0:
        rows, eval_rows = split_eval(rows, cfg.val_size, cfg.seed)
    return rows, eval_rows


LINES = "\n\t"  # the control characters dataset text keeps on the terminal: the example's lines, its tabs


def show_example(rows: Rows, model_dir: Path, say) -> None:
    """Print the first training example decoded, and the part of it that is trained (as LLaMA-Factory does; a pair's
    chosen and rejected rows)."""
    if not (Path(model_dir) / "tokenizer.json").is_file():
        return
    from trainer.data.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    for row, what in ((0, "chosen "), (1, "rejected ")) if rows.pairs else ((0, ""),):
        ids, labels = rows.input_ids[row], rows.labels[row]
        trained = ids if labels is None else [t for t in labels if t != -100]
        # (as Text: the dataset's own text, "[" and ":" included, is not read as rich markup or emoji codes)
        say(Text(f"example {what}input ({len(ids)} tokens):\n{printable(tok.decode(ids), keep=LINES)}"))
        say(Text(f"example {what}trained part ({len(trained)} tokens):\n{printable(tok.decode(trained), keep=LINES)}"))

