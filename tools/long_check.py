"""The Qwen3-8B shape with YaRN RoPE trains one row of 204,800 tokens a step (issue 39): LLaMA-Factory's
qwen3_full_sft_256k.yaml as it is, through `tiermem-train`, on a random-weight model of Qwen/Qwen3-8B's config.json.

    python3 tools/long_check.py [--steps 2] [--dir /tmp/long-check] [--nvme /tmp/nvme]   # the GPU machine
    python3 tools/long_check.py --tiny        # the same code on the CPU: 2 layers of hidden 64, 2,048-token rows

1. Makes the model directory (config.json of the qwen3-8b shape of tools/make_shape_run.py: hidden 4096, 36
   layers, 32 heads, 8 KV heads, head_dim 128, intermediate 12288, vocab 151936, 40,960 positions, untied; a
   tokenizer that needs no download) and chat rows (sharegpt) of at least cutoff_len tokens after the qwen template,
   so that cutoff_len cuts each to exactly that: one row a micro-batch.
2. Runs `tiermem-train` (trainer.cli) on configs/llamafactory/qwen3_full_sft_256k.yaml as it is, with only what must
   change set on the command line: the model (tiermem_init: random: config.json alone), the dataset, output_dir,
   ``--steps`` steps of one row (gradient_accumulation_steps 1), a line every step, no checkpoints, report_to none
   (and the NVMe tier's path, ``--nvme``). ``rope_scaling: yarn`` stays: factor ceil(204800 / 40960) = 5, as
   LLaMA-Factory computes it. ``--tiny`` also sets cutoff_len to 2,048 (the model's 512 positions: factor 4).
3. Prints a table last: each step's seconds, loss, grad norm and TFLOP/s (6 N, and with causal attention, as the
   step lines report); exits 1, saying why, when the run failed, a loss or grad norm is not finite, a step did not
   take one row of cutoff_len tokens, or the exported config.json does not carry the yarn scaling.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import make_shape_run  # noqa: E402

EXAMPLE = make_shape_run.ROOT / "configs" / "llamafactory" / "qwen3_full_sft_256k.yaml"
# --tiny: the Qwen3 shape at CPU size; rows of TINY_SEQ tokens over its 512 positions keep yarn's factor > 1 (4)
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "max_window_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1024,
        "max_position_embeddings": 512}
TINY_SEQ = 2048


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the CPU stand-in: 2 layers of hidden 64, 2,048-token rows")
    ap.add_argument("--steps", type=int, default=2, help="steps of one row (max_steps)")
    ap.add_argument("--dir", default="/tmp/long-check", help="where the model, the data and the run's output go")
    ap.add_argument("--nvme", help="tiermem.tiers.nvme.path (room for what HBM and DRAM do not hold)")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the shape's 36)")
    return ap.parse_args(argv)


def make(args: argparse.Namespace, seq: int) -> Path:
    """The model directory and the chat rows under ``--dir`` (tools/make_shape_run.py's qwen3-8b shape, sharegpt
    rows of exactly ``seq`` tokens once cut); the dataset's directory."""
    d = Path(args.dir)
    made = make_shape_run.parse(["--shape", "qwen3-8b", "--dir", str(d), "--format", "sharegpt", "--template", "qwen",
                                 "--seq", str(seq), "--accum", "1", "--steps", str(args.steps)]
                                + (["--layers", str(args.layers)] if args.layers else []))
    shape = make_shape_run.shape_of(made)
    if args.tiny:
        shape.update(TINY, num_hidden_layers=args.layers or TINY["num_hidden_layers"])
    make_shape_run.write_run(d, shape, made)
    return d / "data"


def overrides(args: argparse.Namespace, seq: int) -> list[str]:
    """What must change in the example for this run, as `tiermem-train` takes it on the command line."""
    d = Path(args.dir)
    out = [f"model_name_or_path={d / 'model'}", "tiermem_init=random", "dataset=chat", f"dataset_dir={d / 'data'}",
           f"output_dir={d / 'out'}", f"max_steps={args.steps}", "logging_steps=1", "save_strategy=no",
           "report_to=none", "gradient_accumulation_steps=1"]
    if args.tiny:
        out.append(f"cutoff_len={seq}")
    if args.nvme:
        out.append(f"tiermem.tiers.nvme.path={args.nvme}")
    return out


def problems(rc: int, log: list[dict], exported: dict | None, seq: int, steps: int, max_pos: int) -> list[str]:
    """Why the run does not show what it should (none: it does)."""
    out = [] if rc == 0 else [f"tiermem-train exited with code {rc}"]
    if len(log) != steps:
        out.append(f"{len(log)} step lines in trainer_log.jsonl, not {steps}")
    before = 0
    for r in log:
        for key in ("loss", "grad_norm"):
            if not math.isfinite(r[key]):
                out.append(f"step {r['current_steps']}: {key} {r[key]} is not finite")
        if r["total_tokens"] - before != seq:
            out.append(f"step {r['current_steps']} took {r['total_tokens'] - before} tokens, not one row of {seq}")
        before = r["total_tokens"]
    factor = math.ceil(seq / max_pos)
    want = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": max_pos}
    if rc == 0 and (exported is None or exported.get("rope_scaling") != want
                    or exported.get("max_position_embeddings") != max_pos * factor):
        got = None if exported is None else (exported.get("rope_scaling"), exported.get("max_position_embeddings"))
        out.append(f"the exported config.json has RoPE {got}, not {want} over {max_pos * factor} positions")
    return out


def table(log: list[dict], seq: int, layers: int, out: Path) -> list[str]:
    """The steps' figures, then what the run's plan placed in each tier and its activations (in DRAM: the boundary
    activations there), and the peak of HBM the process allocated (on CUDA)."""
    lines = [f"Qwen3-8B shape ({layers} layers), yarn, one row of {seq:,} tokens a step "
             "(configs/llamafactory/qwen3_full_sft_256k.yaml)",
             f"{'step':>4} {'seconds':>9} {'predicted':>9} {'loss':>9} {'grad norm':>10} {'TFLOP/s 6N':>11} "
             f"{'with attention':>15}"]
    for r in log:
        lines.append(f"{r['current_steps']:4d} {r['step_seconds']:9.2f} {r.get('predicted_step_seconds', 0):9.2f} "
                     f"{r['loss']:9.4f} {r['grad_norm']:10.4f} {r['tflops']:11.4g} {r['tflops_attention']:15.4g}")
    if (out / "tiermem_plan.json").is_file():
        plan = json.loads((out / "tiermem_plan.json").read_text())
        state = ", ".join(f"{t} {v['need'] / 2**30:.1f} GiB" for t, v in plan["tiers"].items() if v["need"])
        lines.append(f"the run's plan: placed {state}; activations {plan['activation_bytes'] / 2**30:.1f} GiB, "
                     f"{plan['activations']['host_bytes'] / 2**30:.1f} GiB of them in DRAM")
    import torch

    if torch.cuda.is_available():
        lines.append(f"peak HBM allocated by the process: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB of "
                     f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    seq = TINY_SEQ if args.tiny else yaml.safe_load(EXAMPLE.read_text())["cutoff_len"]
    make(args, seq)
    from trainer.cli import main as tiermem_train

    cmd = [str(EXAMPLE), *overrides(args, seq)]
    print("tiermem-train " + " ".join(cmd), flush=True)
    rc = tiermem_train(cmd)
    out = Path(args.dir) / "out"
    log_path, exported_path = out / "trainer_log.jsonl", out / "config.json"
    log = [json.loads(x) for x in log_path.read_text().splitlines() if '"loss"' in x] if log_path.is_file() else []
    exported = json.loads(exported_path.read_text()) if exported_path.is_file() else None
    model = json.loads((Path(args.dir) / "model" / "config.json").read_text())
    failed = problems(rc, log, exported, seq, args.steps, model["max_position_embeddings"])
    print("\n".join(["", *table(log, seq, model["num_hidden_layers"], out)]))
    for why in failed:
        print(f"FAILED: {why}")
    print("FAILED" if failed else "OK: every step one row, its loss and grad norm finite, yarn exported")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
