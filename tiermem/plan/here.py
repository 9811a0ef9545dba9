"""This machine's own figures where it has no GPU, and every figure's name in words.

    m = cpu_machine(nvme_dir, gpu_budget)   # no CUDA here: the CPU stand-in's figures, measured now (< 1 s)
    in_words(m.assumed)                     # "the link both ways at once, compute beside copies, ..."

Without CUDA a run computes on the CPU stand-in of the GPU tier: its "GPU compute" is this CPU's matmuls, its
"PCIe" copies are memory copies, its GPU worker's AdamW is CPU AdamW, and its HBM is the stand-in's budget. A plan
for this machine takes those figures, not another machine's (``tiermem plan`` says which machine it plans for).
The measures are short (small sizes, a few repetitions): they say what this CPU does to within a factor, enough
for a plan of the CPU stand-in, whose first steps correct the prediction.
"""

from __future__ import annotations

import time

import psutil
import torch

from tiermem.plan.machine import H200, Machine, adamw_rate, copy_rate, disk_rates, median_seconds_on_workers

# what each of the machine's figures is, for people (a plan's "assumed" list, its source line)
WORDS = {"h2d": "the link to the GPU", "d2h": "the link from the GPU", "nvme_read": "the disk's reads",
         "nvme_write": "the disk's writes", "nvme_both": "the disk both ways at once", "cpu_adamw": "CPU AdamW",
         "cpu_copy": "the CPU's fp32-to-bf16 copy", "cpu_in_run": "CPU AdamW beside the link's copies",
         "gpu_adamw": "GPU AdamW", "gpu_tflops": "GPU compute", "gpu_memory": "the GPU's memory", "ram": "RAM",
         "duplex": "the link both ways at once", "copy_drag": "compute beside copies",
         "gpu_attention_tflops": "the GPU's attention compute", "gpu_peak": "the GPU's peak rate (MFU's divisor)",
         "pass_cost": "a pass's cost beyond the first", "gpu_piece_rate": "a layer's cost a piece",
         "gpu_expert_tflops": "the GPU's routed experts' compute", "gpu_expert_piece_rate": "the experts' cost a piece",
         "gpu_expert_route_rate": "the experts' routing"}


def in_words(keys) -> str:
    """The figures ``keys`` (a Machine's ``assumed``) named for people, in the order given."""
    return ", ".join(WORDS.get(k, k) for k in keys)


def cpu_machine(nvme_dir=None, gpu_budget: int | None = None) -> Machine:
    """This machine's figures for a run on the CPU stand-in: the CPU's matmul rate as its compute, memory copies as
    its link both ways, CPU AdamW (also the stand-in's GPU worker) and the compute copy on the optimizer's threads,
    the disk under ``nvme_dir`` (when given), RAM, and the stand-in's HBM (``gpu_budget``, else its default: a
    quarter of the available memory), a layer's cost a piece from the copy rate, no cost a pass. The link's and the
    disk's shares both ways at once and the compute beside copies are not measured (the H200's, said to be assumed)."""
    figures: dict = {"ram": psutil.virtual_memory().total, "gpu_tflops": matmul_rate(), **memcpy_rates()}
    figures["cpu_adamw"] = adamw_rate(1 << 22, 3)[0]
    figures["cpu_copy"] = copy_rate(1 << 22, 3)
    figures["gpu_adamw"] = figures["cpu_adamw"]
    figures["gpu_memory"] = gpu_budget or psutil.virtual_memory().available // 4
    figures["gpu_attention_tflops"] = figures["gpu_peak"] = figures["gpu_tflops"]  # (one rate: the CPU's matmuls)
    figures["gpu_expert_tflops"] = figures["gpu_tflops"]
    # (a layer's cost a piece: its gradient added into the fp32 sum, ~10 bytes a parameter at the memory's copy rate;
    # no pass costs more than its work here: the stand-in's thread computes what it waits for)
    figures["gpu_piece_rate"], figures["pass_cost"] = figures["h2d"] / 10, 0.0
    figures["gpu_expert_piece_rate"] = figures["gpu_piece_rate"]
    figures["gpu_expert_route_rate"] = figures["gpu_piece_rate"] * H200["gpu_expert_route_rate"] / H200[
        "gpu_piece_rate"]  # (the routing's rate to a piece's as on the H200)
    if nvme_dir:
        figures.update(disk_rates(nvme_dir, 64 << 20))
    return Machine(**{**H200, **figures}, source="this machine's own figures (no GPU here: the CPU stand-in computes; "
                   "measured now)", assumed=sorted(k for k in H200 if k not in figures))


def matmul_rate(n: int = 512, reps: int = 5) -> float:
    """FLOP/s of fp32 n x n matmuls on this CPU (the fastest of ``reps``: whatever else runs on the cores only slows
    one down), as the stand-in's compute."""
    a = torch.randn(n, n)
    a @ a
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ a
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / max(min(times), 1e-9)


def memcpy_rates(size: int = 32 << 20, reps: int = 3) -> dict:
    """Bytes/s of a memory copy (the stand-in's link, each way) on the optimizer's threads."""
    src, dst = torch.empty(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8)
    rate = size / max(median_seconds_on_workers(lambda: dst.copy_(src), reps), 1e-9)
    return {"h2d": rate, "d2h": rate}
