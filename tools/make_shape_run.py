"""Make what a `tiermem-train` run on a model *shape* needs: a directory with only config.json (the run
starts from `tiermem_init: random`), a dataset of random token rows, and the training YAML.

    python tools/make_shape_run.py --shape 8b --dir /tmp/run8b --rows 32 --accum 32 --steps 6 \
        [--nvme /tmp/nvme] [--set key=value ...]
    tiermem-train /tmp/run8b/train.yaml          # or: tiermem plan /tmp/run8b/train.yaml

Shapes: 3b and 8b (Llama 3.2-3B-like untied, Llama-3.1-8B), 14b (Qwen2.5-14B: hidden 5120, 48 layers,
intermediate 13824, 40 heads, 8 KV heads, vocab 152064, untied), qwen3-8b (Qwen3-8B: hidden 4096, 36 layers,
intermediate 12288, 32 heads, 8 KV heads, head_dim 128, q/k norms, vocab 151936, 40,960 positions, untied),
qwen3-30b-a3b (Qwen3-30B-A3B: hidden 2048,
48 layers of 128 experts of intermediate 768, top-8 renormalised, 32 heads, 4 KV heads, head_dim 128, vocab
151936, the router's load-balancing loss on; 30.5 B params, 3.4 B active), qwen3-moe-24l (the same with 24
layers: 15.6 B params) and gpt-oss-120b (hidden 2880, 36 layers of 128 experts of intermediate 2880, top-4, 64
heads, 8 KV heads, head_dim 64, attention sinks, sliding windows of 128 tokens on alternate layers, yarn RoPE,
vocab 201088, untied: 116.8 B params, 5.7 B active with the embedding and head; each layer 3.2 B), and for the
generic path qwen3-next-80b-a3b (hidden 2048, 48 layers: three of gated delta-net linear attention then one of
full attention, 512 experts of intermediate 512 top-10 and a shared expert, vocab 151936: 81.3 B params, each layer
1.7 B) and deepseek-v3 (hidden 7168, multi-head latent attention of 128 heads, 3 dense layers then 58 of 256 experts
of intermediate 2048 top-8 in 8 groups and a shared one, vocab 129280: 671 B params, a sparse layer 11.3 B);
`--layers N` changes a shape's depth (DeepSeek-V3 keeps at most N - 1 dense layers first), `--experts N` the
routed experts of a mixture of experts. Rows are `--seq` tokens each (4096); a
step takes `--accum` micro-batches of `--batch` rows.

`--format sharegpt` makes chat rows instead (stage sft, `--template`, default qwen): a tokenizer that needs no
download (the quickstart's byte-level BPE, models/tiny-llama, with Qwen's chat tokens added; eos <|im_end|>) and
sharegpt conversations of a short question and an answer of random words, each at least `--seq` tokens after the
chat template, so that cutoff_len cuts each to exactly `--seq` tokens (checked with the trainer's own encoder):

    python tools/make_shape_run.py --shape qwen3-8b --dir /tmp/long --format sharegpt --seq 204800 --accum 1 \
        --steps 3

`--stage dpo` makes preference pairs instead (tokenized, ranking: true): each a random prompt of a quarter of
`--seq` tokens and two different random responses filling the rest, `--batch` pairs a micro-batch (2 x `--batch`
rows of `--seq` tokens); the YAML trains stage dpo (`--set pref_loss=ipo` ...), its reference the starting weights
(computed once before the first step):

    python tools/make_shape_run.py --shape 8b --dir /tmp/dpo8b --stage dpo --seq 2048 --batch 1 --accum 8 \
        --steps 5 --nvme /tmp/nvme
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import yaml

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 131072,
         "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu",
         "initializer_range": 0.02, "vocab_size": 128256, "num_key_value_heads": 8}
SHAPES = {
    "3b": dict(LLAMA, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24),
    "8b": dict(LLAMA, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
    "14b": dict(LLAMA, architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=5120,
                intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40, vocab_size=152064,
                rope_theta=1000000.0, rms_norm_eps=1e-6),
    "qwen3-30b-a3b": dict(LLAMA, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                          output_router_logits=True, router_aux_loss_coef=0.001),
}
SHAPES["qwen3-8b"] = {  # (Qwen/Qwen3-8B's config.json: LLaMA-Factory's qwen3_full_sft*.yaml examples)
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000, "rope_scaling": None,
    "rms_norm_eps": 1e-6, "sliding_window": None, "use_sliding_window": False, "max_window_layers": 36,
    "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False, "hidden_act": "silu",
    "initializer_range": 0.02, "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645}
SHAPES["qwen3-moe-24l"] = dict(SHAPES["qwen3-30b-a3b"], num_hidden_layers=24)
SHAPES["gpt-oss-120b"] = {  # (openai/gpt-oss-120b's config.json, less its quantization)
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
    "num_hidden_layers": 36, "num_local_experts": 128, "num_experts_per_tok": 4, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088, "max_position_embeddings": 131072,
    "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 18, "rms_norm_eps": 1e-5,
    "rope_theta": 150000, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                           "truncate": False, "original_max_position_embeddings": 4096},
    "attention_bias": True, "attention_dropout": 0.0, "swiglu_limit": 7.0, "tie_word_embeddings": False,
    "hidden_act": "silu", "initializer_range": 0.02, "output_router_logits": False, "router_aux_loss_coef": 0.9}

SHAPES["qwen3-next-80b-a3b"] = {  # (Qwen/Qwen3-Next-80B-A3B's config.json: the generic path)
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
    "intermediate_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_experts": 512, "num_experts_per_tok": 10,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "norm_topk_prob": True, "partial_rotary_factor": 0.25, "rope_theta": 10000000,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 12,
    "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "vocab_size": 151936, "tie_word_embeddings": False,
    "output_router_logits": False, "router_aux_loss_coef": 0.001, "attention_bias": False, "attention_dropout": 0.0,
    "hidden_act": "silu", "initializer_range": 0.02}
SHAPES["deepseek-v3"] = {  # (deepseek-ai/DeepSeek-V3's config.json, less its fp8 quantization: the generic path)
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "vocab_size": 129280, "max_position_embeddings": 163840,
    "rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                                          "mscale": 1.0, "mscale_all_dim": 1.0,
                                          "original_max_position_embeddings": 4096},
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0,
    "hidden_act": "silu", "initializer_range": 0.02, "bos_token_id": 0, "eos_token_id": 1}


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # (the trainer's encoder checks the chat rows)
QWEN_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # (Qwen's pad / eos, its chat turns)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--dir", required=True, help="where the model, data and train.yaml go")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the shape's)")
    ap.add_argument("--experts", type=int, help="routed experts of a mixture of experts (default: the shape's)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--accum", type=int, default=32)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--nvme", help="tiers.nvme.path (the only tiermem setting)")
    ap.add_argument("--stage", choices=["pt", "dpo"], default="pt", help="pt: token rows; dpo: preference pairs")
    ap.add_argument("--format", choices=["tokenized", "sharegpt"], default="tokenized",
                    help="tokenized: token rows (--stage); sharegpt: chat rows of text and a tokenizer (stage sft)")
    ap.add_argument("--template", default="qwen", help="--format sharegpt: the chat template")
    ap.add_argument("--set", nargs="*", default=[], help="more key=value for the YAML")
    return ap.parse_args(argv)


def shape_of(args: argparse.Namespace) -> dict:
    """The shape's config.json, cut to ``--layers`` and ``--experts``."""
    shape = dict(SHAPES[args.shape])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
        if "layer_types" in shape:  # (gpt-oss's, Qwen3-Next's: the pattern kept, cut to the layers)
            shape["layer_types"] = shape["layer_types"][:args.layers]
        if "first_k_dense_replace" in shape:  # (DeepSeek-V3: its dense layers first, a mixture of experts after)
            shape["first_k_dense_replace"] = min(shape["first_k_dense_replace"], args.layers - 1)
        if "max_window_layers" in shape:  # (Qwen3's)
            shape["max_window_layers"] = args.layers
    if args.experts:
        key = next(k for k in ("num_experts", "n_routed_experts", "num_local_experts") if k in shape)
        shape[key] = args.experts
    return shape


def write_token_rows(d: Path, shape: dict, args: argparse.Namespace) -> None:
    """``--batch`` x ``--accum`` x ``--steps`` rows of ``--seq`` random tokens (``--stage dpo``: pairs) as a
    tokenized dataset, ``tokens``."""
    rng = random.Random(0)
    rows = args.batch * args.accum * args.steps
    draw = lambda n: [rng.randrange(shape["vocab_size"]) for _ in range(n)]  # noqa: E731
    with (d / "data" / "tokens.jsonl").open("w") as f:
        for _ in range(rows):
            if args.stage == "dpo":  # (a pair: a prompt, two responses)
                prompt = draw(args.seq // 4)
                pair = {}
                for which in ("chosen", "rejected"):
                    response = draw(args.seq - len(prompt))
                    pair[f"{which}_input_ids"] = prompt + response
                    pair[f"{which}_labels"] = [-100] * len(prompt) + response
                f.write(json.dumps(pair) + "\n")
            else:
                f.write(json.dumps({"input_ids": draw(args.seq)}) + "\n")
    (d / "data" / "dataset_info.json").write_text(json.dumps(
        {"tokens": {"file_name": "tokens.jsonl", "formatting": "tokenized", "ranking": args.stage == "dpo"}}))


def write_tokenizer(model: Path, shape: dict) -> None:
    """A tokenizer that needs no download: the quickstart's byte-level BPE (models/tiny-llama) with Qwen's chat
    tokens added, eos <|im_end|> and pad <|endoftext|> as Qwen3's; config.json's bos and eos ids set to its."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(ROOT / "models" / "tiny-llama" / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_TOKENS])
    if tok.get_vocab_size() > shape["vocab_size"]:
        raise SystemExit(f"the tokenizer's {tok.get_vocab_size()} tokens do not fit vocab_size {shape['vocab_size']}")
    tok.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "add_bos_token": False, "model_max_length": 1 << 20}, indent=1))
    shape["bos_token_id"], shape["eos_token_id"] = (tok.token_to_id(t) for t in QWEN_TOKENS[::2])


def write_chat_rows(d: Path, args: argparse.Namespace) -> None:
    """``--batch`` x ``--accum`` x ``--steps`` sharegpt conversations (``chat``): a short question, an answer of
    random words of the demo text; each at least ``--seq`` tokens after ``--template`` (every word is a token or
    more), checked with the trainer's own encoder: cutoff_len ``--seq`` cuts each to exactly ``--seq`` tokens."""
    from trainer.data.sft import encode_example
    from trainer.data.templates import get_template
    from trainer.data.tokenizer import load_tokenizer

    tok, template = load_tokenizer(d / "model"), get_template(args.template)
    rng = random.Random(0)
    words = (ROOT / "data" / "demo_pt.txt").read_text().split()
    rows = []
    for i in range(args.batch * args.accum * args.steps):
        question = f"Row {i}: go on with this text."
        answer = " ".join(rng.choices(words, k=args.seq))
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        ids, _ = encode_example(template, tok, messages, "", args.seq)
        if len(ids) != args.seq:
            raise SystemExit(f"chat row {i} is {len(ids)} tokens after the template, not {args.seq}")
        rows.append({"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]})
    (d / "data" / "chat.json").write_text(json.dumps(rows))
    (d / "data" / "dataset_info.json").write_text(json.dumps(
        {"chat": {"file_name": "chat.json", "formatting": "sharegpt"}}))


def write_run(d: Path, shape: dict, args: argparse.Namespace) -> Path:
    """The model directory (config.json ``shape``; a tokenizer with ``--format sharegpt``), the dataset and
    train.yaml under ``d``; train.yaml's path."""
    (d / "model").mkdir(parents=True, exist_ok=True)
    (d / "data").mkdir(exist_ok=True)
    chat = args.format == "sharegpt"
    if chat:
        write_tokenizer(d / "model", shape)
    (d / "model" / "config.json").write_text(json.dumps(shape))
    if chat:
        write_chat_rows(d, args)
    else:
        write_token_rows(d, shape, args)
    cfg = {"model_name_or_path": str(d / "model"), "tiermem_init": "random",
           "stage": "sft" if chat else args.stage, "dataset": "chat" if chat else "tokens",
           **({"template": args.template} if chat else {}),
           "dataset_dir": str(d / "data"), "cutoff_len": args.seq, "output_dir": str(d / "out"),
           "overwrite_output_dir": True, "per_device_train_batch_size": args.batch,
           "gradient_accumulation_steps": args.accum, "max_steps": args.steps, "learning_rate": 1e-5,
           "bf16": True, "logging_steps": 1, "report_to": "none"}
    if args.nvme:
        cfg["tiermem"] = {"tiers": {"nvme": {"path": args.nvme}}}
    for kv in args.set:
        k, v = kv.split("=", 1)
        cfg[k] = yaml.safe_load(v)
    (d / "train.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return d / "train.yaml"


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.format == "sharegpt" and args.stage != "pt":
        raise SystemExit("--format sharegpt makes rows of stage sft (--stage is for token rows)")
    print(write_run(Path(args.dir), shape_of(args), args))


if __name__ == "__main__":
    main()
