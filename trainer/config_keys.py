"""Every key of LLaMA-Factory's model, data, training, finetuning and generating arguments and of Hugging
Face's ``TrainingArguments`` (transformers 4 and 5), and tiermem's answer to each.

Three answers:

- **taken**: a field of ``trainer.config.TrainConfig``, with the same meaning (not listed here);
- **no effect** (``noop``): accepted whatever its value, and one ``note:`` line at start says why it changes
  nothing here (``gradient_checkpointing``: the step always recomputes from layer boundaries);
- **refused** (``refuse``): running without it would train something other than what the config asks
  for (LoRA, a PPO stage, DeepSpeed, fp16, streaming...): one line with the reason.

A key whose value asks for nothing beyond what tiermem does anyway (``fp16: false``, ``deepspeed: null``,
``push_to_hub: false``) is accepted silently: ``Answer.ok`` lists those values (``None`` always is one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Answer:
    kind: str  # "noop" or "refuse"
    reason: str
    ok: tuple = ()  # values that ask for nothing tiermem does not do: accepted without a word

    def silent(self, value: Any) -> bool:
        return value is None or any(value == v and type(value) is type(v) for v in self.ok)


def _noop(reason: str, *keys: str, ok: tuple = ()) -> dict[str, Answer]:
    return {k: Answer("noop", reason, ok) for k in keys}


def _refuse(reason: str, *keys: str, ok: tuple = (False,)) -> dict[str, Answer]:
    return {k: Answer("refuse", reason, ok) for k in keys}


ONE_PROCESS = ("tiermem's ranks are torchrun's processes, one store per host (README: Several GPUs): DDP's and "
               "the launcher's settings do not apply")
DATALOADER = "batches are collated in the training process; tokenizing uses preprocessing_num_workers"
KERNELS = "tiermem chooses its own kernels (SDPA attention, a chunked LM-head loss)"
RECOMPUTE = "the step always recomputes each layer from its boundary activation (layer-major, see README)"
HUB = "nothing is uploaded: the model is written to output_dir"
GENERATION = "generation settings: tiermem-train does not generate"
MULTIMODAL = "multimodal inputs are not supported: these settings have no text-only meaning"
INFERENCE = "an inference or export setting of LLaMA-Factory's other commands"
LOGGING = "tiermem prints its own dense step line and writes trainer_log.jsonl"
LORA = "used only by finetuning_type: lora (tiermem trains every parameter: finetuning_type full)"
FREEZE = "used only by finetuning_type: freeze (tiermem trains every parameter: finetuning_type full)"
RLHF = "used only by the rm, ppo and kto stages (tiermem trains stage pt, sft or dpo)"
OPTIMIZER = "tiermem's optimizer is AdamW over fp32 master weights and moments; other optimizers are not supported"
LOADING = "tiermem reads the model's safetensors directly, tensor by tensor"
ONE_ROW = ("one GPU holds the whole row: tiermem bounds a long row's memory by streaming the layers' state and "
           "recomputing each layer from its boundary activation, not by splitting the row over GPUs (several ranks "
           "train rows of their own)")

KEYS: dict[str, Answer] = {
    # -- LLaMA-Factory model arguments ------------------------------------------------------------------
    **_noop("tiermem builds the supported architectures itself (Llama, Mistral, Qwen2, Qwen3, gpt-oss) or through "
            "transformers' own classes; no model code "
            "from the model directory is run", "trust_remote_code"),
    **_noop(LOADING, "low_cpu_mem_usage", "offload_folder", "cache_dir", "model_revision", "device_map",
            "use_fast_tokenizer"),
    **_noop(HUB + "; models are read from local directories only", "hf_hub_token", "ms_hub_token",
            "om_hub_token"),
    **_noop(KERNELS, "flash_attn", "attn", "enable_liger_kernel", "use_liger_kernel", "liger_kernel_config",
            "use_v1_kernels", "use_unsloth_gc"),
    **_noop(RECOMPUTE, "gradient_checkpointing", "gradient_checkpointing_kwargs", "disable_gradient_checkpointing",
            "use_reentrant_gc", "activation_checkpointing", "activation_checkpointing_kwargs"),
    **_noop(INFERENCE, "infer_backend", "infer_dtype", "use_kv_cache", "use_cache", "vllm_maxlen", "vllm_gpu_util",
            "vllm_enforce_eager", "vllm_max_lora_rank", "vllm_config", "sglang_maxlen", "sglang_mem_fraction",
            "sglang_tp_size", "sglang_config", "sglang_lora_backend", "export_dir", "export_size", "export_device",
            "export_quantization_bit", "export_quantization_dataset", "export_quantization_nsamples",
            "export_quantization_maxlen", "export_legacy_format", "export_hub_model_id", "print_param_status"),
    **_noop(MULTIMODAL, "image_max_pixels", "image_min_pixels", "image_do_pan_and_scan", "crop_to_patches",
            "video_max_pixels", "video_min_pixels", "video_fps", "video_maxlen", "use_audio_in_video",
            "audio_sampling_rate", "image_resolution", "video_resolution", "media_dir", "freeze_vision_tower",
            "freeze_multi_modal_projector", "freeze_language_model"),
    **_noop("used only with quantization_bit (quantized training is not supported)", "quantization_method",
            "quantization_type", "double_quantization", "quantization_device_map"),
    **_refuse("quantized training is not supported: tiermem trains full-precision weights (fp32 master)",
              "quantization_bit", ok=()),
    **_refuse("adapters (LoRA) are not supported: tiermem trains every parameter of the model",
              "adapter_name_or_path", "adapter_folder", ok=()),
    **_refuse("changing the tokenizer's vocabulary is not supported: the model's embedding keeps its size",
              "resize_vocab", "add_tokens", "add_special_tokens", "new_special_tokens", "new_special_tokens_config",
              "split_special_tokens"),
    **_refuse("changing the tokenizer's vocabulary is not supported", "init_special_tokens", ok=("noise_init",)),
    **_refuse("this changes the model's architecture, which tiermem does not support", "shift_attn",
              "mixture_of_depths", "use_unsloth", "upcast_layernorm", "upcast_lmhead_output"),
    **_noop(ONE_ROW, "sequence_parallel_size", ok=(1,)),
    **_noop(ONE_ROW, "sequence_parallel_mode"),
    **_refuse("KTransformers offload is not supported: tiermem keeps the state in its own tiered store", "use_kt"),
    **_noop("used only with use_kt", "kt_cpu_activation", "kt_weight_path", "kt_non_expert_weight_path",
            "kt_expert_checkpoint_path", "kt_use_lora_experts", "kt_lora_expert_num",
            "kt_lora_expert_intermediate_size", "kt_config"),
    # -- LLaMA-Factory data arguments -------------------------------------------------------------------
    **_refuse("streaming datasets are not supported yet: tiermem tokenizes (and caches) the whole dataset first",
              "streaming"),
    **_noop("used only with streaming", "buffer_size"),
    **_refuse("only mix_strategy: concat is supported (datasets are concatenated)", "mix_strategy",
              ok=("concat",)),
    **_refuse("interleaved dataset mixing is not supported (datasets are concatenated)", "interleave_probs", ok=()),
    **_noop("tokenizing goes in chunks of 256 rows per worker", "preprocessing_batch_size"),
    **_noop(GENERATION, "eval_num_beams", "ignore_pad_token_for_loss", "predict_with_generate", "sortish_sampler",
            "generation_max_length", "generation_num_beams", "generation_config", "do_sample", "temperature",
            "top_p", "top_k", "num_beams", "max_length", "max_new_tokens", "repetition_penalty", "length_penalty",
            "skip_special_tokens"),
    **_noop("evaluation reports one loss over all evaluation datasets", "eval_on_each_dataset"),
    **_refuse("packing is not configurable yet: stage pt always packs, stage sft never does", "packing",
              ok=()),
    **_refuse("neat packing is not supported (stage sft rows are never packed)", "neat_packing"),
    **_refuse("tool use is not supported yet", "tool_format", ok=()),
    **_noop("tiermem caches tokenized data itself, under tiermem_cache_dir", "tokenized_path",
            "data_shared_file_system"),
    **_refuse("a default system prompt changes the training text; it is not supported yet (put the system prompt "
              "in the data)", "default_system", ok=()),
    **_refuse("enable_thinking: false (templates without the thinking part) is not supported", "enable_thinking",
              ok=(True,)),
    # -- LLaMA-Factory finetuning arguments -----------------------------------------------------------
    **_noop(LORA, "lora_rank", "lora_alpha", "lora_dropout", "lora_target", "additional_target", "loraplus_lr_ratio",
            "loraplus_lr_embedding", "use_rslora", "use_dora", "pissa_init", "pissa_iter", "pissa_convert",
            "create_new_adapter", "oft_rank", "oft_block_size", "oft_target", "module_dropout", "use_llama_pro"),
    **_noop(FREEZE, "freeze_trainable_layers", "freeze_trainable_modules", "freeze_extra_modules",
            "train_mm_proj_only"),
    **_noop(RLHF, "kto_chosen_weight", "kto_rejected_weight", "ppo_buffer_size", "ppo_epochs", "ppo_score_norm",
            "ppo_target", "ppo_whiten_rewards", "reward_model", "reward_model_adapters",
            "reward_model_quantization_bit", "reward_model_type", "use_ref_model"),
    **_refuse("the reference model is a full model (ref_model: its path); adapters and quantization of it are not "
              "supported", "ref_model_adapters", "ref_model_quantization_bit", ok=()),
    **_refuse("LD-DPO's length-desensitised log-probabilities are not supported yet", "ld_alpha", ok=()),
    **_refuse(OPTIMIZER, "use_galore", "use_apollo", "use_badam", "use_adam_mini", "use_muon"),
    **_noop("used only with use_galore, use_apollo or use_badam (not supported)", "galore_target", "galore_rank",
            "galore_update_interval", "galore_scale", "galore_proj_type", "galore_layerwise", "apollo_target",
            "apollo_rank", "apollo_update_interval", "apollo_scale", "apollo_proj", "apollo_proj_type",
            "apollo_scale_type", "apollo_layerwise", "apollo_scale_front", "badam_mode", "badam_start_block",
            "badam_switch_mode", "badam_switch_interval", "badam_update_ratio", "badam_mask_mode", "badam_verbose"),
    **_refuse("pure bf16 training (no fp32 master weights) is not supported: bf16: true keeps fp32 master weights "
              "and moments in the store", "pure_bf16"),
    **_refuse("this changes the training loss, which tiermem does not support", "use_dft_loss", "use_asft_loss",
              "use_eaft_loss"),
    **_noop("used only with use_asft_loss", "asft_alpha"),
    **_refuse("early stopping is not supported: the run trains the planned steps", "early_stopping_steps", ok=()),
    **_refuse("the training rows are always shuffled (seeded by seed)", "disable_shuffling"),
    **_noop("evaluation reports the loss only", "compute_accuracy", "include_effective_tokens_per_second"),
    **_refuse("SwanLab is not supported (tiermem runs offline); report_to: tensorboard writes event files to "
              "output_dir", "use_swanlab"),
    **_noop("used only with use_swanlab", "swanlab_project", "swanlab_workspace", "swanlab_run_name", "swanlab_mode",
            "swanlab_api_key", "swanlab_logdir", "swanlab_lark_webhook_url", "swanlab_lark_secret"),
    **_refuse("Megatron-Core training is not supported", "use_mca"),
    # -- LLaMA-Factory training arguments (Ray, fp8) ----------------------------------------------------
    **_noop(ONE_PROCESS, "ray_run_name", "ray_storage_path", "ray_storage_filesystem", "ray_num_workers",
            "resources_per_worker", "placement_strategy", "ray_init_kwargs", "master_addr", "master_port"),
    **_refuse("fp8 training is not supported: use bf16: true or bf16: false (fp32)", "fp8"),
    **_noop("used only with fp8 (not supported)", "fp8_backend", "fp8_enable_fsdp_float8_all_gather"),
    # -- Hugging Face TrainingArguments -----------------------------------------------------------------
    **_refuse("tiermem replaces DeepSpeed's offload with its own tiered store; remove the key", "deepspeed",
              ok=("",)),
    **_refuse("tiermem does not shard with FSDP: its ranks share one store per host (README: Several GPUs); remove "
              "the key", "fsdp", ok=("", False, [])),
    **_noop("the ranks' timeout is tiermem_dist_timeout (seconds)", "ddp_timeout"),
    **_noop(ONE_PROCESS, "fsdp_config", "fsdp_min_num_params", "fsdp_transformer_layer_cls_to_wrap", "tp_size",
            "ddp_backend", "ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers",
            "ddp_static_graph", "local_rank", "log_on_each_node", "log_level_replica", "save_on_each_node",
            "accelerator_config", "parallelism_config", "dispatch_batches", "split_batches", "tpu_num_cores",
            "tpu_metrics_debug", "mp_parameters", "average_tokens_across_devices", "eval_use_gather_object",
            "ray_scope"),
    **_noop(DATALOADER, "dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers",
            "dataloader_prefetch_factor", "dataloader_multiprocessing_context", "dataloader_in_order",
            "remove_unused_columns", "label_names", "length_column_name"),
    **_refuse("the last step of an epoch always takes the micro-batches that are left", "dataloader_drop_last"),
    **_refuse("fp16 training is not supported; use bf16: true or bf16: false (fp32)", "fp16", "fp16_full_eval"),
    **_noop("used only with fp16 (not supported)", "fp16_opt_level", "fp16_backend", "half_precision_backend"),
    **_noop("evaluation uses the training's compute copy of the weights (bf16 with bf16: true)", "bf16_full_eval"),
    **_refuse(OPTIMIZER, "optim", ok=("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_apex_fused",
                                      "adamw_torch_xla", "adamw_torch_npu_fused")),
    **_refuse(OPTIMIZER, "adafactor"),
    **_refuse(OPTIMIZER + " (no optimizer arguments)", "optim_args", "optim_target_modules", ok=("", [])),
    **_refuse("scheduler arguments are not supported (the schedules take none)", "lr_scheduler_kwargs", ok=({},)),
    **_refuse("label smoothing is not supported: the loss is plain cross-entropy", "label_smoothing_factor",
              ok=(0, 0.0)),
    **_refuse("NEFTune noise is not supported", "neftune_noise_alpha", ok=(0, 0.0)),
    **_refuse("the rows are shuffled uniformly (seeded by seed); grouping by length is not supported",
              "group_by_length"),
    **_refuse("the rows are shuffled uniformly (seeded by seed)", "train_sampling_strategy", ok=("random",)),
    **_noop("the data order follows seed", "data_seed"),
    **_noop("a step that does not fit the GPU runs as several layer-major passes instead",
            "auto_find_batch_size"),
    **_noop("tiermem frees GPU memory layer by layer", "torch_empty_cache_steps"),
    **_noop(LOGGING, "log_level", "disable_tqdm", "logging_nan_inf_filter", "include_tokens_per_second",
            "include_num_input_tokens_seen", "skip_memory_metrics", "debug", "run_name", "project",
            "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id"),
    **_noop("tiermem logs every logging_steps steps", "logging_strategy", ok=("steps",)),
    **_noop("evaluation gives the mean loss over every trained token", "prediction_loss_only",
            "eval_accumulation_steps", "eval_do_concat_batches", "include_for_metrics", "include_inputs_for_metrics",
            "batch_eval_metrics", "use_legacy_prediction_loop", "past_index", "jit_mode_eval"),
    **_noop("evaluation runs at eval_strategy's steps and at the end", "eval_on_start", "eval_delay",
            ok=(False, 0, 0.0)),
    **_refuse("prediction is not supported: tiermem-train trains (and evaluates)", "do_predict"),
    **_refuse(HUB, "push_to_hub"),
    **_noop(HUB, "hub_token", "hub_private_repo", "hub_model_id", "hub_strategy", "hub_always_push",
            "hub_revision", "push_to_hub_model_id", "push_to_hub_organization", "push_to_hub_token"),
    **_refuse("checkpoints and the model are always written as safetensors", "save_safetensors", ok=(True,)),
    **_noop("a checkpoint is written while training goes on, layer by layer", "enable_jit_checkpoint",
            "restore_callback_states_from_checkpoint"),
    **_refuse("loading the best model at the end is not supported: the exported model is the last step's "
              "(each checkpoint-N holds its own)", "load_best_model_at_end"),
    **_refuse("best_metric follows the evaluation loss: greater_is_better must be false", "greater_is_better"),
    **_refuse("a resume always skips the data the run has seen (the step is the whole data position)",
              "ignore_data_skip"),
    **_noop("tiermem's CPU runs are deterministic; on CUDA the kernels are torch's defaults", "full_determinism"),
    **_noop("torch extensions for Intel CPUs are not used", "use_ipex"),
    **_refuse("tiermem chooses the device from tiermem.tiers.gpu.device; set it to cpu to train on the CPU",
              "use_cpu", "no_cuda", "use_mps_device"),
    **_noop("dynamo settings: tiermem does not compile the model", "torchdynamo"),
    **_refuse("per_gpu_* was renamed: use per_device_train_batch_size / per_device_eval_batch_size",
              "per_gpu_train_batch_size", "per_gpu_eval_batch_size", ok=()),
    **_refuse("evaluation_strategy was renamed: use eval_strategy", "evaluation_strategy", ok=()),
}

# values of taken keys that LLaMA-Factory knows and tiermem refuses, with why (the rest are type errors)
REFUSED_VALUES: dict[str, tuple[tuple, str]] = {
    "stage": (("pt", "sft", "dpo"), "tiermem trains stage pt (pre-training), sft or dpo (preference pairs: DPO, IPO, "
                                    "ORPO, SimPO); reward modelling, PPO and KTO are not supported"),
    "finetuning_type": (("full",), "tiermem does full-parameter training only (finetuning_type: full); LoRA, "
                                   "freeze and OFT are not supported"),
    "lr_scheduler_type": (("linear", "cosine", "constant", "constant_with_warmup"),
                          "the schedules are linear, cosine, constant and constant_with_warmup"),
    "save_strategy": (("no", "steps", "epoch"), "save_strategy: best is not supported (no best-model tracking); "
                                                "use no, steps or epoch"),
}


def describe(key: str) -> str:
    """One line about ``key``'s answer, for ``tiermem-train --keys``."""
    a = KEYS[key]
    return f"{'no effect' if a.kind == 'noop' else 'refused'}: {a.reason}"
