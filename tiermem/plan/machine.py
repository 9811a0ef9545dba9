"""The machine's figures the planner works from: each link's rate, the CPU's AdamW rate, the memory sizes.

    m = Machine.from_probe("probe.json")        # an earlier `tiermem probe --save` JSON file (its rows)
    m = load_machine("configs/machines/h200-1.5tb.yaml")   # a machine file (tiermem.plan.machine_file)
    m = Machine.measure(nvme_path)              # a quick probe of this machine (a few seconds)
    m = machine_for(store_cfg, device, probe)   # the run's: its probe file, else a quick probe on CUDA, else assumed
    m = Machine.h200()                          # the H200 machine's figures (docs/measurements.md), said so

Every figure a source lacks is taken from the H200 machine's and named in ``assumed``, so a plan always
says what it did not measure. Rates are bytes (or parameters) per second.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import torch

from tiermem.errors import ConfigError
from tiermem.tiers.base import STORAGE

GB = 1e9

# the H200 machine (docs/measurements.md): what a plan assumes for a figure it did not measure
H200 = {
    "h2d": 54.6 * GB, "d2h": 54.6 * GB,  # arena <-> GPU, pinned
    "nvme_read": 1.74 * GB, "nvme_write": 2.48 * GB,  # O_DIRECT, posix backend, 64 MiB blocks
    "cpu_adamw": 4.0e9,  # params/s, torch fused AdamW on 14 threads
    # params/s of the CPU worker's compute copy after an update (fp32 master -> bf16 params): the 8B run's
    # worker copied 4.2 G params in 0.52 s on 12 threads
    "cpu_copy": 8.0e9,
    # the CPU worker's rates while the PCIe link copies both ways (as in a run, where the link moves the streamed
    # groups' weights and gradients beside its updates), of its rates alone: the 8B runs' CPU worker updated at
    # 0.71 and 0.78 of the probe's figures
    "cpu_in_run": 0.75,
    # the disk's reads and writes at once: the time the same bytes take one direction after the other at the rates
    # alone, over the time they take both ways at once (1: the disk serves one direction at a time; 2: both at
    # their full rates). The H200 machine's virtio disk is one of the first kind: the 14B run's steady update read
    # 60.2 GB and wrote 60.2 GB in 65-69 s (2 s samples), which its quick probe's rates alone (1.80, 2.05 GB/s)
    # move one direction after the other in 62.8 s
    "nvme_both": 0.94,
    "gpu_adamw": 1.0e11,  # params/s of torch's fused AdamW on the GPU (memory-bound: ~28 B a param at ~3 TB/s)
    "gpu_tflops": 520e12,  # FLOP/s of a streamed step counting its recompute (389 TFLOP/s by the 6·N count)
    # FLOP/s of attention's two matmuls (flash/efficient SDPA, causal) in a streamed step counting its recompute,
    # when it is not timed: as the layers' (a machine file may say otherwise: docs/machines.md)
    "gpu_attention_tflops": 520e12,
    "gpu_peak": 989e12,  # the GPU's dense bf16 FLOP/s by its datasheet (H100/H200 SXM): what MFU divides by
    "gpu_memory": 143_771 << 20, "ram": 125 << 30,
    # the link both ways at once: each direction's share of its rate alone, and the compute's slowdown while
    # both copy (tools/probe_duplex.py, `tiermem probe`: 0.92, and matmuls at 0.94)
    "duplex": 0.92, "copy_drag": 0.06,
    # the GPU's time each pass of a step beyond the first costs, for each group whose gradient is summed outside HBM
    # (its partial sums go home and come back), beyond the link's time for those bytes: the 14B runs' compute at 32
    # and 54 passes (28 layers and the head streamed) and tools/profile_step.py --passes (8 of its layers, every kind
    # in DRAM): 12.6-13.3 ms a group and pass (docs/measurements.md, "After the pass cost")
    "pass_cost": 0.013,
    # parameters a second of a decoder layer's cost each piece (micro-batch) beyond its FLOPs: its bf16 weight
    # gradient added into the fp32 sum, and whatever else does not shrink with a piece's tokens. Fitted to the 14B
    # runs at 2048- and 8192-token pieces and the 8B's at 4096 (2.0 ms a piece of the 14B's 275 M-parameter layer)
    "gpu_piece_rate": 140e9,
    # a sparse (mixture-of-experts) layer's routed experts, grouped matmuls over the tokens each expert is sent
    # (the estimate's; a plan timed on the GPU times them): the FLOP/s their matmuls reach counting the recompute, in
    # place of gpu_tflops for the experts' share of a token's FLOPs; the parameters a second of their cost each piece
    # whatever its tokens (every expert's weights read by the grouped matmuls, every expert's gradient summed into the
    # fp32 sum), in place of gpu_piece_rate for the experts' share of the layer; and the routing's rate, below. Fitted
    # to gpt-oss-120B's layer through the template at 4096- and 8192-token pieces and Qwen3-30B-A3B's through the
    # generic path (docs/measurements.md, "gpt-oss measured")
    "gpu_expert_tflops": 236e12,
    "gpu_expert_piece_rate": 174e9,
    # elements a second of the routing's own work: each (token, expert) row of 2 I + H elements (the token gathered
    # in, the expert's activation, its output weighted and scattered back), forward, recompute and backward
    "gpu_expert_route_rate": 20e9,
}


@dataclass
class Machine:
    h2d: float
    d2h: float
    nvme_read: float
    nvme_write: float
    cpu_adamw: float
    gpu_adamw: float
    gpu_tflops: float  # dense compute a streamed layer reaches (FLOP/s), when it is not timed
    gpu_memory: int  # bytes of HBM
    ram: int  # bytes of host memory
    cpu_copy: float = H200["cpu_copy"]  # params/s of the CPU worker's fp32 -> bf16 compute copy
    cpu_in_run: float = H200["cpu_in_run"]  # its rates beside the link's copies, of its rates alone
    nvme_both: float = H200["nvme_both"]  # the disk both ways at once, of one direction after the other
    duplex: float = H200["duplex"]  # each direction's rate while the other copies, of its rate alone
    gpu_peak: float = H200["gpu_peak"]  # the GPU's dense bf16 FLOP/s (datasheet), for MFU
    gpu_attention_tflops: float = H200["gpu_attention_tflops"]  # attention's FLOP/s, when it is not timed
    copy_drag: float = H200["copy_drag"]  # the compute's slowdown while the link copies both ways
    pass_cost: float = H200["pass_cost"]  # seconds a group summed outside HBM costs each pass beyond the first
    gpu_piece_rate: float = H200["gpu_piece_rate"]  # params/s of a layer's fixed cost each piece (not timed)
    gpu_expert_tflops: float = H200["gpu_expert_tflops"]  # FLOP/s of a sparse layer's routed experts a token
    gpu_expert_piece_rate: float = H200["gpu_expert_piece_rate"]  # params/s of their cost each piece
    gpu_expert_route_rate: float = H200["gpu_expert_route_rate"]  # elements/s of the routing's own work
    disk_free: int | None = None  # bytes free on the NVMe tier's disk, where the probe saw it
    source: str = "assumed"
    assumed: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, o: dict) -> Machine:
        """The figures ``to_json`` wrote (the service's, sent to its trainer; a run's tiermem_plan.json). A figure
        an earlier version did not write is the H200's, said to be assumed."""
        o = dict(o)
        earlier = ("nvme_read_beside", "nvme_write_beside")  # (the disk's figures of a plan of an earlier version)
        shares = [o.pop(k, None) for k in earlier]
        measured = not set(earlier) & set(o.get("assumed", []))
        if "nvme_both" not in o and None not in shares and measured:
            o["nvme_both"] = both_from_shares(o["nvme_read"], o["nvme_write"], *shares)
        o["assumed"] = [k for k in o.get("assumed", []) if k not in earlier]
        missing = [k for k in H200 if k not in o]
        for k in missing:
            o[k] = H200[k]
        o["assumed"] = sorted({*o.get("assumed", []), *missing})
        return cls(**o)

    @classmethod
    def h200(cls, note: str = "assumed: the H200 machine's figures") -> Machine:
        return cls(**H200, source=note, assumed=sorted(k for k in H200 if k not in ("ram",)))

    @classmethod
    def from_probe(cls, path: str | Path) -> Machine:
        """Figures from a ``tiermem probe --save`` file; refused in one line when it is not one."""
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"probe file {path} not found; make one with `tiermem probe --save {path}`") from None
        except (OSError, ValueError) as e:
            raise ConfigError(f"probe file {path} is not a `tiermem probe --save` file ({type(e).__name__}); "
                              f"make one with `tiermem probe --save {path}`") from None
        return cls.from_probe_data(data, f"the one the probe file {path} describes", str(path))

    @classmethod
    def from_probe_data(cls, data, source: str, path: str = "FILE") -> Machine:
        """Figures from what ``tiermem probe`` measured (its rows and machine sizes)."""
        try:
            rows = {r["link"]: r for r in data["rows"]}
            machine = dict(data.get("machine") or {})
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"probe file {path} is not a `tiermem probe --save` file ({type(e).__name__}); "
                              f"make one with `tiermem probe --save {path}`") from None
        got: dict[str, float] = {}

        def rate(name: str, scale: float) -> float | None:
            r = rows.get(name)
            v = r.get("tiermem") if isinstance(r, dict) else None
            return float(v) * scale if isinstance(v, (int, float)) and v > 0 else None

        pairs = {"h2d": rate("arena -> GPU", GB), "d2h": rate("GPU -> arena", GB),
                 "nvme_read": rate("NVMe -> arena (kvikio)", GB) or rate("NVMe -> arena (posix)", GB),
                 "nvme_write": rate("arena -> NVMe (kvikio)", GB) or rate("arena -> NVMe (posix)", GB),
                 "cpu_adamw": rate("CPU AdamW", 1e9), "cpu_copy": rate("CPU compute copy", 1e9),
                 "gpu_adamw": rate("GPU AdamW", 1e9)}
        for k, v in pairs.items():
            if v is not None:
                got[k] = v
        share = rate("arena <-> GPU, both ways at once", 1.0)  # (ratios to the rates alone)
        if share is not None and share <= 1.5:
            got["duplex"] = min(share, 1.0)  # (never faster than alone: above 1 is the timing's noise)
        beside = rate("matmuls beside copies both ways", 1.0)
        if beside is not None and beside <= 1.5:
            got["copy_drag"] = max(0.0, 1.0 - beside)
        both = rate("disk both ways", 1.0)
        shares = rate("disk read beside writes", 1.0), rate("disk write beside reads", 1.0)  # (an earlier version's)
        if both is None and None not in shares and "nvme_read" in got and "nvme_write" in got:
            both = both_from_shares(got["nvme_read"], got["nvme_write"], *shares)
        if both is not None:
            got["nvme_both"] = min(max(both, BOTH_RANGE[0]), BOTH_RANGE[1])
        cpu_beside = rate("CPU update beside copies both ways", 1.0)
        if cpu_beside is not None and cpu_beside <= 1.5:
            got["cpu_in_run"] = min(cpu_beside, 1.0)
        for k in ("gpu_memory", "ram"):
            if isinstance(machine.get(k), int) and machine[k] > 0:
                got[k] = machine[k]
        figures = {**H200, **got}
        disk = machine.get("disk_free")
        return cls(**figures, disk_free=disk if isinstance(disk, int) and disk > 0 else None,
                   source=source, assumed=sorted(k for k in H200 if k not in got))

    @classmethod
    def measure(cls, nvme_dir: str | None = None, device: torch.device | None = None) -> Machine:
        """A quick probe of this machine (a few seconds): the PCIe link each way, the disk under
        ``nvme_dir`` (when given) each way, CPU AdamW and its compute copy, the memory sizes. Without CUDA the
        GPU's figures are assumed."""
        figures: dict = {"ram": psutil.virtual_memory().total}
        if device is not None and device.type == "cuda":
            figures["gpu_memory"] = torch.cuda.get_device_properties(device).total_memory
            figures.update(_pcie(device))
        if nvme_dir:
            figures.update(disk_rates(nvme_dir))
        if device is not None and device.type == "cuda":
            figures["duplex"] = duplex_share(device)
            figures["cpu_in_run"] = cpu_share_beside_copies(device)
        figures["cpu_adamw"] = adamw_rate()[0]
        figures["cpu_copy"] = copy_rate()
        merged = {**H200, **figures}
        return cls(**merged, source="measured at start (a quick probe; `tiermem probe --save` for a full one)",
                   assumed=sorted(k for k in H200 if k not in figures))


def _pcie(device: torch.device, size: int = 256 << 20) -> dict:
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(size, dtype=torch.uint8, device=device)
    out = {}
    for key, (dst, src) in {"h2d": (dev, host), "d2h": (host, dev)}.items():
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        best = math.inf
        for _ in range(4):  # (the fastest: whatever else runs meanwhile only slows a copy down)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        out[key] = size / best
    return out


def link_both_ways(device: torch.device, size: int, reps: int, matmuls: bool = False) -> dict:
    """GB/s of the PCIe link each way alone and both ways at once (pinned torch copies on their own streams,
    timed by CUDA events); with ``matmuls``, also both ways beside bf16 8192² matmuls on a third stream, and
    the matmuls' TFLOP/s alone and beside them. Keys: up, down (alone); up2, down2 (at once); up3, down3, mm,
    mm3 (beside matmuls)."""
    host_in = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dev_in = torch.empty(size, dtype=torch.uint8, device=device)
    dev_out = torch.empty(size, dtype=torch.uint8, device=device)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) if matmuls else None
    streams = {k: torch.cuda.Stream(device) for k in ("up", "down", "mm")}

    def run(up: bool, down: bool, mm: bool) -> dict:
        torch.cuda.synchronize(device)
        ev = {k: (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for k in streams}
        n_mm = 0
        for key, on in (("up", up), ("down", down), ("mm", mm)):
            if not on:
                continue
            with torch.cuda.stream(streams[key]):
                ev[key][0].record()
                if key == "mm":  # (for about as long as the copies take)
                    n_mm = max(1, int(40 * reps * size / (1 << 30)))
                    for _ in range(n_mm):
                        a @ a
                else:
                    for _ in range(reps):
                        (dev_in.copy_(host_in, non_blocking=True) if key == "up"
                         else host_out.copy_(dev_out, non_blocking=True))
                ev[key][1].record()
        torch.cuda.synchronize(device)
        secs = {k: ev[k][0].elapsed_time(ev[k][1]) / 1e3 for k, on in (("up", up), ("down", down), ("mm", mm))
                if on}
        out = {k: size * reps / secs[k] / 1e9 for k in ("up", "down") if k in secs}
        if "mm" in secs:
            out["mm"] = n_mm * 2 * 8192 ** 3 / secs["mm"] / 1e12
        return out

    run(True, True, matmuls)  # (warm-up)
    got = {"up": run(True, False, False)["up"], "down": run(False, True, False)["down"]}
    both = run(True, True, False)
    got.update(up2=both["up"], down2=both["down"])
    if matmuls:
        got["mm"] = run(False, False, True)["mm"]
        beside = run(True, True, True)
        got.update(up3=beside["up"], down3=beside["down"], mm3=beside["mm"])
    return got


def duplex_share(device: torch.device, size: int = 256 << 20) -> float:
    """Each direction's share of its rate alone while the other copies (the lesser of the two)."""
    r = link_both_ways(device, size, 2)
    return min(r["up2"] / r["up"], r["down2"] / r["down"], 1.0)


def both_from_shares(read: float, write: float, read_share: float, write_share: float) -> float:
    """``nvme_both`` from each direction's rate at once as a share of its rate alone (as earlier versions measured
    the disk both ways): equal bytes each way take 1/read + 1/write one after the other, and as long as the
    slower direction at once."""
    return (1 / read + 1 / write) / max(1 / (read * read_share), 1 / (write * write_share))


BOTH_RANGE = (0.5, 2.0)  # what ``nvme_both`` may be (beyond: the timing's noise)


def disk_rates(directory, size: int = 256 << 20, block: int = 16 << 20) -> dict:
    """The disks under ``directory``: one directory (``_disk_rates``), or a list of them (a striped storage tier:
    each measured at the same time, a thread each, their rates added up, as the tier's stripes run)."""
    if not isinstance(directory, (list, tuple)):
        return _disk_rates(directory, size, block)
    if len(directory) == 1:
        return _disk_rates(directory[0], size, block)
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(len(directory)) as pool:
        each = list(pool.map(lambda d: _disk_rates(d, size, block), directory))
    if not all(each):
        return {}
    return {"nvme_read": sum(e["nvme_read"] for e in each), "nvme_write": sum(e["nvme_write"] for e in each),
            "nvme_both": sum(e["nvme_both"] for e in each) / len(each)}


def _disk_rates(directory: str, size: int = 256 << 20, block: int = 16 << 20) -> dict:
    """The disk under ``directory`` (O_DIRECT where allowed, ``size`` bytes each way in ``block`` pieces, in a
    temporary file): its write and read rates alone (``nvme_write``, ``nvme_read``), then both at once, a thread
    each, as the optimizer's staging reads and write-backs run in a step: ``nvme_both``, the time the two take one
    after the other at the rates alone over the time they took at once. Empty where the directory cannot be
    written."""
    import mmap
    import threading

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f".tiermem-plan-probe-{os.getpid()}")
    bufs = [mmap.mmap(-1, block) for _ in range(2)]  # (page-aligned, as O_DIRECT needs)
    for b in bufs:
        b.write(os.urandom(block))
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
        except OSError:  # no O_DIRECT on this filesystem
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            def write(start: int) -> float:
                t0 = time.perf_counter()
                for off in range(start, start + size, block):
                    os.pwritev(fd, [bufs[1]], off)
                os.fdatasync(fd)
                return time.perf_counter() - t0

            def read() -> float:
                os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
                t0 = time.perf_counter()
                for off in range(0, size, block):
                    os.preadv(fd, [bufs[0]], off)
                return time.perf_counter() - t0

            w_alone = write(0)  # (the first half, read back below)
            r_alone = read()
            t = threading.Thread(target=lambda: write(size))
            t0 = time.perf_counter()
            t.start()
            read()
            t.join()
            at_once = time.perf_counter() - t0
        finally:
            os.close(fd)
    except OSError:
        return {}
    finally:
        for b in bufs:
            b.close()
        try:
            os.unlink(path)
        except OSError:
            pass
    both = (w_alone + r_alone) / at_once if at_once > 0 else 1.0
    return {"nvme_read": size / r_alone, "nvme_write": size / w_alone,
            "nvme_both": min(max(both, BOTH_RANGE[0]), BOTH_RANGE[1])}


def worker_threads() -> int:
    """The CPU worker's threads (``tiermem.optim`` takes as many; the CPU figures are measured on as many): env
    TIERMEM_OPTIM_THREADS, else all cores but two (for the trainer's thread and the copy lanes; a preempted
    thread stalls the whole parallel update)."""
    env = os.environ.get("TIERMEM_OPTIM_THREADS")
    if env:
        return max(1, int(env))
    n = os.cpu_count() or 1
    return n - 2 if n > 4 else n


def adamw_rate(n: int = 1 << 26, reps: int = 5) -> tuple[float, str, int]:
    """Parameters a second torch's AdamW updates on this CPU, on the optimizer's own threads (all cores but two,
    as ``tiermem.optim`` takes them): the median of ``reps`` steps over ``n`` parameters. Returns (rate, "fused"
    or "foreach", threads). ``n`` is large (64M params: 1 GiB of fp32 state) so the state does not fit in
    the CPU's caches: at 16M params the H200 host's quick probe read 8.9 G params/s, its full probe 3.97, and the
    8B plan built on the first waited 0.6-1.7 s a step for the CPU worker. The median rather than the fastest
    step, so a start with other work on the cores (the compile's workers) reads neither best nor worst."""
    threads, keep = worker_threads(), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        opt, _, what = _cpu_adamw(n)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        return n / statistics.median(times), what, threads
    finally:
        torch.set_num_threads(keep)


def _cpu_adamw(n: int):
    """torch's AdamW over one CPU parameter of ``n`` elements with its gradient, stepped once (its state made):
    (optimizer, parameter, "fused" or "foreach": fused where this torch has it on the CPU)."""
    p = torch.nn.Parameter(torch.full((n,), 0.5))
    p.grad = torch.full((n,), 1e-3)
    try:
        opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
        opt.step()
        return opt, p, "fused"
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW([p], lr=1e-4, foreach=True)
        opt.step()
        return opt, p, "foreach"


def copy_rate(n: int = 1 << 26, reps: int = 5) -> float:
    """Parameters a second the CPU worker's compute copy takes (an fp32 tensor into a bf16 one, as after each CPU
    update of a run with master weights), on the worker's threads: the median of ``reps`` copies of ``n``."""
    src, dst = torch.full((n,), 0.5), torch.empty(n, dtype=torch.bfloat16)
    return n / median_seconds_on_workers(lambda: dst.copy_(src), reps)


def median_seconds_on_workers(fn, reps: int) -> float:
    """Seconds ``fn()`` takes on the CPU worker's threads: the median of ``reps`` calls after one to warm up."""
    keep = torch.get_num_threads()
    torch.set_num_threads(worker_threads())
    try:
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        torch.set_num_threads(keep)


def cpu_share_beside_copies(device: torch.device, n: int = 1 << 26, reps: int = 5, size: int = 256 << 20) -> float:
    """The CPU worker's update (AdamW and the compute copy over ``n`` parameters, on its threads) while the PCIe
    link copies both ways, as its rate alone: the median of ``reps`` updates each way. The link's copies take
    the host's memory bandwidth that the update runs on."""
    threads, keep = worker_threads(), torch.get_num_threads()
    low = torch.empty(n, dtype=torch.bfloat16)
    hosts = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    devs = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2)]
    streams = [torch.cuda.Stream(device) for _ in range(2)]
    torch.set_num_threads(threads)
    try:
        opt, p, _ = _cpu_adamw(n)

        def update(copies: bool) -> float:
            torch.cuda.synchronize(device)
            if copies:  # (queued for longer than the update takes: 8 x 256 MiB each way is ~40 ms at 50 GB/s;
                for _ in range(8):  # the pinned buffers small, as torch's host allocator keeps them for the run)
                    with torch.cuda.stream(streams[0]):
                        devs[0].copy_(hosts[0], non_blocking=True)
                    with torch.cuda.stream(streams[1]):
                        hosts[1].copy_(devs[1], non_blocking=True)
            t0 = time.perf_counter()
            opt.step()
            low.copy_(p.detach())
            seconds = time.perf_counter() - t0
            torch.cuda.synchronize(device)
            return seconds

        alone = statistics.median(update(False) for _ in range(reps))
        beside = statistics.median(update(True) for _ in range(reps))
        return min(alone / beside, 1.0) if beside > 0 else 1.0
    finally:
        torch.set_num_threads(keep)


def machine_for(scfg, device: torch.device, probe: str | None = None) -> Machine:
    """The figures to plan with: the ``probe`` (or the config's ``probe``) file, a machine file or an earlier
    probe file; else a quick probe when this machine computes on CUDA; else the H200 machine's, said to be
    assumed. (A training run's and a service's: ``scfg`` is their tiermem StoreConfig.)"""
    path = probe or scfg.probe
    if path:
        from tiermem.plan.machine_file import load_machine  # (it builds on this module)

        m = load_machine(path)
        if device.type == "cuda":
            m.gpu_memory = torch.cuda.get_device_properties(device).total_memory
        return m
    if device.type == "cuda":  # (the disk measured: the first storage tier's, whose figures are the machine's)
        disk = next((getattr(scfg.tiers[t], "path", None) for t in scfg.tiers.of_role(STORAGE)), None)
        return Machine.measure(disk, device)
    return Machine.h200("the H200 machine's figures (no GPU here and no probe file: "
                        "`tiermem probe --save FILE` on the GPU machine, then --probe FILE)")
