"""Build the quickstart's tiny Llama: a BPE tokenizer trained on the bundled demo text, and a config.json.

    python tools/make_tiny_model.py [--out models/tiny-llama] [--vocab 512] [--data data/demo_pt.txt]

The quickstart starts it from random weights (``tiermem_init: random``), so no weights are shipped;
the tokenizer and config are small and committed. Rerun this after changing the demo text.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SPECIAL = ["<unk>", "<s>", "</s>"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="models/tiny-llama")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--data", default="data/demo_pt.txt")
    args = ap.parse_args()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([args.data], trainer)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "add_bos_token": False, "model_max_length": 256}, indent=2) + "\n")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": tok.get_vocab_size(),
        "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "initializer_range": 0.02, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {out} (vocab {tok.get_vocab_size()})")


if __name__ == "__main__":
    main()
