"""The training config: LLaMA-Factory's YAML keys with LLaMA-Factory's meanings, plus tiermem's own.

    tiermem-train my.yaml learning_rate=2e-5 tiermem.tiers.dram.budget=64GiB

``load_train_config`` reads the YAML, applies ``key=value`` overrides (values parsed as YAML; dotted
keys reach into the inline ``tiermem`` mapping), checks every key and type, and resolves defaults.
Unknown keys are an error naming the nearest valid key; LLaMA-Factory keys this trainer does not use are
an error saying why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from tiermem.errors import ConfigError
from tiermem.schema import load_dataclass, read_yaml, to_plain

SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")

# LLaMA-Factory / Hugging Face keys that tiermem recognises but does not take, and why.
NOT_TAKEN = {
    "deepspeed": "tiermem replaces DeepSpeed offload; remove the key",
    "fsdp": "tiermem trains on one GPU without FSDP; remove the key",
    "fp16": "fp16 training is not supported; use bf16: true or bf16: false (fp32)",
    "lora_rank": "only finetuning_type: full is supported",
    "lora_target": "only finetuning_type: full is supported",
    "quantization_bit": "quantized training is not supported",
    "do_eval": "evaluation during training is set by eval_strategy: steps with eval_steps; remove do_eval",
    "streaming": "streaming datasets are not supported yet",
    "tool_format": "tool use is not supported yet",
    "packing": "packing is not configurable yet: stage pt always packs, tokenized rows are never packed",
}


@dataclass
class TrainConfig:
    # model
    model_name_or_path: str
    output_dir: str
    dataset: str
    stage: Literal["pt", "sft"] = "sft"
    do_train: bool = True
    finetuning_type: str = "full"
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
    eval_strategy: Literal["no", "steps"] = "no"
    eval_steps: int | None = None
    per_device_eval_batch_size: int = 8
    # output
    overwrite_output_dir: bool = False
    logging_steps: int = 10
    save_steps: int | None = None  # write output_dir/checkpoint-N every N steps
    save_only_model: bool = False
    save_total_limit: int | None = None
    plot_loss: bool = False
    report_to: str = "none"
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
    # GPU memory a pass may fill with boundary activations; a step whose micro-batches need more runs as
    # several layer-major passes. auto: half the GPU memory free after the store's; no limit on the CPU.
    tiermem_activation_budget: Any = "auto"


def _parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    out = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"bad override {item!r}: expected key=value (e.g. learning_rate=2e-5)")
        try:
            parsed = yaml.safe_load(value) if value else None
        except yaml.YAMLError:
            raise ConfigError(f"bad override {item!r}: the value is not valid YAML") from None
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


def load_train_config(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    data = read_yaml(path)
    for key, value in _parse_overrides(overrides or []):
        _apply(data, key, value)
    for key in data:
        if key in NOT_TAKEN:
            raise ConfigError(f"{path}: '{key}' is not supported: {NOT_TAKEN[key]}")
    cfg = load_dataclass(TrainConfig, data, "")
    validate(cfg)
    return cfg


def validate(c: TrainConfig) -> None:
    if not c.do_train:
        raise ConfigError("do_train: false — tiermem-train only trains (evaluation and prediction are not "
                          "supported yet)")
    if c.finetuning_type != "full":
        raise ConfigError(f"finetuning_type: {c.finetuning_type} is not supported; tiermem does full-parameter "
                          "training only (finetuning_type: full)")
    if c.report_to not in ("none", "None"):
        raise ConfigError(f"report_to: {c.report_to} is not supported; use report_to: none (tiermem writes "
                          "trainer_log.jsonl in output_dir)")
    if c.tiermem_server and c.tiermem is not None:
        raise ConfigError("tiermem and tiermem_server are both set: an attached run uses the service's store config "
                          "(`tiermem serve --config`); remove the tiermem key (or add tiermem=null)")
    if c.save_steps is not None and c.save_steps <= 0:
        raise ConfigError(f"save_steps must be positive, got {c.save_steps}")
    if c.save_total_limit is not None and c.save_total_limit <= 0:
        raise ConfigError(f"save_total_limit must be positive, got {c.save_total_limit}")
    positive = {"cutoff_len": c.cutoff_len, "per_device_train_batch_size": c.per_device_train_batch_size,
                "gradient_accumulation_steps": c.gradient_accumulation_steps, "logging_steps": c.logging_steps,
                "loss_chunk_tokens": c.loss_chunk_tokens}
    for k, v in positive.items():
        if v <= 0:
            raise ConfigError(f"{k} must be positive, got {v}")
    if c.preprocessing_num_workers is not None and c.preprocessing_num_workers <= 0:
        raise ConfigError(f"preprocessing_num_workers must be positive, got {c.preprocessing_num_workers}")
    if c.val_size < 0:
        raise ConfigError(f"val_size must not be negative, got {c.val_size}")
    has_eval = c.val_size > 0 or c.eval_dataset is not None
    if c.val_size > 0 and c.eval_dataset is not None:
        raise ConfigError("set either val_size (hold out part of dataset) or eval_dataset, not both")
    if c.eval_strategy == "steps":
        if not has_eval:
            raise ConfigError("eval_strategy: steps needs evaluation data: set val_size or eval_dataset")
        if c.eval_steps is None:
            c.eval_steps = c.logging_steps  # as the Hugging Face Trainer does
        if c.eval_steps <= 0:
            raise ConfigError("eval_steps must be positive")
    if c.template is not None:
        from trainer.data.templates import get_template

        get_template(c.template)
    if c.per_device_eval_batch_size <= 0:
        raise ConfigError("per_device_eval_batch_size must be positive")
    if c.max_samples is not None and c.max_samples <= 0:
        raise ConfigError(f"max_samples must be positive, got {c.max_samples}")
    numbers = {"learning_rate": c.learning_rate, "weight_decay": c.weight_decay, "max_grad_norm": c.max_grad_norm,
               "num_train_epochs": c.num_train_epochs, "warmup_ratio": c.warmup_ratio, "adam_beta1": c.adam_beta1,
               "adam_beta2": c.adam_beta2, "adam_epsilon": c.adam_epsilon, "val_size": c.val_size}
    for k, v in numbers.items():
        if not math.isfinite(v):
            raise ConfigError(f"{k} must be a finite number, got {v}")
    for k in ("learning_rate", "weight_decay", "max_grad_norm", "adam_epsilon", "warmup_steps"):
        if getattr(c, k) < 0:
            raise ConfigError(f"{k} must not be negative, got {getattr(c, k)}")
    for k in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(c, k) < 1:
            raise ConfigError(f"{k} must be in [0, 1), got {getattr(c, k)}")
    if not 0 <= c.seed < 2**32:
        raise ConfigError(f"seed must be from 0 to 2**32 - 1 (as the Hugging Face Trainer's), got {c.seed}")
    if not 0 <= c.warmup_ratio <= 1:
        raise ConfigError(f"warmup_ratio must be in [0, 1], got {c.warmup_ratio}")
    if c.moe_aux_loss_coef is not None and not (math.isfinite(c.moe_aux_loss_coef) and c.moe_aux_loss_coef >= 0):
        raise ConfigError(f"moe_aux_loss_coef must be a non-negative number, got {c.moe_aux_loss_coef}")
    if c.max_steps <= 0 and c.num_train_epochs <= 0:
        raise ConfigError("set max_steps or a positive num_train_epochs")
    if c.tiermem_activation_budget not in ("auto", None):
        from tiermem.sizes import parse_size

        c.tiermem_activation_budget = parse_size(c.tiermem_activation_budget, "tiermem_activation_budget")
    if c.tiermem is not None and not isinstance(c.tiermem, (str, dict)):
        raise ConfigError("tiermem: expected a path to a tiermem config file or an inline mapping")


def resolved(c: TrainConfig, store_cfg, activation_budget: int | None = None) -> dict:
    """The config as it will run, for ``output_dir/training_args.yaml``: the store's config with every
    ``auto`` decided, and the activation budget in bytes (null: no limit)."""
    out = to_plain(c)
    out["tiermem"] = to_plain(store_cfg)
    out["tiermem_activation_budget"] = activation_budget
    return out
