"""Benchmark: streamed training (tiermem, placed by the planner) against plain PyTorch on the GPU.

    python tools/bench_train.py [--shape 3b|8b|qwen3-moe] [--batch 4] [--accum 1] [--seq 4096] [--steps 5]
                                [--layers N] [--placement auto|dram] [--probe FILE] [--nvme DIR] [--passes N]
                                [--path template|generic|both] [--json FILE]

Both train a random-init Llama shape (3b: hidden 3072, 28 layers, intermediate 8192, 24 heads, 8 KV heads,
vocab 128256, untied: 3.6 B params; 8b: Llama-3.1-8B's) in bf16 on random tokens, in the same process:

- plain PyTorch: the model in HBM with fp32 weights, bf16 autocast, activation checkpointing
  (transformers' gradient checkpointing), fused AdamW on the GPU; ``accum`` micro-batches of ``batch``
  rows a step;
- tiermem: the trainer's executor over a store placed by the planner (``--placement auto``, as
  ``tiermem-train`` places it: its predicted step is printed beside the measured one), or with every kind
  in the DRAM arena (``--placement dram``); the same micro-batches a step.

Prints step time, tokens/s, TFLOP/s (6 N tokens, and with causal attention), peak HBM and tiermem's step
split (compute / GPU waiting on transfers / GPU waiting on the optimizer), and the ratio tiermem / plain. The first
``--warmup`` steps of each are not timed.

``--path generic`` runs tiermem's generic model path (transformers' own modules over the streamed weights)
instead of the hand-written template; ``--path both`` runs the template and then the generic path (no plain
run) and prints the ratio of their step times:

    python tools/bench_train.py --shape 3b --batch 4 --accum 4 --path both

``--shape qwen3-moe`` trains Qwen3-30B-A3B's dimensions (hidden 2048, 32 heads, 4 KV heads, head_dim 128,
128 experts of intermediate 768, top-8 renormalised, vocab 151936, the load-balancing loss on) with 24
layers unless ``--layers`` says otherwise, through tiermem alone (plain PyTorch cannot hold its fp32
training state in HBM); TFLOP/s counts the active parameters (6 N_active tokens). Its state (18 B/param,
261 GiB at 24 layers) outgrows the DRAM arena: give the NVMe tier a directory (``--nvme DIR``):

    python tools/bench_train.py --shape qwen3-moe --batch 4 --accum 4 --nvme /path/on/nvme

Long rows (docs/long-context.md): ``--seq-chunk`` (tiermem_seq_chunk; auto cuts rows over 16,384 tokens into
chunks of at most 8,192) and ``--activations auto|gpu|dram`` (tiermem_activations: the boundary activations on the
GPU or, the first layers' inputs, in the DRAM arena); the JSON has how many lived in DRAM and the step's wait for
them. One row of 524,288 tokens of the 8B shape (plain PyTorch cannot hold it: ``--only tiermem``):

    python tools/bench_train.py --shape 8b --batch 1 --accum 1 --seq 524288 --only tiermem --nvme /path/on/nvme
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
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
             "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
             "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 24,
             "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
             "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
             "tie_word_embeddings": False, "hidden_act": "silu", "initializer_range": 0.02,
             "output_router_logits": True, "router_aux_loss_coef": 0.001}  # (the published model has 48 layers)
SHAPES = {"3b": SHAPE,
          "8b": dict(SHAPE, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
          "qwen3-moe": QWEN3_MOE}


def batches(args, vocab: int, step: int):
    g = torch.Generator().manual_seed(step)
    out = []
    for _ in range(args.accum):
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
        pin = (lambda t: t.pin_memory()) if torch.cuda.is_available() else (lambda t: t)  # (CPU: a smoke run)
        out.append((pin(ids), pin(ids.clone()), ids.numel()))
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


def keep_arg(text: str):
    """--keep: a number of layers or ``auto``."""
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"a number of layers (0 or more) or auto, got {text!r}")
    return n


def compile_arg(text: str):
    """--compile's value as torch_compile takes it."""
    return {"true": True, "false": False}.get(text, text)


def run_tiermem(args, raw: dict, model_dir: Path, path: str = "template", around=None) -> dict:
    """``around(step)``, when given, is a context manager each step runs in (tools/profile_step.py's
    profiler)."""
    import contextlib

    from tiermem.optim import AdamWConfig, StoreAdamW
    from tiermem.store.store import Store
    from trainer.model.select import load_model
    from trainer.model.weights import all_weights, group_order
    from trainer.outputs.weights_io import init_weights
    from trainer.planning import run_plan
    from trainer.run.executor import Executor
    from trainer.state import state_specs, store_config

    mcfg = load_model(model_dir, path)
    from trainer.model.compiled import choose  # (torch_compile, as tiermem-train takes it)

    mcfg.compile = choose(compile_arg(getattr(args, "compile", "auto")), "inductor", None, mcfg,
                          torch.cuda.is_available())
    chunk = getattr(args, "seq_chunk", "auto")  # (tiermem_seq_chunk: a long row's layer in sequence chunks)
    if not mcfg.generic:
        mcfg.seq_chunk = None if chunk == "auto" else int(chunk)
    activations = getattr(args, "activations", "auto")  # (tiermem_activations)
    data = {"tiers": {"gpu": {"slots": args.slots}}, "optimizer": {"gpu_share": args.gpu_share}}
    if args.nvme:
        data["tiers"]["nvme"] = {"path": args.nvme}
    if args.placement == "dram":
        data["placement"] = {k: "dram" for k in ("param", "grad", "master", "exp_avg", "exp_avg_sq")}
    scfg = store_config(data)
    plan, t_plan = None, 0.0
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")  # (a CPU: a smoke run of the code path)
    if args.placement == "auto":
        t0 = time.perf_counter()
        machine = run_plan.machine_for(scfg, dev, args.probe)
        plan = run_plan.make(mcfg, torch.bfloat16, scfg, run_plan.Shape(args.batch, args.seq, args.accum), machine,
                             dev, args.loss_chunk, keep=getattr(args, "keep", 0), activations=activations,
                             piece_rows=getattr(args, "physical", "auto"))
        run_plan.keep_activations(plan, getattr(args, "keep", 0), mcfg)
        t_plan = time.perf_counter() - t0
        for line in run_plan.lines(plan):
            print(line, flush=True)
    t0 = time.perf_counter()
    store = Store.open(scfg, state_specs(mcfg, torch.bfloat16), streamed_kinds=("param",), plan=plan)
    t_open = time.perf_counter() - t0
    init_weights(store, mcfg, {"param": torch.bfloat16, "master": torch.float32}, 0, store.gpu.device)
    t_init = time.perf_counter() - t0 - t_open
    on_gpu = plan.gpu_updates if plan is not None and args.gpu_share == "auto" else None
    opt = StoreAdamW(store, group_order(mcfg), {w.name: w.decay for w in all_weights(mcfg)}, AdamWConfig(),
                     has_master=True, on_gpu=on_gpu)
    budget = plan.activation_budget if plan is not None else None
    if args.passes > 1:  # --passes N: an activation budget that holds ceil(accum / N) micro-batches' boundaries
        per_mb = (mcfg.num_layers + 1) * mcfg.hidden_size * 2 * args.batch * args.seq
        budget = per_mb * -(-args.accum // args.passes)
    keep = getattr(args, "keep", 0)
    if keep == "auto":  # (the plan's choice, as tiermem-train takes it)
        keep = len(getattr(plan, "keep", ()) or ())
    act_host = ("dram", plan.act_host) if plan is not None and plan.act_host else (None, 0)
    physical = getattr(args, "physical", "auto")  # (tiermem_physical_batch_size: auto, the plan's pieces)
    rows = plan.piece_rows if plan is not None and plan.piece_rows else None if physical == "auto" else int(physical)
    ex = Executor(store, mcfg, torch.bfloat16, opt, 1.0, args.loss_chunk, budget, keep, piece_rows=rows,
                  act_host=act_host)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    starts, results, opt_s = [], [], []
    total = args.warmup + args.steps
    for step in range(total):
        starts.append(time.perf_counter())
        with around(step) if around is not None else contextlib.nullcontext():
            results.append(ex.step(batches(args, raw["vocab_size"], step), step, 1e-5))
        if step > 0:
            opt_s.append(opt.last_step_seconds)
    opt.wait()  # the last update belongs to the last timed step
    starts.append(time.perf_counter())
    times = [starts[i + 1] - starts[i] for i in range(args.warmup, total)]
    splits = results[args.warmup:]
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else 0
    stats = store.stats()
    ex.close()
    opt.close()
    store.close()
    n = len(splits)
    return {"step_s": statistics.median(times), "times": times, "peak_hbm_gib": peak / 2**30,
            "compute_s": sum(s.compute for s in splits) / n,
            "wait_transfer_s": sum(s.wait_transfer for s in splits) / n,
            "wait_optimizer_s": sum(s.wait_optimizer for s in splits) / n,
            # (the executor keys its waits "phase group": summed here by phase)
            "waits_by_phase": {ph: {k: sum(w[k] for s in splits for at, w in s.waits_by_phase.items()
                                           if at.split(" ", 1)[0] == ph) / n
                                    for k in ("transfer", "optimizer")} for ph in ("forward", "loss", "backward")},
            "optimizer_busy_s": statistics.median(opt_s or [opt.last_step_seconds]),
            "optimizer_split": opt.last_split, "optimizer_threads": opt.threads, "gpu_share": opt.gpu_share,
            "store_open_s": t_open, "init_s": t_init, "links": stats.get("links"), "passes": ex.last_passes,
            "losses": [r.loss for r in results], "grad_norms": [r.grad_norm for r in results],
            "gradient_partials_wait_s": stats.get("waits_s", {}).get("gradient_partials", 0.0) / total,
            "plan_s": t_plan, "alloc_retries": retries, "kept_layers": ex.last_kept,
            "activations_in_dram": act_host[1], "activation_wait_s": stats.get("waits_s", {}).get("activations", 0.0)
            / total,
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
    ap.add_argument("--nvme", help="a directory for the NVMe tier's file (the planner may then spill state there)")
    ap.add_argument("--path", choices=["template", "generic", "both"], default="template",
                    help="tiermem's model path: the hand-written template, the generic one, or both (no plain run)")
    ap.add_argument("--slots", type=int, default=3)
    ap.add_argument("--loss-chunk", type=int, default=4096)
    ap.add_argument("--seq-chunk", default="auto", help="tiermem_seq_chunk: tokens a layer computes at once over a "
                    "long row (auto: rows over 16384 tokens in chunks of at most 8192)")
    ap.add_argument("--activations", choices=["auto", "gpu", "dram"], default="auto",
                    help="tiermem_activations: where the boundary activations live (auto: the planner's)")
    ap.add_argument("--gpu-share", default="auto", help="tiermem optimizer.gpu_share (auto, or 0..1)")
    ap.add_argument("--passes", type=int, default=0,
                    help="tiermem: run each step as this many layer-major passes (partial gradients in DRAM between)")
    ap.add_argument("--physical", default="auto",
                    help="tiermem_physical_batch_size: rows a piece (fewer than --batch: pieces of a micro-batch; a "
                         "multiple of it: micro-batches merged); auto: the plan's, as tiermem-train")
    ap.add_argument("--keep", type=keep_arg, default=0,
                    help="tiermem: layers (of those in HBM) whose activations are kept: no recompute in their backward "
                         "(auto: as many as the plan's HBM holds, as tiermem_keep_activations: auto)")
    ap.add_argument("--compile", nargs="?", const="true", default="auto", choices=["auto", "true", "false"],
                    help="tiermem: torch.compile the decoder layer (torch_compile; auto: on CUDA, as tiermem-train)")
    ap.add_argument("--only", choices=["plain", "tiermem"])
    ap.add_argument("--json")
    ap.add_argument("--alloc-conf", default="expandable_segments:True",
                    help="PYTORCH_CUDA_ALLOC_CONF for both runs (tiermem-train's default; '' for PyTorch's)")
    args = ap.parse_args()
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = args.alloc_conf
    if not torch.cuda.is_available():
        raise SystemExit("bench_train needs a CUDA GPU")
    moe = args.shape == "qwen3-moe"
    if moe and (args.only == "plain" or args.path != "template"):
        raise SystemExit("--shape qwen3-moe runs tiermem's template alone (--only tiermem, --path template): plain "
                         "PyTorch cannot hold its fp32 training state in HBM")
    raw = dict(SHAPES[args.shape])
    if args.layers:
        raw["num_hidden_layers"] = args.layers
    d = Path(tempfile.mkdtemp(prefix="tiermem-bench-"))
    (d / "config.json").write_text(json.dumps(raw))
    from trainer.model.config import model_config_from_dict
    from trainer.planning.flops import flops_per_token

    mcfg = model_config_from_dict(raw)
    n_params, n_active = mcfg.num_params(), mcfg.num_params(active=True)
    attention = flops_per_token(mcfg, args.seq)[1]  # (causal, each layer's window: trainer.planning.flops)
    tokens = args.batch * args.accum * args.seq
    res = {"tokens_per_step": tokens, "params": n_params, "active_params": n_active,
           "attention_flops_per_token": attention}
    runs = (["tiermem", "generic"] if args.path == "both" else
            [*(["plain"] if args.only != "tiermem" and not moe else []),
             *(["tiermem"] if args.only != "plain" else [])])
    for k in runs:
        if k == "plain":
            res[k] = run_plain(args, raw)
        else:
            path = "generic" if k == "generic" or args.path == "generic" else "template"
            res[k] = run_tiermem(args, raw, d, path)
            res[k]["path"] = path
    for k in runs:
        r = res[k]
        r["tokens_per_s"] = tokens / r["step_s"]
        r["tflops"] = 6 * n_active * tokens / r["step_s"] / 1e12
        r["tflops_attention"] = r["tflops"] + attention * tokens / r["step_s"] / 1e12
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    name = "Qwen3-30B-A3B dims" if moe else f"Llama-{args.shape.upper()} shape"
    print(f"{name} ({n_params / 1e9:.2f} B params, {n_active / 1e9:.2f} B active, {raw['num_hidden_layers']} "
          f"layers), bf16, {args.accum}x{args.batch}x{args.seq} = {tokens} tokens/step; TFLOP/s = 6 x active params "
          "x tokens; +attn: with causal attention's FLOPs counted beside")
    if moe:
        from trainer.model.moe import grouped_available

        probe = torch.empty(1, raw["hidden_size"], dtype=torch.bfloat16, device="cuda")
        print("MoE experts: " + ("grouped matmuls (torch._grouped_mm)" if grouped_available(
            probe, raw["moe_intermediate_size"]) else "one matmul chain per expert") + " (TIERMEM_MOE_GROUPED=0: "
              "per expert)")
    print(f"{'':10} {'s/step':>8} {'tok/s':>9} {'TFLOP/s':>8} {'+attn':>7} {'peak HBM':>9}  split")
    for k in runs:
        r = res[k]
        split = ""
        if k != "plain":
            split = (f"compute {r['compute_s']:.3f} + wait transfer {r['wait_transfer_s']:.3f} + wait optimizer "
                     f"{r['wait_optimizer_s']:.3f} (optimizer busy {r['optimizer_busy_s']:.3f} s: "
                     + ", ".join(f"{a} {b:.3f}" for a, b in r["optimizer_split"].items())
                     + f"; {r['optimizer_threads']} threads, gpu_share {r['gpu_share']})")
        print(f"{k:10} {r['step_s']:8.3f} {r['tokens_per_s']:9.0f} {r['tflops']:8.1f} {r['tflops_attention']:7.1f} "
              f"{r['peak_hbm_gib']:8.1f}G  {split}")
    if args.path == "both":
        print(f"ratio generic/template step time: {res['generic']['step_s'] / res['tiermem']['step_s']:.3f} "
              f"(template {res['tiermem']['step_s']:.3f} s, generic {res['generic']['step_s']:.3f} s)")
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
