"""Tiny random Hugging Face models of each supported family, saved as safetensors directories, and a
tokenized dataset to train them on. Shared by the trainer's tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)


def hf_config(family: str, **extra):
    import transformers as T

    if family == "llama":
        return T.LlamaConfig(**{**COMMON, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                           "high_freq_factor": 4.0,
                                                           "original_max_position_embeddings": 16},
                                "pad_token_id": 0, **extra})
    if family == "mistral":
        return T.MistralConfig(**{**COMMON, "sliding_window": None, **extra})
    if family == "qwen2":
        return T.Qwen2Config(**{**COMMON, **extra})
    if family == "qwen3":
        return T.Qwen3Config(**{**COMMON, "head_dim": 12, "tie_word_embeddings": True, **extra})
    if family == "qwen3_moe":  # layer 1 dense (mlp_only_layers), renormalised top-2 of 4 experts
        return T.Qwen3MoeConfig(**{**COMMON, "head_dim": 12, "num_experts": 4, "num_experts_per_tok": 2,
                                   "moe_intermediate_size": 24, "norm_topk_prob": True, "mlp_only_layers": [1],
                                   "output_router_logits": True, "router_aux_loss_coef": 0.05, **extra})
    if family == "gemma2":  # (generic path) alternating sliding-window layers shorter than the rows, soft-capping
        return T.Gemma2Config(**{**COMMON, "head_dim": 8, "sliding_window": 6, "query_pre_attn_scalar": 8,
                                 "final_logit_softcapping": 5.0, "attn_logit_softcapping": 20.0, **extra})
    if family == "phi3":  # (generic path) fused qkv and gate-up projections
        return T.Phi3Config(**{**COMMON, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **extra})
    if family == "gemma3":  # (generic path)
        return T.Gemma3TextConfig(**{**COMMON, "head_dim": 8, "sliding_window": 6, "query_pre_attn_scalar": 8, **extra})
    if family == "gpt2":  # (generic path) learned positions, LayerNorm with biases, Conv1D, tied head
        return T.GPT2Config(**{"vocab_size": 96, "n_embd": 32, "n_layer": 3, "n_head": 4, "n_positions": 128,
                               "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, **extra})
    if family == "mixtral":
        return T.MixtralConfig(**{**COMMON, "intermediate_size": 24, "num_local_experts": 4, "num_experts_per_tok": 2,
                                  "sliding_window": None, "output_router_logits": True, "router_aux_loss_coef": 0.05,
                                  **extra})
    if family == "gpt_oss":  # sinks; layers 0 and 2 slide over 6 tokens (shorter than the rows); a yarn RoPE that
        # bends the frequencies at these lengths; top-2 of 4 experts whose SwiGLU limit clamps often
        return T.GptOssConfig(**{**COMMON, "intermediate_size": 16, "head_dim": 8, "sliding_window": 6,
                                 "num_local_experts": 4, "num_experts_per_tok": 2, "swiglu_limit": 0.1,
                                 "output_router_logits": True, "router_aux_loss_coef": 0.05,
                                 "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                     "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                                     "original_max_position_embeddings": 32}, **extra})
    # (generic path, checkpoints as transformers saves them: one tensor per expert on disk, fused in memory)
    two = {**COMMON, "num_hidden_layers": 2}
    linear = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
              "linear_value_head_dim": 8, "linear_conv_kernel_dim": 3}
    if family == "qwen3_next":  # gated delta-net then full attention; shared and routed experts, aux loss
        return T.Qwen3NextConfig(**{**two, "head_dim": 8, "layer_types": ["linear_attention", "full_attention"],
                                    **linear, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                    "shared_expert_intermediate_size": 16, "output_router_logits": True,
                                    "router_aux_loss_coef": 0.05, **extra})
    if family == "qwen3_5":  # (text) gated delta-net then full attention, dense
        return T.Qwen3_5TextConfig(**{**two, "head_dim": 8, "layer_types": ["linear_attention", "full_attention"],
                                      **linear, **extra})
    mla = {"num_key_value_heads": 4, "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8,
           "v_head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
           "first_k_dense_replace": 1}
    if family == "deepseek_v3":  # multi-head latent attention (q LoRA), grouped top-k with a score bias
        return T.DeepseekV3Config(**{**two, **mla, "q_lora_rank": 24, "n_shared_experts": 1, "n_group": 2,
                                     "topk_group": 1, **extra})
    if family == "deepseek_v2":  # V2-Lite's layout: no q LoRA, two shared experts, greedy top-k
        return T.DeepseekV2Config(**{**two, **mla, "q_lora_rank": None, "n_shared_experts": 2, **extra})
    if family == "glm4_moe":  # partial RoPE, q/k norms, a dense first layer, one shared expert, a score bias
        return T.Glm4MoeConfig(**{**two, "head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
                                  "moe_intermediate_size": 16, "first_k_dense_replace": 1, "use_qk_norm": True,
                                  "n_group": 1, "topk_group": 1, **extra})
    if family == "llama4":  # (text) chunked attention and no RoPE on the last layer; a dense then a MoE layer
        return T.Llama4TextConfig(**{**two, "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 1,
                                     "intermediate_size": 16, "intermediate_size_mlp": 64, "moe_layers": [1],
                                     "attention_chunk_size": 8, "no_rope_layer_interval": 2, **extra})
    raise ValueError(family)


def randomize(model) -> None:
    """Non-trivial norms, biases and attention sinks, so that their gradients matter; routers' score biases, so
    that routing turns on them."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.8, 1.2)
            elif name.endswith("bias"):
                p.normal_(0, 0.05)
            elif name.endswith("sinks"):
                p.normal_(0, 1.0)
            elif name.endswith("A_log"):  # (a gated delta-net's decay rate: transformers draws it up to 16 a token,
                p.uniform_(-2.0, 0.0)     # whose cumulative sums leave fp32 a few digits; a trained model's is less)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # (DeepSeek-V3, GLM-4.5: steers the top-k)
                b.normal_(0, 0.5)


def save_tiny_model(family: str, path: Path, seed: int = 0, **extra) -> Path:
    import transformers as T

    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(hf_config(family, **extra), dtype=torch.float32)
    randomize(model)
    model.save_pretrained(path, safe_serialization=True)
    return path


def write_tokenized_dataset(data_dir: Path, n_rows: int = 14, vocab: int = 96, seed: int = 0,
                            name: str = "toy", low: int = 1) -> str:
    """Rows of 5..20 tokens (ids from ``low``); most with the first few labels masked (like a prompt),
    some without labels."""
    rng = random.Random(seed)
    data_dir.mkdir(parents=True, exist_ok=True)
    with (data_dir / f"{name}.jsonl").open("w") as f:
        for i in range(n_rows):
            ids = [rng.randrange(low, vocab) for _ in range(rng.randrange(5, 21))]
            row = {"input_ids": ids}
            if i % 3:
                cut = rng.randrange(1, len(ids) - 1)
                row["labels"] = [-100] * cut + ids[cut:]
            f.write(json.dumps(row) + "\n")
    info = data_dir / "dataset_info.json"
    entries = json.loads(info.read_text()) if info.is_file() else {}
    entries[name] = {"file_name": f"{name}.jsonl", "formatting": "tokenized"}
    info.write_text(json.dumps(entries))
    return name


def tiny_run(tmp_path: Path, family: str = "llama") -> dict:
    """A tiny model and tokenized dataset under ``tmp_path``, and the training keys of a 6-step run on them
    (grad accumulation, warmup + cosine, weight decay; no output_dir, no tiermem)."""
    model_dir = save_tiny_model(family, tmp_path / "model")
    data_dir = tmp_path / "data"
    name = write_tokenized_dataset(data_dir, n_rows=16)
    return {"model_name_or_path": str(model_dir), "dataset": name, "dataset_dir": str(data_dir), "max_steps": 6,
            "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "learning_rate": 1e-2,
            "lr_scheduler_type": "cosine", "warmup_steps": 1, "weight_decay": 0.1, "logging_steps": 1}
