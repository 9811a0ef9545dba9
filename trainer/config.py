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
from pathlib import Path
from typing import Any

import yaml

from tiermem.errors import ConfigError, ConfigProblems, nearest
from tiermem.schema import load_dataclass, to_plain
from tiermem.yamlfile import load_yaml, read_yaml
from trainer.config_fields import TrainConfig
from trainer.config_keys import KEYS, REFUSED_VALUES
from trainer.paths import check_output_dir, expand_paths

SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
# the most micro-batches a step may take (gradient_accumulation_steps): a step's plan and schedule are sized by
# them (the planner weighs every number of passes they can be cut into), so a count in the trillions would never
# be planned; a million micro-batches of one 128-token row is already 2**27 tokens a step, 8 times the largest
# batches published (16M tokens)
MAX_MICRO_BATCHES = 1 << 20
REPORTERS = ("tensorboard",)  # what report_to may name, besides none
# Hugging Face's online reporters: tiermem runs offline, so naming one sends nothing (a note, as LLaMA-Factory's
# examples name wandb); what it reports (the losses) is in the step lines, trainer_log.jsonl and tensorboard's files
ONLINE_REPORTERS = ("azure_ml", "clearml", "codecarbon", "comet_ml", "dagshub", "dvclive", "flyte", "mlflow",
                    "neptune", "swanlab", "trackio", "wandb")
FP32_TINY = 1.1754943508222875e-38  # the smallest normal fp32 number: adam_epsilon's least value
FP32_MAX = 3.4028234663852886e38  # the largest fp32 number: learning_rate's and weight_decay's largest value


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
        cfg.notes = notes
        validate(cfg, problems, here)
    if problems:
        raise ConfigError(problems[0]) if len(problems) == 1 else ConfigProblems(problems)
    if cfg.tiermem_server and cfg.tiermem is not None:  # (the quickstart's tiermem key, attached to a service)
        cfg.notes = [*cfg.notes, "note: tiermem has no effect with tiermem_server: the service's store config "
                     "(`tiermem serve --config`) places the state of an attached run"]
        cfg.tiermem = None
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
        if name in ONLINE_REPORTERS:
            c.notes = [*c.notes, f"note: report_to: {name} has no effect here: tiermem runs offline and sends nothing; "
                                 "the losses are in the step lines and trainer_log.jsonl (report_to: tensorboard "
                                 "writes event files)"]
        elif name not in REPORTERS:
            bad(f"report_to: {name} is not supported: tiermem runs offline and reports to tensorboard only (event "
                "files in output_dir), besides its own trainer_log.jsonl: use report_to: tensorboard or none")
    c.report_to = ",".join(n for n in report_targets(c.report_to) if n in REPORTERS) or "none"
    if c.train_from_scratch:
        c.tiermem_init = "random"
    if c.metric_for_best_model not in (None, "loss", "eval_loss"):
        bad(f"metric_for_best_model: {c.metric_for_best_model} is not supported: the only metric is the evaluation "
            "loss (loss or eval_loss)")
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
    _check_preference(c, bad)
    if here:
        _check_inputs(c, bad)
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
    if not c.tiermem_server:
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


def _check_pieces(c: TrainConfig, bad) -> None:
    """tiermem_physical_batch_size larger than a micro-batch: whole micro-batches merged, dividing the step's rows."""
    rows, micro = c.tiermem_physical_batch_size, c.micro_rows
    if not isinstance(rows, int) or isinstance(rows, bool) or rows <= micro or micro <= 0:
        return
    step = micro * c.gradient_accumulation_steps
    if rows % micro == 0 and step % rows == 0:
        return
    merged = [micro * k for k in range(2, c.gradient_accumulation_steps + 1) if c.gradient_accumulation_steps % k == 0]
    shown = ", ".join(str(r) for r in merged[:12]) + (", ..." if len(merged) > 12 else "")
    valid = f"at most {micro} (pieces of a micro-batch)" + (f", or {shown} (micro-batches merged)" if merged else "")
    what = "more than the step's" if rows > step else "not a multiple of a micro-batch's rows dividing the step's"
    bad(f"tiermem_physical_batch_size {rows} is {what} {step} rows (gradient_accumulation_steps "
        f"{c.gradient_accumulation_steps} x {micro} rows a micro-batch); valid: {valid}")


def _check_compute(c: TrainConfig, bad) -> None:
    """torch.compile's mode and backend (the keys' other values are checked as they are read)."""
    _check_pieces(c, bad)
    if c.tiermem_activations == "dram" and c.tiermem_server:
        bad("tiermem_activations: dram is not supported yet with tiermem_server (the arena's room is the service's)")
    if c.torch_compile_mode not in (None, "default", "max-autotune-no-cudagraphs"):
        bad(f"torch_compile_mode must be default or max-autotune-no-cudagraphs (CUDA graphs cannot follow weights that "
            f"stream through slots), got {c.torch_compile_mode!r}")
    if c.torch_compile_backend != "inductor" and not _dynamo_backend(c.torch_compile_backend):
        bad(f"torch_compile_backend must name a torch.compile backend other than cudagraphs (inductor, aot_eager, "
            f"... : torch._dynamo.list_backends()), got {c.torch_compile_backend!r}")


PREF_DEFAULTS = {"pref_beta": 0.1, "pref_ftx": 0.0, "pref_bco_weight": 0.0, "pref_loss": "sigmoid",
                 "dpo_label_smoothing": 0.0, "simpo_gamma": 0.5, "ref_model": None}


def _check_preference(c: TrainConfig, bad) -> None:
    """Stage dpo's keys (LLaMA-Factory's meanings): in their ranges, and what is not supported yet refused; set
    with another stage they change nothing (a note)."""
    if c.stage != "dpo":
        changed = [k for k, v in PREF_DEFAULTS.items() if getattr(c, k) != v]
        if changed:
            c.notes = (*c.notes, f"note: {', '.join(changed)} {'has' if len(changed) == 1 else 'have'} no effect "
                                 f"here: used only by stage dpo")
        return
    for k in ("pref_beta", "pref_ftx", "pref_bco_weight", "dpo_label_smoothing", "simpo_gamma"):
        if not math.isfinite(getattr(c, k)):
            bad(f"{k} must be a finite number, got {getattr(c, k)}")
            return
    if c.pref_beta <= 0:
        bad(f"pref_beta must be positive, got {c.pref_beta}")
    if c.pref_ftx < 0:
        bad(f"pref_ftx must not be negative, got {c.pref_ftx}")
    if c.pref_bco_weight != 0:
        bad("pref_bco_weight: BCO's running reward baseline is not supported yet; set it to 0")
    if c.pref_loss == "kto_pair":
        bad("pref_loss: kto_pair is not supported: the losses are sigmoid, hinge, ipo, orpo and simpo")
    if not 0 <= c.dpo_label_smoothing <= 0.5:
        bad(f"dpo_label_smoothing must be in [0, 0.5], got {c.dpo_label_smoothing}")
    if c.dpo_label_smoothing and c.pref_loss != "sigmoid":
        bad(f"dpo_label_smoothing applies to pref_loss: sigmoid only, not {c.pref_loss}")
    if c.ref_model is not None and c.pref_loss in ("orpo", "simpo"):
        c.notes = (*c.notes, f"note: ref_model has no effect here: pref_loss {c.pref_loss} needs no reference model")
    if c.eval_dataset is not None or c.val_size > 0 or c.do_eval:
        bad("stage dpo: evaluation is not supported yet (its rewards and accuracies); remove eval_dataset, val_size "
            "and eval_strategy")
    rows = c.tiermem_physical_batch_size
    if isinstance(rows, int) and not isinstance(rows, bool) and rows % 2:
        bad(f"tiermem_physical_batch_size must be even in stage dpo (a piece holds whole pairs), got {rows}")


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


def _check_inputs(c: TrainConfig, bad) -> None:
    """What the run reads, checked with the rest of the config: the model's config.json and every dataset's
    problems (each unknown name with the names dataset_info.json has, unusable entries, missing files)."""
    from trainer.data.registry import problems as dataset_problems
    from trainer.model.config import ModelConfigError, read_config_json

    if c.model_name_or_path:  # (an empty path is refused already)
        try:
            read_config_json(c.model_name_or_path)
        except ModelConfigError as e:
            bad(str(e))
    names = [n.strip() for v in (c.dataset, c.eval_dataset) if v for n in str(v).split(",") if n.strip()]
    if c.dataset_dir:
        for line in dataset_problems(",".join(dict.fromkeys(names)), c.dataset_dir):
            bad(line)


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


def activations_role(cfg: TrainConfig) -> str:
    """tiermem_activations as the planner takes it: the role of the tier the boundary activations must live in
    (``tiermem.tiers.base``'s DEVICE or HOST), or auto (the planner's choice)."""
    from tiermem.tiers.base import DEVICE, HOST

    return {"gpu": DEVICE, "dram": HOST}.get(cfg.tiermem_activations, "auto")


def decided_activations(cfg: TrainConfig, host_layers: int, layers: int) -> str:
    """tiermem_activations as a plan took it (``host_layers``: the first layers whose inputs it put in DRAM, of
    ``layers``): gpu (none), dram (every layer's input), or auto where only the first layers' inputs are in DRAM (no
    other value says so: tiermem_plan.json has which)."""
    if cfg.tiermem_activations != "auto":
        return cfg.tiermem_activations
    return "gpu" if host_layers == 0 else "dram" if host_layers >= layers else "auto"

