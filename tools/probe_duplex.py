"""Probe: the PCIe link each way alone, both ways at once, and both ways beside a GPU busy with matmuls.

    python tools/probe_duplex.py [--size 2GiB] [--reps 4]

The cost model (tiermem.plan.costmodel) takes the link's copies at the machine's ``duplex`` share of each
direction's rate alone and stretches the compute by ``copy_drag`` of the time both directions copy;
`tiermem probe` saves both figures (these rows), and a run's quick probe measures the first. This prints the
full measurement (``tiermem.plan.machine.link_both_ways``): GB/s of each case and its ratio to the rate alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tiermem.plan.machine import link_both_ways  # noqa: E402
from tiermem.sizes import parse_size  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="2GiB")
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_duplex: needs a CUDA GPU")
    r = link_both_ways(torch.device("cuda"), parse_size(args.size, "--size"), args.reps, matmuls=True)
    print(f"{'case':30} {'to GPU':>8} {'from GPU':>9} {'matmul TFLOP/s':>15}")
    print(f"{'each way alone':30} {r['up']:8.1f} {r['down']:9.1f}")
    print(f"{'matmuls alone':30} {'':8} {'':9} {r['mm']:15.0f}")
    print(f"{'both ways at once':30} {r['up2']:8.1f} {r['down2']:9.1f} {'':15}   ratios {r['up2'] / r['up']:.2f} "
          f"{r['down2'] / r['down']:.2f}")
    print(f"{'both ways beside matmuls':30} {r['up3']:8.1f} {r['down3']:9.1f} {r['mm3']:15.0f}   ratios "
          f"{r['up3'] / r['up']:.2f} {r['down3'] / r['down']:.2f} {r['mm3'] / r['mm']:.2f}")


if __name__ == "__main__":
    main()
