"""Benchmark: streamed training (tiermem, placed by the planner) against plain PyTorch on the GPU.

    python tools/bench_train.py [--shape 3b] [--batch 4] [--accum 1] [--seq 4096] [--steps 5] [--layers N]
                                [--placement auto|dram] [--probe FILE] [--passes N] [--json FILE]

Both train a random-init Llama shape (3b: hidden 3072, 28 layers, intermediate 8192, 24 heads, 8 KV heads,
vocab 128256, untied: 3.6 B params; 8b: Llama-3.1-8B's) in bf16 on random tokens, in the same process:

- plain PyTorch: the model in HBM with fp32 weights, bf16 autocast, activation checkpointing
  (transformers' gradient checkpointing), fused AdamW on the GPU; ``accum`` micro-batches of ``batch``
  rows a step;
- tiermem: the trainer's executor over a store placed by the planner (``--placement auto``, as
  ``tiermem-train`` places it: its predicted step is printed beside the measured one), or with every kind
  in the DRAM arena (``--placement dram``); the same micro-batches a step.

Prints step time, tokens/s, TFLOP/s (6 N tokens), peak HBM and tiermem's step split (compute / GPU
waiting on transfers / GPU waiting on the optimizer), and the ratio tiermem / plain. The first
``--warmup`` steps of each are not timed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

SHAPE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 3072,
         "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8,
         "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
         "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192},
         "tie_word_embeddings": False, "hidden_act": "silu", "initializer_range": 0.02}
SHAPES = {"3b": SHAPE,
          "8b": dict(SHAPE, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32)}


def batches(args, vocab: int, step: int):
    g = torch.Generator().manual_seed(step)
    out = []
    for _ in range(args.accum):
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
        out.append((ids.pin_memory(), ids.clone().pin_memory(), ids.numel()))
    return out


def run_plain(args, raw: dict) -> dict:
    import transformers as T

    cfg = T.LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = T.LlamaForCausalLM(cfg).float()
    model.config.use_cache = False
    model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for ids, labels, _ in batches(args, raw["vocab_size"], step):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids.cuda(non_blocking=True), labels=labels.cuda(non_blocking=True)).loss
            (loss / args.accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated()
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    return {"step_s": statistics.median(times), "times": times, "peak_hbm_gib": peak / 2**30}


def run_tiermem(args, raw: dict, model_dir: Path) -> dict:
    from tiermem.optim import AdamWConfig, StoreAdamW
    from tiermem.store.store import Store
    from trainer import run_plan
    from trainer.executor import Executor
    from trainer.model.config import load_model_config
    from trainer.model.weights import all_weights, group_order
    from trainer.state import state_specs, store_config
    from trainer.weights_io import init_weights

    mcfg = load_model_config(model_dir)
    data = {"tiers": {"gpu": {"slots": args.slots}}, "optimizer": {"gpu_share": args.gpu_share}}
    if args.placement == "dram":
        data["placement"] = {k: "dram" for k in ("param", "grad", "master", "exp_avg", "exp_avg_sq")}
    scfg = store_config(data)
    plan, t_plan = None, 0.0
    if args.placement == "auto":
        t0 = time.perf_counter()
        machine = run_plan.machine_for(scfg, torch.device("cuda"), args.probe)
        plan = run_plan.make(mcfg, torch.bfloat16, scfg, run_plan.Shape(args.batch, args.seq, args.accum), machine,
                             torch.device("cuda"), args.loss_chunk)
        t_plan = time.perf_counter() - t0
        for line in run_plan.lines(plan):
            print(line, flush=True)
    t0 = time.perf_counter()
    store = Store.open(scfg, state_specs(mcfg, torch.bfloat16), streamed_kinds=("param",), plan=plan)
    t_open = time.perf_counter() - t0
    init_weights(store, mcfg, {"param": torch.bfloat16, "master": torch.float32}, 0, torch.device("cuda"))
    t_init = time.perf_counter() - t0 - t_open
    on_gpu = plan.gpu_updates if plan is not None and args.gpu_share == "auto" else None
    opt = StoreAdamW(store, group_order(mcfg), {w.name: w.decay for w in all_weights(mcfg)}, AdamWConfig(),
                     has_master=True, on_gpu=on_gpu)
    budget = plan.activation_budget if plan is not None else None
    if args.passes > 1:  # --passes N: an activation budget that holds ceil(accum / N) micro-batches' boundaries
        per_mb = (mcfg.num_layers + 1) * mcfg.hidden_size * 2 * args.batch * args.seq
        budget = per_mb * -(-args.accum // args.passes)
    ex = Executor(store, mcfg, torch.bfloat16, opt, 1.0, args.loss_chunk, budget)
    torch.cuda.reset_peak_memory_stats()
    starts, results, opt_s = [], [], []
    total = args.warmup + args.steps
    for step in range(total):
        starts.append(time.perf_counter())
        results.append(ex.step(batches(args, raw["vocab_size"], step), step, 1e-5))
        if step > 0:
            opt_s.append(opt.last_step_seconds)
    opt.wait()  # the last update belongs to the last timed step
    starts.append(time.perf_counter())
    times = [starts[i + 1] - starts[i] for i in range(args.warmup, total)]
    splits = results[args.warmup:]
    peak = torch.cuda.max_memory_allocated()
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    stats = store.stats()
    ex.close()
    opt.close()
    store.close()
    n = len(splits)
    return {"step_s": statistics.median(times), "times": times, "peak_hbm_gib": peak / 2**30,
            "compute_s": sum(s.compute for s in splits) / n,
            "wait_transfer_s": sum(s.wait_transfer for s in splits) / n,
            "wait_optimizer_s": sum(s.wait_optimizer for s in splits) / n,
            "waits_by_phase": {ph: {k: sum(s.waits_by_phase.get(ph, {}).get(k, 0.0) for s in splits) / n
                                    for k in ("transfer", "optimizer")} for ph in ("forward", "loss", "backward")},
            "optimizer_busy_s": statistics.median(opt_s or [opt.last_step_seconds]),
            "optimizer_split": opt.last_split, "optimizer_threads": opt.threads, "gpu_share": opt.gpu_share,
            "store_open_s": t_open, "init_s": t_init, "links": stats.get("links"), "passes": ex.last_passes,
            "losses": [r.loss for r in results], "grad_norms": [r.grad_norm for r in results],
            "gradient_partials_wait_s": stats.get("waits_s", {}).get("gradient_partials", 0.0) / total,
            "plan_s": t_plan, "alloc_retries": retries,
            "predicted_s": plan.prediction.step if plan is not None else None,
            "predicted": plan.prediction.to_json() if plan is not None else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="3b")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the shape's)")
    ap.add_argument("--placement", choices=["auto", "dram"], default="auto",
                    help="tiermem: the planner's placement (auto, as tiermem-train) or every kind in DRAM")
    ap.add_argument("--probe", help="a `tiermem probe --save` file for the planner (default: a quick probe)")
    ap.add_argument("--slots", type=int, default=3)
    ap.add_argument("--loss-chunk", type=int, default=4096)
    ap.add_argument("--gpu-share", default="auto", help="tiermem optimizer.gpu_share (auto, or 0..1)")
    ap.add_argument("--passes", type=int, default=0,
                    help="tiermem: run each step as this many layer-major passes (partial gradients in DRAM between)")
    ap.add_argument("--only", choices=["plain", "tiermem"])
    ap.add_argument("--json")
    ap.add_argument("--alloc-conf", default="expandable_segments:True",
                    help="PYTORCH_CUDA_ALLOC_CONF for both runs (tiermem-train's default; '' for PyTorch's)")
    args = ap.parse_args()
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = args.alloc_conf
    if not torch.cuda.is_available():
        raise SystemExit("bench_train needs a CUDA GPU")
    raw = dict(SHAPES[args.shape])
    if args.layers:
        raw["num_hidden_layers"] = args.layers
    d = Path(tempfile.mkdtemp(prefix="tiermem-bench-"))
    (d / "config.json").write_text(json.dumps(raw))
    from trainer.model.config import model_config_from_dict

    n_params = model_config_from_dict(raw).num_params()
    tokens = args.batch * args.accum * args.seq
    res = {"tokens_per_step": tokens, "params": n_params}
    if args.only != "tiermem":
        res["plain"] = run_plain(args, raw)
    if args.only != "plain":
        res["tiermem"] = run_tiermem(args, raw, d)
    for k in ("plain", "tiermem"):
        if k in res:
            r = res[k]
            r["tokens_per_s"] = tokens / r["step_s"]
            r["tflops"] = 6 * n_params * tokens / r["step_s"] / 1e12
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    print(f"Llama-{args.shape.upper()} shape ({n_params / 1e9:.2f} B params, {raw['num_hidden_layers']} layers), bf16, "
          f"{args.accum}x{args.batch}x{args.seq} = {tokens} tokens/step")
    print(f"{'':10} {'s/step':>8} {'tok/s':>9} {'TFLOP/s':>8} {'peak HBM':>9}  split")
    for k in ("plain", "tiermem"):
        if k not in res:
            continue
        r = res[k]
        split = ""
        if k == "tiermem":
            split = (f"compute {r['compute_s']:.3f} + wait transfer {r['wait_transfer_s']:.3f} + wait optimizer "
                     f"{r['wait_optimizer_s']:.3f} (optimizer busy {r['optimizer_busy_s']:.3f} s: "
                     + ", ".join(f"{a} {b:.3f}" for a, b in r["optimizer_split"].items())
                     + f"; {r['optimizer_threads']} threads, gpu_share {r['gpu_share']})")
        print(f"{k:10} {r['step_s']:8.3f} {r['tokens_per_s']:9.0f} {r['tflops']:8.1f} "
              f"{r['peak_hbm_gib']:8.1f}G  {split}")
    if "tiermem" in res:
        t = res["tiermem"]
        print(f"tiermem: allocator retries {t['alloc_retries']} (PYTORCH_CUDA_ALLOC_CONF="
              f"{os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')}); {t['passes']} pass(es) a step; "
              f"trainer thread blocked on partial gradients "
              f"{t['gradient_partials_wait_s']:.3f} s/step (the GPU computes its queue meanwhile); step times "
              f"{' '.join(f'{x:.2f}' for x in t['times'])}; losses {' '.join(f'{x:.4f}' for x in t['losses'])}; "
              f"grad norms {' '.join(f'{x:.4f}' for x in t['grad_norms'])}")
        print("tiermem waits by phase (s/step): " + "; ".join(
            f"{ph} transfer {w['transfer']:.3f} optimizer {w['optimizer']:.3f}"
            for ph, w in res["tiermem"]["waits_by_phase"].items()))
        if t["predicted_s"]:
            print(f"tiermem predicted step {t['predicted_s']:.3f} s (planned in {t['plan_s']:.1f} s): measured / "
                  f"predicted {t['step_s'] / t['predicted_s']:.3f}")
    if "plain" in res and "tiermem" in res:
        t = res["tiermem"]
        print(f"ratio tiermem/plain tokens/s: {t['tokens_per_s'] / res['plain']['tokens_per_s']:.3f}; "
              f"GPU waiting on PCIe: {t['wait_transfer_s'] / t['step_s'] * 100:.1f}% of the step")


if __name__ == "__main__":
    main()
