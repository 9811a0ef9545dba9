"""Probe: the PCIe link each way alone, both ways at once, and both ways beside a GPU busy with matmuls.

    python tools/probe_duplex.py [--size 2GiB] [--reps 4]

The cost model (tiermem.plan.costmodel) takes each direction of the link as its own resource at the rate
`tiermem probe` measured alone; this says whether the two directions, and the compute's kernels, leave
each other that rate on this machine. Prints GB/s of each case and its ratio to the direction alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tiermem.sizes import parse_size  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="2GiB")
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_duplex: needs a CUDA GPU")
    n = parse_size(args.size, "--size")
    host_in = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev_in = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev_out = torch.empty(n, dtype=torch.uint8, device="cuda")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    up, down, work = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()

    def run(h2d: bool, d2h: bool, busy: bool) -> tuple[float, float, float]:
        torch.cuda.synchronize()
        ev = {k: (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for k in "udw"}
        for key, stream, on in (("u", up, h2d), ("d", down, d2h)):
            if on:
                with torch.cuda.stream(stream):
                    ev[key][0].record()
                    for _ in range(args.reps):
                        (dev_in.copy_(host_in, non_blocking=True) if key == "u"
                         else host_out.copy_(dev_out, non_blocking=True))
                    ev[key][1].record()
        mm = 0
        if busy:  # matmuls for as long as the copies take
            with torch.cuda.stream(work):
                ev["w"][0].record()
                for _ in range(int(40 * args.reps * n / (1 << 30))):
                    a @ a
                    mm += 1
                ev["w"][1].record()
        torch.cuda.synchronize()
        rate = {k: n * args.reps / (ev[k][0].elapsed_time(ev[k][1]) / 1e3) / 1e9 for k, on in
                (("u", h2d), ("d", d2h)) if on}
        tf = mm * 2 * 8192 ** 3 / (ev["w"][0].elapsed_time(ev["w"][1]) / 1e3) / 1e12 if busy else 0.0
        return rate.get("u", 0.0), rate.get("d", 0.0), tf

    run(True, True, True)  # (warm-up)
    alone_u, _, _ = run(True, False, False)
    _, alone_d, _ = run(False, True, False)
    _, _, alone_tf = run(False, False, True)
    print(f"{'case':44} {'to GPU':>8} {'from GPU':>9} {'matmul TFLOP/s':>15}")
    print(f"{'each way alone':44} {alone_u:8.1f} {alone_d:9.1f}")
    print(f"{'matmuls alone':44} {'':8} {'':9} {alone_tf:15.0f}")
    for label, flags in (("both ways at once", (True, True, False)), ("to GPU beside matmuls", (True, False, True)),
                         ("both ways beside matmuls", (True, True, True))):
        u, d, tf = run(*flags)
        print(f"{label:44} {u:8.1f} {d:9.1f} {tf:15.0f}" + (f"   ratios {u / alone_u:.2f} {d / alone_d:.2f}"
                                                             + (f" {tf / alone_tf:.2f}" if tf else "")))


if __name__ == "__main__":
    main()
