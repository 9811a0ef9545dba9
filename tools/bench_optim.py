"""Benchmark the CPU side of the optimizer: torch fused AdamW and the fp32 -> bf16 compute-copy write
over one Llama-3B-shaped decoder layer (100.7 M params, 12 tensors), in host memory.

    python tools/bench_optim.py [--threads 16] [--reps 5] [--pinned]

Prints G params/s for: AdamW alone, the bf16 copy alone, and the two together (as StoreAdamW does
them), the two with a check of the new compute copy (its norm: finite or not; what the GPU worker does, and what
the CPU worker would pay for it: tiermem.optim.store_adamw), and fp32 AdamW with the check of its weights, for the
given thread counts; the ceiling is a plain fp32 memcpy of the same bytes. Then the
service's crash-safe variants (clipped gradients): AdamW in place behind an undo copy of the weights,
moments and gradient (16 B/param copied first), the same with the undo copy's checksum taken as the service's
journal takes it (tiermem.store.parallel_crc.piece_crcs of the whole extent, on a pool of threads, before the
update), and AdamW out of place (tiermem.optim.kernels: chunked, the old state and the gradient untouched;
three chunk sizes), each as a ratio to AdamW in place in the same run.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tiermem.optim.kernels import CHUNK, adamw_out_of_place  # noqa: E402
from tiermem.optim.store_adamw import weights_norm  # noqa: E402
from tiermem.store.parallel_crc import piece_crcs  # noqa: E402

SHAPES = [(3072, 3072), (1024, 3072), (1024, 3072), (3072, 3072), (8192, 3072), (8192, 3072), (3072, 8192),
          (3072,), (3072,)]


def timed(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="16", help="comma-separated thread counts")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--pinned", action="store_true")
    args = ap.parse_args()
    mk = lambda s, dt=torch.float32: torch.zeros(s, dtype=dt, pin_memory=args.pinned)
    p = [mk(s) for s in SHAPES]
    g = [mk(s) + 1e-3 for s in SHAPES]
    m = [mk(s) for s in SHAPES]
    v = [mk(s) for s in SHAPES]
    b = [mk(s, torch.bfloat16) for s in SHAPES]
    n = sum(t.numel() for t in p)
    steps = [torch.tensor(1.0) for _ in p]

    def adam():
        torch._fused_adamw_(p, g, m, v, [], steps, lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8,
                            amsgrad=False, maximize=False, grad_scale=None, found_inf=None)

    def copy():
        for dst, src in zip(b, p):
            dst.copy_(src)

    def both():
        adam()
        copy()

    def both_checked():  # (StoreAdamW's: the new compute copy checked finite where the update wrote it)
        adam()
        copy()
        math.isfinite(weights_norm(b).item())

    def adam_checked():  # (fp32: the weights are the compute copy)
        adam()
        math.isfinite(weights_norm(p).item())

    def memcpy():
        for dst, src in zip(m, p):
            dst.copy_(src)

    hp = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "grad_scale": 2.0}
    flat = torch.zeros(4 * n, dtype=torch.float32)  # one extent, as the service's undo copy is
    undo, at = [], 0
    for s in SHAPES * 4:
        k = int(np.prod(s))
        undo.append(flat[at: at + k].view(s))
        at += k
    new = [[mk(s) for s in SHAPES] for _ in range(3)]

    def clipped():
        torch._fused_adamw_(p, g, m, v, [], steps, lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8,
                            amsgrad=False, maximize=False, grad_scale=torch.tensor(2.0), found_inf=None)

    def undo_then_adam():
        for dst, src in zip(undo, p + g + m + v):
            dst.copy_(src)
        clipped()

    def undo_crc_then_adam():
        for dst, src in zip(undo, p + g + m + v):
            dst.copy_(src)
        piece_crcs(flat.numpy())
        clipped()

    def out_of_place(chunk: int):
        return lambda: adamw_out_of_place(list(zip(p, g, m, v, *new)), 2, **hp, chunk=chunk)

    for th in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(th)
        res = {k: n / timed(f, args.reps) / 1e9 for k, f in
               (("adamw", adam), ("bf16 copy", copy), ("adamw+copy", both), ("adamw+copy+check", both_checked),
                ("adamw+check (fp32)", adam_checked), ("fp32 memcpy", memcpy))}
        print(f"threads {th:2d}: " + ", ".join(f"{k} {r:.2f} G params/s" for k, r in res.items()))
        base = n / timed(clipped, args.reps) / 1e9
        safe = {k: n / timed(f, args.reps) / 1e9 for k, f in
                (("undo copy + in place", undo_then_adam), ("undo copy + its CRCs + in place", undo_crc_then_adam),
                 *((f"out of place, chunk {c >> 10} Ki{' (default)' if c == CHUNK else ''}", out_of_place(c))
                   for c in (1 << 18, CHUNK, 1 << 22)))}
        print(f"threads {th:2d}: clipped adamw in place {base:.2f} G params/s; crash-safe: " +
              ", ".join(f"{k} {r:.2f} ({r / base:.2f}x)" for k, r in safe.items()))


if __name__ == "__main__":
    main()
