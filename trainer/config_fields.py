"""The training config's keys: each one's type, default and meaning, in one place.

``TrainConfig``'s fields are the keys ``tiermem-train`` takes (LLaMA-Factory's and Hugging Face's keys with
their meanings, and tiermem's own); each carries its meaning and the group it is listed under as metadata
(``tiermem.schema.setting``). ``tiermem-train --keys`` prints them and ``python -m trainer.config_doc`` writes
docs/config.md from them; loading and checking a config is ``trainer.config``.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass
from typing import ClassVar, Literal

from tiermem.errors import ConfigError, shown
from tiermem.schema import setting
from tiermem.sizes import parse_size

# the groups the keys are listed under, in order, with their headings
GROUPS = {"model": "Model", "preference": "Preference training (stage dpo)", "data": "Data",
          "training": "Training", "evaluation": "Evaluation",
          "outputs": "Outputs: logs, checkpoints, the model", "tiermem": "tiermem's own"}


def _whole_or_auto(least: int, what: str):
    """A converter: ``auto``, or a whole number of at least ``least`` (``what`` names it in the error)."""
    def convert(value, where):
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= least):
            return value
        raise ConfigError(f"{where} must be a number of {what} ({least} or more) or auto, got {shown(value)}")
    return convert


def _bool_or_auto(value, where):
    if value == "auto" or isinstance(value, bool):
        return value
    raise ConfigError(f"{where} must be true, false or auto, got {shown(value)}")


def _size_or_auto(value, where):
    return "auto" if value == "auto" else parse_size(value, where)


def _store_source(value, where):
    if isinstance(value, (str, dict)) and not isinstance(value, bool):
        return value
    raise ConfigError(f"{where}: expected a path to a tiermem config file or an inline mapping, got {shown(value)}")


def model(default=None, **kw):
    return setting(default, group="model", **kw)


def data(default=None, **kw):
    return setting(default, group="data", **kw)


def evaluation(default=None, **kw):
    return setting(default, group="evaluation", **kw)


def outputs(default=None, **kw):
    return setting(default, group="outputs", **kw)


def training(default=None, **kw):
    return setting(default, group="training", **kw)


def preference(default=None, **kw):
    return setting(default, group="preference", **kw)


def own(default=None, **kw):
    return setting(default, group="tiermem", **kw)




@dataclass
class TrainConfig:
    """Every key tiermem-train takes, in the order training_args.yaml records them; each field's metadata holds
    its meaning and its group (``GROUPS``)."""

    model_name_or_path: str = model(MISSING, help=(
        "a local Hugging Face model directory: config.json, model.safetensors or shards with their index, the "
        "tokenizer's files"))
    output_dir: str = outputs(MISSING, help=(
        "where the model, the logs and the checkpoints are written. An existing non-empty directory is refused "
        "unless overwrite_output_dir is set (one holding only what a run of tiermem-train left when it stopped "
        "before its first checkpoint is not: the same command runs again); one that is, is inside or contains "
        "model_name_or_path, or is inside resume_from_checkpoint, is refused. One run at a time per output_dir "
        "(a lock file, output_dir/.tiermem-train.lock)"))
    dataset: str = data(MISSING, help="dataset names in dataset_dir/dataset_info.json, comma-separated")
    stage: Literal["pt", "sft", "dpo"] = model("sft", help=(
        "pt: pre-training on packed text; sft: supervised fine-tuning on chat-templated rows, the prompt masked; "
        "dpo: preference training on ranking datasets (chosen and rejected responses; docs/preference.md). "
        "LLaMA-Factory's rm, ppo and kto are refused"))
    do_train: bool = model(True, help="true: tiermem-train only trains (false, evaluation or prediction alone, is "
                                      "refused)")
    finetuning_type: str = model("full", help="full: every parameter is trained (lora, freeze and oft are refused)")
    train_from_scratch: bool = model(False, help="true: initialise from config.json alone, as tiermem_init: random")
    tiermem_init: Literal["pretrained", "random"] = own("pretrained", help=(
        "pretrained: the model's weights; random: initialise from config.json alone (benchmarks, the quickstart)"))
    pref_beta: float = preference(0.1, help="the preference loss's beta: how far the policy may move from the "
                                            "reference (simpo: the reward's scale)")
    pref_ftx: float = preference(0.0, help="the SFT loss on the chosen response, this weight of it added")
    pref_bco_weight: float = preference(0.0, help="LLaMA-Factory's BCO term: refused unless 0 (not supported yet)")
    pref_loss: Literal["sigmoid", "hinge", "ipo", "kto_pair", "orpo", "simpo"] = preference("sigmoid", help=(
        "sigmoid (DPO), hinge, ipo, orpo or simpo (orpo and simpo need no reference model); kto_pair is refused"))
    dpo_label_smoothing: float = preference(0.0, help="sigmoid's label smoothing (conservative DPO), 0 to 0.5")
    simpo_gamma: float = preference(0.5, help="simpo's target reward margin")
    ref_model: str | None = preference(help=(
        "the reference model's directory (its weights' log-probabilities computed once before the first step); "
        "default: the model trained, as it starts"))
    dataset_dir: str = data("data", help="the directory of dataset_info.json and the datasets' files")
    template: str | None = data(help=(
        "the chat template of stage sft over alpaca or sharegpt data: default, empty, alpaca, llama2, llama3, "
        "mistral, qwen or gemma"))
    cutoff_len: int = data(2048, help="tokens a row keeps at most (stage pt: the block size text is packed into)")
    max_samples: int | None = data(help="rows read from each dataset at most (null: all)")
    train_on_prompt: bool = data(False, help="train on the prompts' tokens too (stage sft)")
    mask_history: bool = data(False, help="train on the last turn only (kept first when a row is cut)")
    preprocessing_num_workers: int | None = data(help="processes that tokenize the data", shown="1")
    overwrite_cache: bool = data(False, help="tokenize again instead of reading the tokenized-data cache")
    val_size: float = evaluation(0.0, help="hold out this fraction (below 1) or count of the training rows for "
                                           "evaluation")
    eval_dataset: str | None = evaluation(help="evaluation dataset names (instead of val_size), comma-separated")
    do_eval: bool | None = evaluation(help=(
        "evaluate once more at the end (eval_results.json); needs evaluation data"),
        shown="true unless eval_strategy is no")
    eval_strategy: Literal["no", "steps", "epoch"] = evaluation("no", help=(
        "steps: the evaluation loss every eval_steps steps; epoch: at each epoch's end (forward only, streamed); "
        "no: none during training"))
    eval_steps: int | None = evaluation(help="steps between evaluations (eval_strategy: steps)",
                                        shown="logging_steps")
    per_device_eval_batch_size: int = evaluation(8, help="rows an evaluation micro-batch takes")
    metric_for_best_model: str | None = evaluation(help=(
        "loss or eval_loss: trainer_state.json's best_metric is the lowest evaluation loss (no other metric)"))
    overwrite_output_dir: bool = outputs(False, help=(
        "write into a non-empty output_dir (and start afresh instead of resuming its newest checkpoint)"))
    logging_steps: int = outputs(10, help="steps between the step lines and trainer_log.jsonl's records")
    logging_first_step: bool = outputs(False, help="log step 1 too")
    logging_dir: str | None = outputs(help=(
        "where report_to: tensorboard writes its event files (one that cannot be made or written is refused "
        "before anything is written)"), shown="output_dir/runs/<date>_<host>")
    save_strategy: Literal["no", "steps", "epoch"] = outputs("steps", help=(
        "steps: a checkpoint (output_dir/checkpoint-N) every save_steps steps; epoch: at each epoch's end; no: "
        "none (best is refused: no best-model tracking)"))
    save_steps: int | None = outputs(help=(
        "steps between checkpoints with save_strategy: steps (null: none; Hugging Face's default is 500)"))
    save_only_model: bool = outputs(False, help="checkpoints hold the model only (a run cannot resume from them)")
    save_total_limit: int | None = outputs(help=(
        "keep this run's newest checkpoints only, this many (an earlier run's checkpoints in the same output_dir "
        "are never pruned: checkpoints record their run's lineage, which a resume carries on)"))
    plot_loss: bool = outputs(False, help="draw training_loss.png at the end")
    report_to: str | list[str] = outputs("none", help=(
        "tensorboard: TensorBoard event files (the Trainer's tags: train/loss, eval/loss, ...) in logging_dir; "
        "none; a list or a comma-separated string, as Hugging Face's. Online services (wandb, mlflow, swanlab, "
        "...) send nothing (a note): tiermem runs offline"))
    per_device_train_batch_size: int = training(8, help="rows a micro-batch takes (at most 2**20)")
    gradient_accumulation_steps: int = training(1, help=(
        "micro-batches an optimizer step takes (at most 2**20: a step and its plan are sized by them)"))
    learning_rate: float = training(5e-5, help="AdamW's learning rate at the schedule's peak")
    num_train_epochs: float = training(3.0, help="epochs to train (at most 1e9), unless max_steps is set")
    max_steps: int = training(-1, help="optimizer steps to train; above 0 it overrides num_train_epochs")
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = training("linear", help=(
        "the learning rate's schedule, as transformers.get_scheduler's; a warmup starts at 0"))
    warmup_ratio: float = training(0.0, help="the warmup's share of the steps, in [0, 1]")
    warmup_steps: int = training(0, help="the warmup's steps (over warmup_ratio)")
    weight_decay: float = training(0.0, help="AdamW's decoupled weight decay; none on biases and norm weights")
    adam_beta1: float = training(0.9, help="AdamW's beta1, in [0, 1)")
    adam_beta2: float = training(0.999, help="AdamW's beta2, in [0, 1)")
    adam_epsilon: float = training(1e-8, help=(
        "AdamW's epsilon, a positive fp32 number (0 would give 0/0 = NaN wherever a gradient has been 0)"))
    max_grad_norm: float = training(1.0, help="clip the global gradient norm (exact, over all parameters); 0: no "
                                              "clipping")
    bf16: bool = training(False, help="a bf16 compute copy with fp32 master weights and moments; false: fp32")
    tf32: bool | None = training(help=(
        "Hugging Face's: true turns on TF32 matmuls (CUDA matmul and cuDNN) for the run, false turns them off; "
        "unset leaves torch's default. A note where it changes nothing (no CUDA, a GPU before Ampere, bf16)"))
    seed: int = training(42, help="the data order (randperm seeded with seed + epoch) and tiermem_init: random")
    resume_from_checkpoint: str | None = outputs(help=(
        "a checkpoint directory to resume from"), shown="the newest complete checkpoint in output_dir, unless "
                                                        "overwrite_output_dir")
    tiermem: str | dict | None = own(convert=_store_source, shown="the defaults", yaml_type="path | mapping | null",
                                      help=(
        "the store's config (where the training state lives: the tiers' budgets, the placement): a path to a "
        "tiermem config file, or the same mapping inline (the tiermem config, below); dotted overrides reach "
        "into an inline one (tiermem.tiers.dram.budget=64GiB)"))
    tiermem_server: str | None = own(help=(
        "the socket of a running `tiermem serve`: the run attaches to the service's store (whose config it "
        "uses; the tiermem key must be unset) instead of making its own"))
    tiermem_skip_bad_rows: bool = own(False, help=(
        "skip rows that do not fit their dataset's format and count them, instead of stopping"))
    tiermem_cache_dir: str | None = own(help="where tokenized datasets are cached",
                                        shown="$TIERMEM_CACHE or ~/.cache/tiermem")
    loss_chunk_tokens: int = own(4096, help="tokens a chunk of the LM-head loss takes (bounds the logits' memory)")
    moe_aux_loss_coef: float | None = training(help=(
        "a mixture-of-experts model's router load-balancing loss: a weight above 0 turns it on with that weight, "
        "0 off; null: as config.json says (output_router_logits, router_aux_loss_coef)"))
    tiermem_model_path: Literal["auto", "template", "generic"] = own("auto", help=(
        "which code computes the model: template (tiermem's own layers), generic (transformers' own modules), or "
        "auto: the template where it covers the architecture and its config.json, else the generic path with one "
        "note saying what the template lacks"))
    rope_scaling: Literal["linear", "dynamic", "yarn", "llama3"] | None = model(help=(
        "LLaMA-Factory's RoPE scaling, applied as LLaMA-Factory applies it: for a cutoff_len beyond the model's "
        "pretrained length L (the scaling's original_max_position_embeddings, else max_position_embeddings), "
        "factor ceil(cutoff_len / L), max_position_embeddings L x factor, original_max_position_embeddings L "
        "(dynamic, yarn, llama3; llama3 with low/high frequency factors 1 and 4); the model's own scaling is "
        "replaced and the exported config.json says so. Rows within L: no effect (a note)"))
    tiermem_activation_budget: int | Literal["auto"] | None = own("auto", convert=_size_or_auto,
                                                              yaml_type="size | auto | null", help=(
        "GPU memory (a size: 8GiB) one pass may fill with boundary activations; a step whose micro-batches need "
        "more runs as several layer-major passes. auto: the planner's (half of the GPU memory free after the "
        "store's without a plan); null: no limit (the CPU's)"))
    tiermem_keep_activations: int | Literal["auto"] = own("auto", convert=_whole_or_auto(0, "layers"), help=(
        "decoder layers whose forward keeps its activations so that their backward skips the recompute (6·N "
        "instead of 8·N FLOP a token on them): the first ones whose weights live in HBM (a streamed layer's "
        "weights are gone before its backward), none while a load-balancing loss is on. auto: the planner's "
        "choice, made with the placement (HBM given to a layer's kept graph is HBM taken from state, so it keeps "
        "layers only where the step is predicted faster; none for a mixture of experts); a number: the first N "
        "of those; 0: none. Over rows cut into sequence chunks (tiermem_seq_chunk) a kept layer keeps its "
        "attention's graph alone, and its backward skips q/k/v and the attention's forward. The plan line says "
        "which layers are kept; kept or recomputed, the weights are the same bit for bit"))
    tiermem_physical_batch_size: int | Literal["auto"] = own("auto", convert=_whole_or_auto(1, "rows"), help=(
        "rows the GPU computes at once: a micro-batch runs as pieces of at most this many rows, each trimmed to "
        "its longest row, or, a multiple of a micro-batch's rows dividing the step's, as pieces of consecutive "
        "micro-batches merged, each padded to its longest row (the same step: the loss is the mean over all of its "
        "tokens, its gradient their sum; per_device_train_batch_size still decides which rows make up a "
        "micro-batch). auto: the planner's, told in the plan line: the micro-batch whole, or halves of it while a "
        "smaller piece is predicted faster or the larger does not fit, or 2 or 4 micro-batches merged where that "
        "fits HBM and is predicted more than 5% faster; whole while a load-balancing loss is on (a micro-batch's "
        "statistic) and in an attached run"))
    tiermem_seq_chunk: int | Literal["auto"] = own("auto", convert=_whole_or_auto(1, "tokens"), help=(
        "tokens a decoder layer computes at once over a long row (its norms, projections and feed-forward; the "
        "attention takes the whole row): auto cuts rows of more than 16,384 tokens into chunks of at most 8,192 "
        "(docs/long-context.md); a number: micro-batches of more tokens are cut along the sequence into that many"))
    tiermem_activations: Literal["auto", "gpu", "dram"] = own("auto", help=(
        "where a step's boundary activations (each layer's input, kept for the recompute) live: gpu; dram (the "
        "pinned arena, written as the forward leaves a layer, read back ahead of its backward); auto: on the GPU, "
        "the first layers' in DRAM where a step would otherwise need more than one pass (the planner's choice, "
        "with the state). NVMe does not take them yet"))
    torch_compile: bool | Literal["auto"] = training("auto", convert=_bool_or_auto, help=(
        "compile the decoder layer with torch.compile (the template's dense layers: one compiled function for "
        "every layer, the weights its inputs): auto compiles on CUDA, where it fuses the norms, RoPE, SwiGLU and "
        "the casts (the 3B shape's step 4.02 -> 3.14 s on an H200); true on a CPU too; not yet for "
        "mixture-of-experts layers or the generic path (true there is refused). The plan's timing of a layer "
        "compiles it (seconds to a minute; a second micro-batch shape compiles once more, dynamic in its shapes "
        "after that)"))
    torch_compile_backend: str = training("inductor", help="torch.compile's backend (any but cudagraphs)")
    torch_compile_mode: str | None = training(help=(
        "torch.compile's mode: default or max-autotune-no-cudagraphs (modes with CUDA graphs cannot follow "
        "weights that stream through slots)"))
    tiermem_dist_timeout: float = own(600.0, help=(
        "with several ranks (torchrun): seconds a collective, or a wait for another rank's update or save, may "
        "take before the run stops with one line naming the rank (at most 1e9)"))
    tiermem_trust_old_checkpoints: bool = own(False, help=(
        "resume from a checkpoint whose checkpoint.json has format 1 (file sizes only, no checksums: what it "
        "holds cannot be verified); without it such a checkpoint is refused in one line"))

    notes: ClassVar = ()  # (not a key) the note: lines of keys accepted without effect, set by load_train_config

    @property
    def micro_rows(self) -> int:
        """Rows a micro-batch holds: per_device_train_batch_size examples, each a pair of rows in stage dpo."""
        return self.per_device_train_batch_size * self.pair_rows

    @property
    def pair_rows(self) -> int:
        """Rows an example has: 2 in stage dpo (a piece the GPU computes at once holds whole pairs), else 1."""
        return 2 if self.stage == "dpo" else 1
