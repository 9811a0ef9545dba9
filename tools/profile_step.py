"""Profile: where a streamed step's GPU time goes, against the same layer's standalone ceiling, in one run.

    python tools/profile_step.py [--shape 3b|8b|14b|qwen3-moe|tiny] [--batch 4] [--accum 4] [--seq 4096]
                                 [--layers N] [--warmup 2] [--passes N] [--placement auto|dram]
                                 [--trace FILE.json] [--json FILE]

Trains the shape as tools/bench_train.py's tiermem run does (placed by the planner), runs ``--warmup``
steps, then one step under the torch profiler, and prints:

- the step's kernel time by kind — matmuls, attention, norms, elementwise, reductions and softmax,
  gathers/scatters, copies — and the host's time in the CUDA allocator (cudaMalloc / cudaFree), with each
  one's share;
- the step's compute as the executor measured it (forward, loss, backward with one recompute), against the
  standalone ceiling of the same schedule: one layer's forward and its backward with recompute, the loss,
  a layer's gradient handling and the embedding's gradient, each timed alone at the step's micro-batch shape
  in this process (``trainer.planning.plan_workload``), summed over the step. The ratio is what streaming costs
  the kernels (issue 17 asks for >= 0.9). The same parts are also timed before the run's first step, as a
  run's plan times them (a Qwen3-MoE plan predicted 1.6x less compute than its steps took).

``--passes N`` runs the step as N layer-major passes (an activation budget of the micro-batches a pass holds),
``--placement dram`` keeps every kind in DRAM: every layer streamed, its gradient's partial sums going out and
coming back between passes, as the 14B's layers 20-47 do (`--shape 14b --layers 8 --placement dram --passes 4`:
what a pass costs the compute beyond its share of the kernels).

``--trace FILE`` also writes the profiled step as a Chrome trace. Without CUDA it runs the ``tiny`` shape on
the CPU (a smoke test of the tool: CPU operator times stand in for kernels).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_train import SHAPES, compile_arg, keep_arg, run_tiermem  # noqa: E402
from make_shape_run import SHAPES as RUN_SHAPES  # noqa: E402 - (the 14B's)

TINY = dict(SHAPES["3b"], hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)
TOP = 14  # the costliest kernels listed
KINDS = [  # (kind, pattern over a kernel's or operator's name, lower case); the first that matches
    ("attention", r"flash|fmha|attention|sdpa|mha"),
    ("matmul", r"gemm|cutlass|cublas|nvjet|xmma|matmul|aten::mm\b|aten::addmm|aten::bmm|grouped_mm|aten::linear"),
    ("norm", r"rms|layer_?norm|rsqrt"),
    ("softmax / reduction", r"softmax|cross_entropy|nll|reduce|aten::sum|aten::mean|aten::amax|aten::max\b|norm"),
    ("gather / scatter", r"index|scatter|gather|embedding|argsort|sort|topk|bincount|cumsum"),
    ("copy", r"memcpy|memset|copy|aten::cat|aten::stack|aten::to\b|clone|contiguous|fill"),
    ("elementwise", r"elementwise|vectorized|silu|aten::mul|aten::add|aten::sub|aten::div|sigmoid|exp|pow|"
                    r"foreach|where|neg|aten::cos|aten::sin"),
]


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, pat in KINDS:
        if re.search(pat, low):
            return kind
    return "other"


def by_kind(prof, cuda: bool) -> tuple[dict, float, float, list]:
    """Milliseconds by kind (kernels on CUDA, the CPU's operators otherwise), the total, the host's
    milliseconds in the CUDA allocator, and the costliest kernels (ms, calls, kind, name)."""
    from torch.autograd import DeviceType

    out: dict = defaultdict(float)
    alloc = 0.0
    top = []
    for e in prof.key_averages():
        if re.search(r"cudaMalloc|cudaFree|cuMem(Create|Map|Unmap|Release|SetAccess)", e.key):
            alloc += e.cpu_time_total / 1e3
        if cuda:
            if getattr(e, "device_type", None) != DeviceType.CUDA:
                continue
            t = getattr(e, "self_device_time_total", None)
            t = getattr(e, "self_cuda_time_total", 0.0) if t is None else t
        else:
            if not e.key.startswith("aten::"):
                continue
            t = e.self_cpu_time_total
        out[kind_of(e.key)] += t / 1e3
        top.append((t / 1e3, e.count, kind_of(e.key), e.key))
    return dict(out), sum(out.values()), alloc, sorted(top, reverse=True)[:TOP]


def time_parts(mcfg, args, device: torch.device) -> dict:
    """Each part of the step's schedule timed alone at its micro-batch shape (a layer's forward, its backward
    with recompute, the loss, a layer's gradient handling, the embedding's gradient: seconds), and the caching
    allocator's device allocations and frees while they were timed."""
    from trainer.planning.plan_workload import _time

    before = _device_allocs(device)
    t_f, t_b, t_h, t_g, t_e, *_ = _time(mcfg, torch.bfloat16, args.batch, args.seq, device, args.loss_chunk)
    return dict(forward=t_f, backward=t_b, loss=t_h, grad=t_g, embed=t_e, device_allocs=_device_allocs(device) - before)


def ceiling(parts: dict, mcfg, args, kept: int) -> float:
    """Seconds of the step's compute with every part as ``parts`` timed it alone (``kept`` layers without their
    recompute, as the step ran them)."""
    layers, accum = mcfg.num_layers, args.accum
    return (layers * accum * (parts["forward"] + parts["backward"]) - kept * accum * parts["forward"]
            + accum * parts["loss"] + layers * parts["grad"] + parts["embed"])


def _device_allocs(device: torch.device) -> int:
    """The caching allocator's device allocations and frees so far (cudaMalloc/cudaFree, or the segments an
    expandable pool mapped and unmapped): each one is the host waiting on the driver."""
    if device.type != "cuda":
        return 0
    st = torch.cuda.memory_stats(device)
    return int(st.get("num_device_alloc", 0) + st.get("num_device_free", 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted({*SHAPES, *RUN_SHAPES, "tiny"}), default="3b")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--loss-chunk", type=int, default=4096)
    ap.add_argument("--probe", help="a `tiermem probe --save` file for the planner (default: a quick probe)")
    ap.add_argument("--nvme", help="a directory for the NVMe tier's file")
    ap.add_argument("--keep", type=keep_arg, default=0,
                    help="layers whose activations are kept (no recompute; auto: as many as the plan's HBM holds)")
    ap.add_argument("--compile", nargs="?", const="true", default="auto", choices=["auto", "true", "false"],
                    help="torch.compile the decoder layer (torch_compile; auto: on CUDA, as tiermem-train)")
    ap.add_argument("--passes", type=int, default=0, help="layer-major passes a step (default: the plan's)")
    ap.add_argument("--placement", choices=["auto", "dram"], default="auto",
                    help="auto: the planner's; dram: every kind in DRAM (every layer streamed)")
    ap.add_argument("--trace", help="write the profiled step as a Chrome trace")
    ap.add_argument("--json")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and args.shape != "tiny":
        raise SystemExit("profile_step needs a CUDA GPU for a real shape (--shape tiny runs on the CPU)")
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    raw = dict(TINY if args.shape == "tiny" else SHAPES.get(args.shape) or RUN_SHAPES[args.shape])
    if args.layers:
        raw["num_hidden_layers"] = args.layers
    d = Path(tempfile.mkdtemp(prefix="tiermem-profile-"))
    (d / "config.json").write_text(json.dumps(raw))
    from torch.profiler import ProfilerActivity, profile

    from trainer.model.config import model_config_from_dict
    from trainer.planning.flops import flops_per_token

    mcfg = model_config_from_dict(raw)
    from trainer.model.compiled import choose  # (the ceiling times the layer the step runs)

    mcfg.compile = choose(compile_arg(args.compile), "inductor", None, mcfg, cuda)
    holder: dict = {}

    def around(step: int):
        if step != args.warmup:
            import contextlib

            return contextlib.nullcontext()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        holder["prof"] = profile(activities=acts)
        return holder["prof"]

    # (bench_train's run: the planner's placement, the trainer's executor and optimizer; one step profiled)
    bench = argparse.Namespace(batch=args.batch, accum=args.accum, seq=args.seq, steps=1, warmup=args.warmup,
                               placement=args.placement, probe=args.probe, nvme=args.nvme, slots=3,
                               loss_chunk=args.loss_chunk, gpu_share="auto", passes=args.passes, keep=args.keep,
                               compile=args.compile)
    device = torch.device("cuda" if cuda else "cpu")
    first = time_parts(mcfg, args, device)  # (the same timing before any step: as a run's plan times it)
    ceil_first = ceiling(first, mcfg, args, 0)
    if cuda:
        torch.cuda.empty_cache()
    allocs = _device_allocs(device)
    res = run_tiermem(bench, raw, d, around=around)
    allocs = _device_allocs(device) - allocs
    prof = holder["prof"]
    if args.trace:
        prof.export_chrome_trace(args.trace)
    kinds, total, alloc, top = by_kind(prof, cuda)
    compute = res["compute_s"]
    after = time_parts(mcfg, args, device)
    ceil = ceiling(after, mcfg, args, res["kept_layers"])
    ceil_after0 = ceiling(after, mcfg, args, 0)
    tokens = args.batch * args.accum * args.seq
    dense, attention = flops_per_token(mcfg, args.seq)
    print(f"{args.shape} shape ({mcfg.num_params() / 1e9:.2f} B params, {raw['num_hidden_layers']} layers), bf16, "
          f"{args.accum}x{args.batch}x{args.seq} = {tokens} tokens a step; step {res['times'][-1]:.3f} s = "
          f"{dense * tokens / res['times'][-1] / 1e12:.0f} TFLOP/s (6 N tokens; "
          f"{(dense + attention) * tokens / res['times'][-1] / 1e12:.0f} with causal attention)")
    what = "kernel" if cuda else "CPU operator"
    print(f"\n{'the profiled step, ' + what + ' time by kind':44} {'ms':>10} {'share':>7}")
    for kind, ms in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"{kind:44} {ms:10.1f} {ms / total:7.1%}")
    print(f"{'(all)':44} {total:10.1f}")
    print(f"{'host in the CUDA allocator (cudaMalloc/Free)':44} {alloc:10.1f}")
    print(f"\n{'the costliest ' + what + 's':44} {'ms':>10} {'calls':>7}  kind")
    for ms, calls, kind, name in top:
        print(f"{name[:44]:44} {ms:10.1f} {calls:7d}  {kind}")
    print(f"\nstep compute (the executor's) {compute:.3f} s; standalone ceiling of the same schedule {ceil:.3f} s; "
          f"ceiling / compute = {ceil / compute:.3f}" + ("  (CPU: a smoke run)" if not cuda else ""))
    print(f"the same parts timed before the run's steps (nothing kept) {ceil_first:.3f} s, after them "
          f"{ceil_after0:.3f} s (a run's plan times them before)")
    for k in ("forward", "backward", "loss", "grad", "embed"):
        print(f"  {k:10} before {first[k] * 1e3:9.2f} ms  after {after[k] * 1e3:9.2f} ms  ({after[k] / first[k]:.2f}x)")
    print(f"device allocations + frees: while timing before {first['device_allocs']}, in the run "
          f"({args.warmup + 1} steps) {allocs}, while timing after {after['device_allocs']}")
    print(f"step split: compute {compute:.3f} s + waiting for transfers {res['wait_transfer_s']:.3f} s + for the "
          f"optimizer {res['wait_optimizer_s']:.3f} s; allocator retries {res['alloc_retries']}; "
          f"{res['passes']} pass(es) a step, the trainer's thread waiting {res['gradient_partials_wait_s']:.3f} s a "
          "step for partial sums")
    if args.json:
        Path(args.json).write_text(json.dumps({"kinds_ms": kinds, "top": top, "total_ms": total,
                                               "allocator_host_ms": alloc, "compute_s": compute, "ceiling_s": ceil,
                                               "ceiling_before_s": ceil_first, "ceiling_after_unkept_s": ceil_after0,
                                               "parts_before": first, "parts_after": after, "run_device_allocs": allocs,
                                               "run": res}, default=str,
                                              indent=1))


if __name__ == "__main__":
    main()
