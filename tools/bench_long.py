"""Benchmark: a long row's training step against its ceiling measured in the same process (issue 39).

    python tools/bench_long.py [--shape 8b|3b|tiny] [--seq 131072] [--steps 2] [--warmup 1] [--out DIR]
                               [--seq-chunk auto|N] [--loss-chunk 4096] [--keep auto|N] [--layers N]
                               [--probe FILE] [--nvme DIR]

1. Trains the shape (random weights, random tokens) one row of ``--seq`` tokens a step through the trainer's
   code (tools/bench_train.py's tiermem run: the planner's placement and boundary activations, auto, the store,
   the executor and the optimizer, as tiermem-train runs them; ``--keep``: tiermem_keep_activations, auto as there:
   a kept layer skips the attention's recompute): ``--warmup`` steps untimed, then ``--steps``.
2. In the same process, on the same device, times alone and synchronised each kernel the step's schedule runs
   (trainer.model.chunked, trainer.run.executor) at that row: the attention's forward and backward (SDPA, causal,
   the shape's heads and KV heads; on CUDA through the fused kernels only, as chunked.py restricts them), each
   projection's forward and its two backward matmuls (the input's gradient, the weight's) at a chunk's tokens,
   and the LM head's per loss chunk, counted as often as the schedule runs each: a layer's attention forward
   twice (the forward, the backward's recompute), q/k/v three times in a row cut into chunks (the forward,
   the backward's recompute without graph, each chunk's again with its graph). Their sum is the ceiling.
   The step's parts are also timed alone (a layer's forward, its backward with recompute, the loss, a
   layer's gradient handling, the embedding's gradient: as tools/profile_step.py times them) to split the gap
   between the step and the ceiling: the layer's and the loss's work besides these kernels (norms, RoPE,
   SwiGLU, residuals, fp32 gradient sums, copies), the gradients' handling, the executor around the parts,
   and the waits on transfers and the optimizer.
3. Prints the table last: the measured steady step, the ceiling, step / ceiling, TFLOP/s both ways (6 N, and
   with causal attention) and the gap's split; writes the details to ``--out``/bench_long.json (``--out``:
   default $OUT, else /tmp/out).

Without CUDA, ``--shape tiny`` runs the same code on the CPU at tiny sizes (a stand-in: the fused-kernel
restriction is CUDA's; ``--seq-chunk`` cuts its short row into chunks):

    python tools/bench_long.py --shape 8b --seq 131072 --steps 2
    python tools/bench_long.py --shape tiny --seq 64 --seq-chunk 16 --steps 1
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_train import SHAPES, keep_arg, run_tiermem  # noqa: E402
from profile_step import TINY, time_parts  # noqa: E402

PROJECTIONS = [("q_proj", "self_attn.q_proj"), ("k_proj", "self_attn.k_proj"), ("v_proj", "self_attn.v_proj"),
               ("o_proj", "self_attn.o_proj"), ("gate_proj", "mlp.gate_proj"), ("up_proj", "mlp.up_proj"),
               ("down_proj", "mlp.down_proj")]
QKV = ("q_proj", "k_proj", "v_proj")


@dataclass
class Kernel:
    """One kernel of the step's schedule, at one shape: how often a step runs it and one call's time alone."""

    name: str  # "attention forward", "q_proj forward", "q_proj input grad", "q_proj weight grad", "lm_head ..."
    part: str  # "layer" or "loss"
    shape: tuple  # a matmul's (tokens, in, out); the attention's (rows, tokens, heads, KV heads, head dim)
    calls: int  # a step
    flops: float  # one call's
    seconds: float = 0.0  # one call's, timed alone


def layer_schedule(mcfg, rows: int, seq: int, kept: bool = False) -> dict:
    """How often one layer's forward and backward run each kernel over ``rows`` x ``seq`` tokens, by (name,
    shape); the matmuls at each chunk's tokens (trainer.model.chunked; a short row whole, as decoder_layer).
    ``kept`` (tiermem_keep_activations): the layer's backward recomputes nothing of a whole row, and over a row cut
    into chunks neither the attention's forward nor q/k/v without graph."""
    from trainer.model import chunked

    chunk = chunked.chunk_of(mcfg.seq_chunk, rows, seq)
    lengths = Counter(e - s for s, e in chunked.spans(seq, chunk if chunk is not None else seq))
    shapes = {p: (w.shape[1], w.shape[0]) for p, w in _projection_weights(mcfg).items()}  # (in, out)
    out: Counter = Counter()
    attn = (rows, seq, mcfg.num_heads, mcfg.num_kv_heads, mcfg.head_dim)
    out["attention forward", attn] += 1 if kept else 2  # (the forward; the backward's recompute)
    out["attention backward", attn] += 1
    for n, m in lengths.items():
        for p, (i, o) in shapes.items():
            shape = (rows * n, i, o)
            # the forward, the recompute, and (q/k/v of a row cut into chunks) each chunk's again with its graph
            runs = 1 if kept and chunk is None else 2 if kept or p not in QKV or chunk is None else 3
            out[f"{p} forward", shape] += m * runs
            out[f"{p} input grad", shape] += m
            out[f"{p} weight grad", shape] += m
    return dict(out)


def _projection_weights(mcfg):
    from trainer.model.weights import layer_weights

    ws = {w.local: w for w in layer_weights(mcfg, 0)}
    return {p: ws[f"{full}.weight"] for p, full in PROJECTIONS}


def schedule(mcfg, rows: int, seq: int, loss_chunk: int, kept: int = 0) -> list[Kernel]:
    """The kernels a step of one micro-batch of ``rows`` x ``seq`` tokens runs (every layer's, ``kept`` of them
    kept; the loss's chunks: each chunk's logits, their input's and the head weight's gradients), with their
    FLOPs."""
    from tiermem.plan.flops import attended_keys

    calls: Counter = Counter()
    for n, keep in ((mcfg.num_layers - kept, False), (kept, True)):
        for key, c in layer_schedule(mcfg, rows, seq, keep).items():
            calls[key] += c * n
    out = []
    for (name, shape), c in calls.items():
        if name.startswith("attention"):
            r, t, heads, _, d = shape
            fwd = 4.0 * r * t * attended_keys(t) * heads * d
            flops = fwd if name.endswith("forward") else 2 * fwd
        else:
            flops = 2.0 * shape[0] * shape[1] * shape[2]
        out.append(Kernel(name, "layer", shape, c, flops))
    tokens = rows * seq
    lengths = Counter(min(loss_chunk, tokens - s) for s in range(0, tokens, loss_chunk))
    for n, m in lengths.items():
        shape = (n, mcfg.hidden_size, mcfg.vocab_size)
        for what in ("forward", "input grad", "weight grad"):
            out.append(Kernel(f"lm_head {what}", "loss", shape, m, 2.0 * n * shape[1] * shape[2]))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    """Seconds of one call of ``fn`` alone: once to warm up, then as many calls as about half a second holds
    (2 to 20; the CPU stand-in's two), synchronised before and after."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    once = time.perf_counter() - t0
    reps = max(2, min(20, int(0.5 / max(once, 1e-6)))) if device.type == "cuda" else 2
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / reps


def _attention_calls(mcfg, shape, dtype, device):
    """(forward, backward) of the attention the schedule runs over q, k, v of ``shape``: chunked._attend (the fused
    kernels on CUDA) for a row cut into chunks, decoder_layer's attention for a whole one."""
    from trainer.model import chunked
    from trainer.model.attention import attention

    rows, t, heads, kv, d = shape
    q = torch.randn(rows, t, heads, d, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(rows, t, kv, d, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(rows, t, kv, d, dtype=dtype, device=device, requires_grad=True)
    if chunked.chunk_of(mcfg.seq_chunk, rows, t) is not None:
        run = lambda: chunked._attend(q, k, v, None, None, mcfg)  # noqa: E731
    else:
        run = lambda: attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # noqa: E731
    with torch.enable_grad():
        a = run()
    ga = torch.randn_like(a)

    def forward():
        with torch.no_grad():
            run()

    return forward, lambda: torch.autograd.grad(a, [q, k, v], ga, retain_graph=True)


def time_backends(shape, dtype: torch.dtype, device: torch.device) -> dict:
    """On CUDA, the attention at ``shape`` through each fused SDPA kernel alone (flash, cuDNN, memory-efficient):
    {kernel: {"forward": s, "backward": s, "expanded": whether k and v had to be expanded to q's heads}}, or
    {kernel: {"error": why}} where it does not run; {} on a CPU. What the step would gain from another kernel."""
    if device.type != "cuda":
        return {}
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows, t, heads, kv, d = shape
    out: dict = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        for expanded in (False, True):
            try:
                with sdpa_kernel([backend]):
                    q = torch.randn(rows, heads, t, d, dtype=dtype, device=device, requires_grad=True)
                    k, v = (torch.randn(rows, heads if expanded else kv, t, d, dtype=dtype, device=device,
                                        requires_grad=True) for _ in range(2))
                    gqa = k.shape[1] != heads

                    def run():
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

                    with torch.enable_grad():
                        a = run()
                    ga = torch.randn_like(a)
                    with torch.no_grad():
                        fwd = timed(run, device)
                    bwd = timed(lambda: torch.autograd.grad(a, [q, k, v], ga, retain_graph=True), device)
                out[name] = {"forward": fwd, "backward": bwd, "expanded": expanded}
                break
            except RuntimeError as e:
                out[name] = {"error": str(e).splitlines()[0][:200]}
            finally:
                q = k = v = a = ga = None
                torch.cuda.empty_cache()
    return out


def time_kernels(kernels: list[Kernel], mcfg, dtype: torch.dtype, device: torch.device) -> None:
    """Each kernel's ``seconds``: one call timed alone on ``device`` (inputs of random values, made once a
    shape)."""
    for shape in {k.shape for k in kernels if k.name.startswith("attention")}:
        fwd, bwd = _attention_calls(mcfg, shape, dtype, device)
        for k in kernels:
            if k.shape == shape and k.name.startswith("attention"):
                k.seconds = timed(fwd if k.name.endswith("forward") else bwd, device)
        del fwd, bwd
    for k in kernels:
        if k.name.startswith("attention"):
            continue
        n, i, o = k.shape
        x = torch.randn(n, i, dtype=dtype, device=device)
        w = torch.randn(o, i, dtype=dtype, device=device)
        g = torch.randn(n, o, dtype=dtype, device=device)
        fn = {"forward": lambda: torch.mm(x, w.t()), "input grad": lambda: torch.mm(g, w),
              "weight grad": lambda: torch.mm(g.t(), x)}[k.name.split(" ", 1)[1]]
        k.seconds = timed(fn, device)


def skipped_by_keep(mcfg, rows: int, seq: int, kernels: list[Kernel], forward: float) -> float:
    """Seconds of one layer's recompute that keeping it skips: its forward over a whole row (``forward``: timed
    alone), over a row cut into chunks the kernels it does not run again (timed alone: ``kernels``)."""
    from trainer.model import chunked

    if chunked.chunk_of(mcfg.seq_chunk, rows, seq) is None:
        return forward
    each = {(k.name, k.shape): k.seconds for k in kernels}
    kept = layer_schedule(mcfg, rows, seq, True)
    return sum(each[key] * (c - kept.get(key, 0)) for key, c in layer_schedule(mcfg, rows, seq).items())


def gap_split(res: dict, parts: dict, kernels: list[Kernel], layers: int, skipped: float) -> dict:
    """The measured step less the ceiling, in seconds, split by what the step runs besides the kernels alone
    (each part's time alone, ``parts``, less its kernels, a kept layer's less what it ``skipped``; the executor's
    measured compute less the parts alone; the waits; what lies between its steps). The items add up to
    step - ceiling; any may be negative (noise)."""
    layer_k = sum(k.seconds * k.calls for k in kernels if k.part == "layer")
    loss_k = sum(k.seconds * k.calls for k in kernels if k.part == "loss")
    layers_alone = layers * (parts["forward"] + parts["backward"]) - res["kept_layers"] * skipped
    alone = layers_alone + parts["loss"] + layers * parts["grad"] + parts["embed"]
    waits = res["wait_transfer_s"] + res["wait_optimizer_s"]
    return {
        "layers besides these kernels (norms, RoPE, SwiGLU, residuals, fp32 sums, copies)": layers_alone - layer_k,
        "loss besides its matmuls (final norm in fp32, cross-entropy, copies)": parts["loss"] - loss_k,
        "gradients' norms and copies home, the embedding's gradient": layers * parts["grad"] + parts["embed"],
        "the executor around the parts (activations' stash, allocator)": res["compute_s"] - alone,
        "waiting for transfers": res["wait_transfer_s"],
        "waiting for the optimizer": res["wait_optimizer_s"],
        "between the executor's steps": res["step_s"] - res["compute_s"] - waits,
    }


def _groups(kernels: list[Kernel]) -> dict:
    """Seconds a step, calls and FLOPs of the kernels by row of the printed table."""
    def row(k: Kernel) -> str:
        if k.part == "loss":
            return "lm_head (forward, 2 backward)"
        p, what = k.name.split(" ", 1)
        if p == "attention":
            return k.name
        group = {"q_proj": "q/k/v", "k_proj": "q/k/v", "v_proj": "q/k/v", "gate_proj": "gate/up/down",
                 "up_proj": "gate/up/down", "down_proj": "gate/up/down"}.get(p, p)
        return f"{group} {'forward' if what == 'forward' else 'backward (2)'}"

    out: dict = {}
    for k in kernels:
        g = out.setdefault(row(k), {"seconds": 0.0, "calls": 0, "flops": 0.0})
        g["seconds"] += k.seconds * k.calls
        g["calls"] += k.calls
        g["flops"] += k.flops * k.calls
    return out


def backends_apart(shape) -> dict:
    """``time_backends`` in a child process on the same GPU (a kernel that faults there cannot take this run's
    figures with it): its answer, or {"child": {"error": why}}."""
    import subprocess

    try:
        run = subprocess.run([sys.executable, __file__, "--attention-shape", ",".join(map(str, shape))],
                             capture_output=True, text=True, timeout=600)
        if run.returncode == 0:
            return json.loads(run.stdout.strip().splitlines()[-1])
        why = (run.stderr.strip().splitlines() or [f"exit code {run.returncode}"])[-1]
    except (subprocess.TimeoutExpired, ValueError, IndexError) as e:
        why = str(e)
    return {"child": {"error": why[:200]}}


def by_backend(kernels: list[Kernel], backends: dict) -> dict:
    """The ceiling were the step's attention run by each fused kernel that runs (``time_backends``), in seconds."""
    fwd = sum(k.calls for k in kernels if k.name == "attention forward")
    bwd = sum(k.calls for k in kernels if k.name == "attention backward")
    rest = sum(k.seconds * k.calls for k in kernels if not k.name.startswith("attention"))
    return {name: rest + fwd * b["forward"] + bwd * b["backward"] for name, b in backends.items() if "error" not in b}


def report(args, mcfg, res: dict, kernels: list[Kernel], parts: dict, backends: dict,
           device: torch.device) -> dict:
    """The figures, and the table printed (last)."""
    from trainer.model import chunked
    from trainer.planning.flops import flops_per_token

    tokens = args.seq
    dense, attn = flops_per_token(mcfg, args.seq)
    step = res["step_s"]
    ceiling = sum(k.seconds * k.calls for k in kernels)
    skipped = skipped_by_keep(mcfg, 1, args.seq, kernels, parts["forward"])
    gap = gap_split(res, parts, kernels, mcfg.num_layers, skipped)
    chunk = chunked.chunk_of(mcfg.seq_chunk, 1, args.seq)
    out = {"shape": args.shape, "seq": args.seq, "layers": mcfg.num_layers, "kept_layers": res["kept_layers"],
           "device": str(device),
           "chunk": chunk, "loss_chunk": args.loss_chunk, "step_s": step, "times": res["times"],
           "ceiling_s": ceiling, "step_over_ceiling": step / ceiling,
           "tflops": dense * tokens / step / 1e12, "tflops_attention": (dense + attn) * tokens / step / 1e12,
           "ceiling_tflops": dense * tokens / ceiling / 1e12,
           "ceiling_tflops_attention": (dense + attn) * tokens / ceiling / 1e12,
           "gap_s": step - ceiling, "gap_split_s": gap, "parts_alone_s": parts, "groups": _groups(kernels),
           "kernels": [asdict(k) for k in kernels], "attention_by_kernel": backends,
           "ceiling_by_attention_kernel_s": by_backend(kernels, backends), "run": res}
    print(f"\n{args.shape} shape ({mcfg.num_params() / 1e9:.2f} B params, {mcfg.num_layers} layers), bf16 on "
          f"{device.type}: one row of {args.seq:,} tokens a step; layers in chunks of "
          f"{chunk or args.seq:,} tokens ({res['kept_layers']} kept: no recompute of their attention), the loss in "
          f"chunks of {args.loss_chunk:,}")
    print(f"{'kernels alone, a step':34} {'calls':>7} {'s':>9} {'TFLOP/s':>8}")
    for name, g in out["groups"].items():
        print(f"{name:34} {g['calls']:7d} {g['seconds']:9.3f} {g['flops'] / max(g['seconds'], 1e-12) / 1e12:8.1f}")
    if backends:
        print("the attention alone by fused kernel (forward | backward, s a call; the ceiling with it): " + "; ".join(
            f"{n} {b['forward']:.3f} | {b['backward']:.3f}{' (k, v expanded)' if b['expanded'] else ''} "
            f"({out['ceiling_by_attention_kernel_s'][n]:.2f} s)" if "error" not in b else f"{n}: does not run"
            for n, b in backends.items()))
    print(f"\n{'measured steady step':52} {step:9.3f} s  (steps {' '.join(f'{t:.2f}' for t in res['times'])})")
    print(f"{'ceiling (the kernels alone, summed)':52} {ceiling:9.3f} s")
    print(f"{'step / ceiling':52} {step / ceiling:9.3f}")
    print(f"{'TFLOP/s, 6 N | with causal attention: step':52} {out['tflops']:9.1f} | {out['tflops_attention']:.1f}")
    print(f"{'TFLOP/s, 6 N | with causal attention: ceiling':52} {out['ceiling_tflops']:9.1f} | "
          f"{out['ceiling_tflops_attention']:.1f}")
    print(f"{'the gap, step - ceiling':52} {step - ceiling:9.3f} s")
    for what, s in gap.items():
        print(f"  {what:80} {s:9.3f} s")
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=["8b", "3b", "tiny"], default="8b")
    ap.add_argument("--seq", type=int, default=131072, help="tokens of the step's one row")
    ap.add_argument("--steps", type=int, default=2, help="steps timed (after --warmup)")
    ap.add_argument("--warmup", type=int, default=1, help="steps trained first, not timed")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"), help="where bench_long.json goes")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the shape's)")
    ap.add_argument("--seq-chunk", default="auto", help="tiermem_seq_chunk (auto: rows over 16384 tokens in chunks "
                    "of at most 8192)")
    ap.add_argument("--loss-chunk", type=int, default=4096, help="loss_chunk_tokens")
    ap.add_argument("--keep", type=keep_arg, default="auto", help="tiermem_keep_activations (auto: the plan's, as "
                    "tiermem-train; kept layers skip the attention's recompute)")
    ap.add_argument("--probe", help="a `tiermem probe --save` file for the planner (default: a quick probe)")
    ap.add_argument("--nvme", help="a directory for the NVMe tier's file")
    ap.add_argument("--attention-shape", help=argparse.SUPPRESS)  # (the child of backends_apart)
    args = ap.parse_args(argv)
    if args.attention_shape:
        got = time_backends(tuple(int(x) for x in args.attention_shape.split(",")), torch.bfloat16,
                            torch.device("cuda"))
        print(json.dumps(got))
        return got
    cuda = torch.cuda.is_available()
    if not cuda and args.shape != "tiny":
        raise SystemExit("bench_long needs a CUDA GPU for a real shape (--shape tiny runs on the CPU)")
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # (tiermem-train's default)
    raw = dict(TINY if args.shape == "tiny" else SHAPES[args.shape])
    if args.layers:
        raw["num_hidden_layers"] = args.layers
    d = Path(tempfile.mkdtemp(prefix="tiermem-bench-long-"))
    (d / "config.json").write_text(json.dumps(raw))
    from trainer.model.compiled import choose
    from trainer.model.config import model_config_from_dict

    mcfg = model_config_from_dict(raw)  # (the layer the step runs: compiled on CUDA, its chunks as the run's)
    mcfg.compile = choose("auto", "inductor", None, mcfg, cuda)
    mcfg.seq_chunk = None if args.seq_chunk == "auto" else int(args.seq_chunk)
    bench = argparse.Namespace(batch=1, accum=1, seq=args.seq, steps=args.steps, warmup=args.warmup,
                               placement="auto", probe=args.probe, nvme=args.nvme, slots=3, loss_chunk=args.loss_chunk,
                               gpu_share="auto", passes=0, keep=args.keep, compile="auto", seq_chunk=args.seq_chunk,
                               activations="auto")
    res = run_tiermem(bench, raw, d)
    gc.collect()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.cuda.empty_cache()
    kernels = schedule(mcfg, 1, args.seq, args.loss_chunk, res["kept_layers"])
    time_kernels(kernels, mcfg, torch.bfloat16, device)
    if cuda:
        torch.cuda.empty_cache()
    parts = time_parts(mcfg, argparse.Namespace(batch=1, seq=args.seq, loss_chunk=args.loss_chunk), device)
    attn = next(k.shape for k in kernels if k.name == "attention forward")
    backends = backends_apart(attn) if cuda else {}
    out = report(args, mcfg, res, kernels, parts, backends, device)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_long.json").write_text(json.dumps(out, indent=1, default=str))
    return out


if __name__ == "__main__":
    main()
