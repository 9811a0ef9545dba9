"""The training config: LLaMA-Factory's YAML keys with LLaMA-Factory's meanings, plus tiermem's own.

    tiermem-train my.yaml learning_rate=2e-5 tiermem.tiers.dram.budget=64GiB

``load_train_config`` reads the YAML, applies ``key=value`` overrides (values parsed as YAML; dotted
keys reach into the inline ``tiermem`` mapping), checks every key and type, and resolves defaults. Every
LLaMA-Factory and Hugging Face key gets one of three answers (``trainer.config_keys``): taken, accepted
without effect (a ``note:`` line), or refused with the reason. An unknown key is an error naming the
nearest known one. Every problem of a config is reported at once (``ConfigProblems``), before anything
else happens.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from tiermem.errors import ConfigError, ConfigProblems, nearest
from tiermem.schema import load_dataclass, to_plain
from tiermem.yamlfile import load_yaml, read_yaml
from trainer.config_keys import KEYS, REFUSED_VALUES
from trainer.paths import check_output_dir, expand_paths

SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
# the most micro-batches a step may take (gradient_accumulation_steps): a step's plan and schedule are sized by
# them (the planner weighs every number of passes they can be cut into), so a count in the trillions would never
# be planned; a million micro-batches of one 128-token row is already 2**27 tokens a step, 8 times the largest
# batches published (16M tokens)
MAX_MICRO_BATCHES = 1 << 20
REPORTERS = ("tensorboard",)  # what report_to may name, besides none
FP32_TINY = 1.1754943508222875e-38  # the smallest normal fp32 number: adam_epsilon's least value
FP32_MAX = 3.4028234663852886e38  # the largest fp32 number: learning_rate's and weight_decay's largest value
@dataclass
class TrainConfig:
    # model
    model_name_or_path: str
    output_dir: str
    dataset: str
    stage: Literal["pt", "sft"] = "sft"
    do_train: bool = True
    finetuning_type: str = "full"
    train_from_scratch: bool = False  # as tiermem_init: random
    tiermem_init: Literal["pretrained", "random"] = "pretrained"
    # data
    dataset_dir: str = "data"
    template: str | None = None
    cutoff_len: int = 2048
    max_samples: int | None = None
    train_on_prompt: bool = False
    mask_history: bool = False
    preprocessing_num_workers: int | None = None
    overwrite_cache: bool = False
    # evaluation
    val_size: float = 0.0
    eval_dataset: str | None = None
    do_eval: bool | None = None  # evaluate at the end (eval_results.json); default: eval_strategy is not no
    eval_strategy: Literal["no", "steps", "epoch"] = "no"
    eval_steps: int | None = None
    per_device_eval_batch_size: int = 8
    metric_for_best_model: str | None = None  # loss or eval_loss: trainer_state.json's best_metric
    # output
    overwrite_output_dir: bool = False
    logging_steps: int = 10
    logging_first_step: bool = False
    logging_dir: str | None = None  # report_to: tensorboard writes its event files here (default output_dir/runs)
    save_strategy: Literal["no", "steps", "epoch"] = "steps"
    save_steps: int | None = None  # with save_strategy steps: write output_dir/checkpoint-N every N steps
    save_only_model: bool = False
    save_total_limit: int | None = None
    plot_loss: bool = False
    report_to: Any = "none"  # none or tensorboard (a list or a comma-separated string, as Hugging Face's)
    # optimisation
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 5e-5
    num_train_epochs: float = 3.0
    max_steps: int = -1
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "linear"
    warmup_ratio: float = 0.0
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    bf16: bool = False
    seed: int = 42
    resume_from_checkpoint: str | None = None
    # tiermem's own
    tiermem: Any = None  # a path to a tiermem config file, or the same mapping inline
    tiermem_server: str | None = None
    tiermem_skip_bad_rows: bool = False  # skip rows that do not fit their dataset's format (counted), not stop
    tiermem_cache_dir: str | None = None  # tokenized-dataset cache; default $TIERMEM_CACHE or ~/.cache/tiermem
    loss_chunk_tokens: int = 4096  # tokens per chunk of the LM-head loss (bounds the logits' memory)
    # the router's load-balancing loss of a mixture-of-experts model (LLaMA-Factory's key): a weight > 0 turns it
    # on with that weight, 0 off; unset: as config.json says (output_router_logits, router_aux_loss_coef)
    moe_aux_loss_coef: float | None = None
    # which code computes the model: auto (the template where it covers the architecture, else the generic
    # path through transformers' own modules), template, or generic
    tiermem_model_path: Literal["auto", "template", "generic"] = "auto"
    # LLaMA-Factory's RoPE scaling for rows longer than the model's positions (trainer.model.rope's
    # llamafactory_scaling): config.json scaled as LLaMA-Factory scales it, and exported so
    rope_scaling: Literal["linear", "dynamic", "yarn", "llama3"] | None = None
    # GPU memory a pass may fill with boundary activations; a step whose micro-batches need more runs as
    # several layer-major passes. auto: half the GPU memory free after the store's; no limit on the CPU.
    tiermem_activation_budget: Any = "auto"
    # decoder layers whose forward keeps its activations for the backward instead of recomputing them (the
    # first ones whose weights live in HBM: a streamed layer's weights are gone before its backward); 0: none;
    # auto: the planner's choice, with the placement (a dense model's; a mixture of experts keeps none on auto)
    tiermem_keep_activations: Any = "auto"
    # rows the GPU computes at once: a micro-batch of per_device_train_batch_size rows runs as pieces of at most
    # this many (the same step: the loss is the mean over all of its tokens); auto: the planner's (smaller pieces
    # where HBM is short; the micro-batch's own while a load-balancing loss is on, a micro-batch's statistic)
    tiermem_physical_batch_size: Any = "auto"
    # tokens a decoder layer computes at once over a long row (its norms, projections and feed-forward; the
    # attention takes the whole row): auto cuts rows of more than 16,384 tokens into chunks of at most 8,192
    # (docs/long-context.md); a number: micro-batches of more tokens are cut along the sequence into that many
    tiermem_seq_chunk: Any = "auto"
    # where a step's boundary activations (each layer's input, kept for the recompute) live: gpu; dram (the pinned
    # arena, written as the forward leaves a layer, read back ahead of its backward); auto: on the GPU, the first
    # layers' in DRAM where a step would otherwise need more than one pass (the planner's choice, with the state)
    tiermem_activations: Literal["auto", "gpu", "dram"] = "auto"
    # torch.compile of the decoder layer (the template's dense layers; trainer.model.compiled): true, false, or
    # auto (on CUDA); Hugging Face's keys, with its backend and mode (modes with CUDA graphs are refused)
    torch_compile: Any = "auto"
    torch_compile_backend: str = "inductor"
    torch_compile_mode: str | None = None
    # with several ranks (torchrun): seconds a collective, or a wait for another rank's update, may take before
    # the run stops with one line naming the rank
    tiermem_dist_timeout: float = 600.0
    # resume from a checkpoint whose manifest has format 1 (file sizes only, no checksums: not verifiable)
    tiermem_trust_old_checkpoints: bool = False

    notes = ()  # (not a field) the note: lines of keys accepted without effect, set by load_train_config


def _dynamo_backend(name) -> bool:
    """Whether ``name`` is a torch.compile backend a layer that streams its weights can run under."""
    import torch._dynamo

    return isinstance(name, str) and name != "cudagraphs" and name in torch._dynamo.list_backends(exclude_tags=())


def _parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    out = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"bad override {item!r}: expected key=value (e.g. learning_rate=2e-5)")
        try:
            parsed = load_yaml(value, f"override {key.strip()}") if value else None
        except ConfigError as e:
            shown = item if len(item) <= 80 else item[:77] + "..."
            raise ConfigError(f"bad override {shown!r}: {str(e).split(': ', 1)[1]}") from None
        out.append((key.strip(), parsed))
    return out


def _apply(data: dict, key: str, value: Any) -> None:
    if "." not in key:
        data[key] = value
        return
    head, rest = key.split(".", 1)
    if head != "tiermem":
        raise ConfigError(f"override {key}: only the inline 'tiermem' mapping takes dotted keys")
    node = data.get("tiermem")
    if node is None:
        node = data["tiermem"] = {}
    if not isinstance(node, dict):
        raise ConfigError(f"override {key}: 'tiermem' is a file path here; edit that file instead")
    parts = rest.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key}: '{p}' is not a mapping")
    node[parts[-1]] = value


def load_train_config(path: str | Path, overrides: list[str] | None = None, here: bool = True) -> TrainConfig:
    """The training config of ``path`` with ``overrides``, checked whole: every problem in one ConfigProblems
    (each one line). ``cfg.notes`` holds the ``note:`` lines of keys accepted without effect. ``here``: the
    run is on this machine (its memory bounds the DRAM budget; ``tiermem plan`` for another says False)."""
    data = read_yaml(path)
    for key, value in _parse_overrides(overrides or []):
        _apply(data, key, value)
    problems: list[str] = []
    notes: list[str] = []
    data = _answer_keys(data, problems, notes)
    cfg = load_dataclass(TrainConfig, data, "", problems)
    if cfg is not None:
        validate(cfg, problems, here)
    if problems:
        raise ConfigError(problems[0]) if len(problems) == 1 else ConfigProblems(problems)
    cfg.notes = notes
    return cfg


def known_keys() -> list[str]:
    """Every key tiermem-train knows: its own fields and every key it answers (no effect, refused)."""
    return sorted({f.name for f in dataclasses.fields(TrainConfig)} | set(KEYS))


def _answer_keys(data: dict, problems: list[str], notes: list[str]) -> dict:
    """The keys TrainConfig takes (values refused by name reported); the others answered from config_keys:
    a note, a refusal, or an unknown key with the nearest known one."""
    taken = {f.name for f in dataclasses.fields(TrainConfig)}
    out = {}
    for key, value in data.items():
        if key in taken:
            allowed, why = REFUSED_VALUES.get(key, (None, ""))
            if allowed is not None and isinstance(value, str) and value not in allowed:
                problems.append(f"{key}: {value} is not supported: {why}")
                continue
            out[key] = value
            continue
        answer = KEYS.get(key)
        if answer is None:
            problems.append(f"unknown config key '{key}'{nearest(str(key), known_keys())}")
        elif answer.silent(value):
            continue
        elif answer.kind == "refuse":
            problems.append(f"{key}: {_show(value)} is refused: {answer.reason}")
        else:
            notes.append(f"note: {key} has no effect here: {answer.reason}")
    return out


def _show(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip().removesuffix("...").strip()


def report_targets(value: Any) -> list[str]:
    """report_to as a list of names ([] for none), as Hugging Face reads it (a name, a list, commas)."""
    if value is None:
        return []
    names = value if isinstance(value, list) else str(value).split(",")
    names = [str(n).strip() for n in names if str(n).strip()]
    return [] if names in (["none"], ["None"]) else names


def validate(c: TrainConfig, problems: list[str] | None = None, here: bool = True) -> None:
    """Check the values of ``c`` and resolve its defaults; every problem appended to ``problems`` (or the
    first raised when there is no list)."""
    found: list[str] = [] if problems is None else problems
    start = len(found)
    bad = found.append
    expand_paths(c, bad)  # (~ expanded in every path key, before anything reads them)
    check_output_dir(c, bad)
    if not c.do_train:
        bad("do_train: false: tiermem-train only trains (evaluation and prediction alone are not supported yet)")
    if c.finetuning_type != "full":
        bad(f"finetuning_type: {c.finetuning_type} is not supported: {REFUSED_VALUES['finetuning_type'][1]}")
    for name in report_targets(c.report_to):
        if name == "wandb":
            bad("report_to: wandb is not supported: tiermem runs offline and sends nothing to Weights & Biases; use "
                "report_to: tensorboard (event files in output_dir) or none")
        elif name not in REPORTERS:
            bad(f"report_to: {name} is not supported: tiermem runs offline and reports to tensorboard only (event "
                "files in output_dir), besides its own trainer_log.jsonl: use report_to: tensorboard or none")
    c.report_to = ",".join(report_targets(c.report_to)) or "none"
    if c.train_from_scratch:
        c.tiermem_init = "random"
    if c.metric_for_best_model not in (None, "loss", "eval_loss"):
        bad(f"metric_for_best_model: {c.metric_for_best_model} is not supported: the only metric is the evaluation "
            "loss (loss or eval_loss)")
    if c.tiermem_server and c.tiermem is not None:
        bad("tiermem and tiermem_server are both set: an attached run uses the service's store config "
            "(`tiermem serve --config`); remove the tiermem key (or add tiermem=null)")
    if c.save_steps is not None and c.save_steps <= 0:
        bad(f"save_steps must be positive, got {c.save_steps}")
    if c.save_total_limit is not None and c.save_total_limit <= 0:
        bad(f"save_total_limit must be positive, got {c.save_total_limit}")
    positive = {"cutoff_len": c.cutoff_len, "per_device_train_batch_size": c.per_device_train_batch_size,
                "gradient_accumulation_steps": c.gradient_accumulation_steps, "logging_steps": c.logging_steps,
                "loss_chunk_tokens": c.loss_chunk_tokens, "per_device_eval_batch_size": c.per_device_eval_batch_size}
    for k, v in positive.items():
        if v <= 0:
            bad(f"{k} must be positive, got {v}")
    if c.gradient_accumulation_steps > MAX_MICRO_BATCHES:
        bad(f"gradient_accumulation_steps must be at most {MAX_MICRO_BATCHES:,} (2**20 micro-batches a step), got "
            f"{c.gradient_accumulation_steps:,}; take more rows a micro-batch (per_device_train_batch_size) instead")
    for key in ("per_device_train_batch_size", "per_device_eval_batch_size"):
        if getattr(c, key) > MAX_MICRO_BATCHES:  # (the planner may cut a micro-batch into pieces of one row each)
            bad(f"{key} must be at most {MAX_MICRO_BATCHES:,} (2**20 rows a micro-batch), got {getattr(c, key):,}")
    if c.preprocessing_num_workers is not None and c.preprocessing_num_workers <= 0:
        bad(f"preprocessing_num_workers must be positive, got {c.preprocessing_num_workers}")
    if c.max_samples is not None and c.max_samples <= 0:
        bad(f"max_samples must be positive, got {c.max_samples}")
    _check_eval(c, bad)
    if c.template is not None:
        from trainer.data.templates import get_template

        _collect(bad, get_template, c.template)
    _check_numbers(c, bad)
    if not 0 <= c.seed < 2**32:
        bad(f"seed must be from 0 to 2**32 - 1 (as the Hugging Face Trainer's), got {c.seed}")
    if not (math.isfinite(c.tiermem_dist_timeout) and 0 < c.tiermem_dist_timeout <= 1e9):
        bad(f"tiermem_dist_timeout must be a positive number of seconds (at most 1e9), got {c.tiermem_dist_timeout}")
    if c.moe_aux_loss_coef is not None and not (math.isfinite(c.moe_aux_loss_coef) and c.moe_aux_loss_coef >= 0):
        bad(f"moe_aux_loss_coef must be a non-negative number, got {c.moe_aux_loss_coef}")
    _check_compute(c, bad)
    if c.tiermem is not None and not isinstance(c.tiermem, (str, dict)):
        bad("tiermem: expected a path to a tiermem config file or an inline mapping")
    elif not c.tiermem_server:
        from trainer.state import store_config

        _collect(bad, store_config, c.tiermem, here)  # the store's config: keys, sizes, devices (budgets: at start)
    if problems is None and len(found) > start:
        raise ConfigError(found[start])


def _check_numbers(c: TrainConfig, bad) -> None:
    """The optimisation's numbers: finite, in their ranges."""
    numbers = {"learning_rate": c.learning_rate, "weight_decay": c.weight_decay, "max_grad_norm": c.max_grad_norm,
               "num_train_epochs": c.num_train_epochs, "warmup_ratio": c.warmup_ratio, "adam_beta1": c.adam_beta1,
               "adam_beta2": c.adam_beta2, "adam_epsilon": c.adam_epsilon, "val_size": c.val_size}
    finite = True
    for k, v in numbers.items():
        if not math.isfinite(v):
            bad(f"{k} must be a finite number, got {v}")
            finite = False
    if finite:
        for k in ("learning_rate", "weight_decay", "max_grad_norm", "warmup_steps"):
            if getattr(c, k) < 0:
                bad(f"{k} must not be negative, got {getattr(c, k)}")
        for k in ("learning_rate", "weight_decay"):
            if getattr(c, k) > FP32_MAX:
                bad(f"{k} must be at most {FP32_MAX:.4g} (the largest fp32 number: the update computes in fp32), "
                    f"got {getattr(c, k)}")
        if not c.adam_epsilon >= FP32_TINY:  # (0 or less, or 0 once it is an fp32: the kernels compute in fp32)
            bad(f"adam_epsilon must be positive (at least {FP32_TINY:.3g}, the smallest normal fp32 number), got "
                f"{c.adam_epsilon}: AdamW divides by sqrt(exp_avg_sq) + adam_epsilon, 0/0 = NaN wherever a gradient "
                "has been 0 so far")
        for k in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(c, k) < 1:
                bad(f"{k} must be in [0, 1), got {getattr(c, k)}")
        if not 0 <= c.warmup_ratio <= 1:
            bad(f"warmup_ratio must be in [0, 1], got {c.warmup_ratio}")
        if c.max_steps <= 0 and c.num_train_epochs <= 0:
            bad("set max_steps or a positive num_train_epochs")
        if c.num_train_epochs > 1e9:  # (times the steps of an epoch, it must stay a number of steps)
            bad(f"num_train_epochs must be at most 1e9, got {c.num_train_epochs}")


def _check_compute(c: TrainConfig, bad) -> None:
    """How the layers are computed: kept activations, pieces, torch.compile, the activation budget."""
    keep = c.tiermem_keep_activations
    if keep != "auto" and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 0):
        bad(f"tiermem_keep_activations must be a number of layers (0 or more) or auto, got {keep!r}")
    rows = c.tiermem_physical_batch_size
    if rows != "auto" and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
        bad(f"tiermem_physical_batch_size must be a number of rows (1 or more) or auto, got {rows!r}")
    if c.tiermem_activations == "dram" and c.tiermem_server:
        bad("tiermem_activations: dram is not supported yet with tiermem_server (the arena's room is the service's)")
    chunk = c.tiermem_seq_chunk
    if chunk != "auto" and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        bad(f"tiermem_seq_chunk must be a number of tokens (1 or more) or auto, got {chunk!r}")
    if c.torch_compile != "auto" and not isinstance(c.torch_compile, bool):
        bad(f"torch_compile must be true, false or auto, got {c.torch_compile!r}")
    if c.torch_compile_mode not in (None, "default", "max-autotune-no-cudagraphs"):
        bad(f"torch_compile_mode must be default or max-autotune-no-cudagraphs (CUDA graphs cannot follow weights that "
            f"stream through slots), got {c.torch_compile_mode!r}")
    if c.torch_compile_backend != "inductor" and not _dynamo_backend(c.torch_compile_backend):
        bad(f"torch_compile_backend must name a torch.compile backend other than cudagraphs (inductor, aot_eager, "
            f"... : torch._dynamo.list_backends()), got {c.torch_compile_backend!r}")
    if c.tiermem_activation_budget not in ("auto", None):
        from tiermem.sizes import parse_size

        budget = _collect(bad, parse_size, c.tiermem_activation_budget, "tiermem_activation_budget")
        c.tiermem_activation_budget = budget if budget is not None else "auto"


def _check_eval(c: TrainConfig, bad) -> None:
    if c.val_size < 0:
        bad(f"val_size must not be negative, got {c.val_size}")
    has_eval = c.val_size > 0 or c.eval_dataset is not None
    if c.val_size > 0 and c.eval_dataset is not None:
        bad("set either val_size (hold out part of dataset) or eval_dataset, not both")
    if c.eval_strategy != "no" and not has_eval:
        bad(f"eval_strategy: {c.eval_strategy} needs evaluation data: set val_size or eval_dataset")
    if c.eval_strategy == "steps" and c.eval_steps is None:
        c.eval_steps = c.logging_steps  # as the Hugging Face Trainer does
    if c.eval_steps is not None and c.eval_steps <= 0:
        bad("eval_steps must be positive")
    if c.do_eval is None:
        c.do_eval = c.eval_strategy != "no"  # as the Hugging Face Trainer does
    elif c.do_eval and not has_eval:
        bad("do_eval: true needs evaluation data: set val_size or eval_dataset")


def _collect(bad, fn, *args):
    """``fn(*args)``; a ConfigError it raises becomes a problem (and None the result)."""
    try:
        return fn(*args)
    except ConfigError as e:
        bad(str(e))
        return None


def resolved(c: TrainConfig, store, activation_budget: int | None = None) -> dict:
    """The config as it will run, for ``output_dir/training_args.yaml``: the store's config with every
    ``auto`` decided (``store.config_as_run()``: its placement per kind, the tiers' budgets and a storage tier's
    backend as they are), and the activation budget in bytes (null: no limit)."""
    out = to_plain(c)
    out["tiermem"] = store.config_as_run()
    out["tiermem_activation_budget"] = activation_budget
    return out
