"""``tiermem probe``: measure every link of this machine, through tiermem and raw, in the same run.

Rows: arena -> GPU and GPU -> arena (against a plain pinned torch copy), the link both ways at once and
matmuls beside it (ratios to the rates alone: the cost model's duplex and copy drag), NVMe tier -> arena and arena
-> NVMe tier for each usable backend (against plain O_DIRECT ``os.preadv``/``os.pwritev`` on the same
file), NVMe -> GPU through kvikio, the disk both ways at once (the cost model's ``nvme_both``), arena setup
(create + cudaHostRegister) against a ``pin_memory=True`` allocation, and the CPU AdamW rate (torch fused AdamW,
all cores). The planner reads the saved JSON.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import psutil
import torch

from tiermem.plan.machine import adamw_rate, copy_rate, cpu_share_beside_copies, disk_rates, link_both_ways
from tiermem.sizes import format_size
from tiermem.tiers import registry
from tiermem.tiers.dram import DramArena
from tiermem.tiers.gpu import GpuTier
from tiermem.tiers.nvme import NvmeTier
from tiermem.tiers.nvme_kvikio import kvikio_usable
from tiermem.transfer.mover import Location, Mover

RAW_BLOCK = 64 << 20


def _paired_rates(ours, raw, nbytes: int, reps: int, before=None) -> tuple[float, float | None]:
    """Median GB/s of ``ours`` and ``raw``, timed alternately so drift of the link hits both alike.

    ``raw`` may raise OSError (no O_DIRECT on this filesystem): then its rate is None.
    """
    t_ours, t_raw = [], []
    for _ in range(reps):
        for fn, times in ((ours, t_ours), (raw, t_raw)):
            if times is None:
                continue
            if before is not None:
                before()  # untimed
            t0 = time.perf_counter()
            try:
                fn()
            except OSError:
                if fn is not raw:
                    raise
                t_raw = None
                continue
            times.append(time.perf_counter() - t0)
    rate = lambda ts: nbytes / statistics.median(ts) / 1e9
    return rate(t_ours), (rate(t_raw) if t_raw else None)


def _row(link: str, ours: float | None, raw: float | None, unit: str = "GB/s", note: str = "",
         raw_what: str = "") -> dict:
    ratio = ours / raw if ours is not None and raw else None
    return {"link": link, "tiermem": ours, "raw": raw, "ratio": ratio, "unit": unit, "note": note,
            "raw_is": raw_what}


def probe_gpu(arena: DramArena, size: int, reps: int) -> list[dict]:
    if not torch.cuda.is_available():
        return [_row("arena -> GPU", None, None, note="no CUDA on this machine"),
                _row("GPU -> arena", None, None, note="no CUDA on this machine")]
    dev = torch.device("cuda")
    gpu = GpuTier(dev, size, 0, 0)
    host, device = _names(arena, gpu)
    mover = Mover({device: gpu, host: arena})
    src = Location(host, arena.allocate(size), size)
    dst = Location(device, gpu.allocate(size), size)
    arena.view(src.extent).random_(0, 255)
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    g = gpu.view(dst.extent)
    ours_h2d = lambda: mover.copy(src, dst).result()
    ours_d2h = lambda: mover.copy(dst, src).result()

    def raw_h2d():
        g.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()

    def raw_d2h():
        pinned.copy_(g, non_blocking=True)
        torch.cuda.synchronize()

    for fn in (ours_h2d, ours_d2h, raw_h2d, raw_d2h):  # warm up
        fn()
    h2d, rh = _paired_rates(ours_h2d, raw_h2d, size, reps)
    d2h, rd = _paired_rates(ours_d2h, raw_d2h, size, reps)
    mover.close()
    arena.free(src.extent)
    gpu.close()
    return [_row("arena -> GPU", h2d, rh, raw_what="pinned torch copy"),
            _row("GPU -> arena", d2h, rd, raw_what="pinned torch copy")]


def probe_link_both_ways(size: int, reps: int) -> list[dict]:
    """The link both ways at once, against each way alone, and bf16 matmuls beside copies both ways (the cost
    model's ``duplex`` and ``copy_drag``): ratios to the rates alone."""
    names = ("arena <-> GPU, both ways at once", "matmuls beside copies both ways")
    if not torch.cuda.is_available():
        return [_row(n, None, None, unit="x alone", note="no CUDA on this machine") for n in names]
    r = link_both_ways(torch.device("cuda"), size, reps, matmuls=True)
    share = min(r["up2"] / r["up"], r["down2"] / r["down"])
    return [_row(names[0], share, None, unit="x alone",
                 note=f"to the GPU {r['up2']:.1f} of {r['up']:.1f} GB/s, from it {r['down2']:.1f} of {r['down']:.1f}"),
            _row(names[1], r["mm3"] / r["mm"], None, unit="x alone",
                 note=f"bf16 matmuls {r['mm3']:.0f} of {r['mm']:.0f} TFLOP/s beside copies at {r['up3']:.1f} and "
                      f"{r['down3']:.1f} GB/s")]


def _drop_cache(path: Path) -> None:
    """Flush and evict the file's pages, so a read measures the disk, not the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _synced(fn, paths: list):
    """``fn`` then fsync: a write counts only once it is on the disks."""
    def run():
        fn()
        for p in paths:
            _drop_cache(p)
    return run


def _raw_striped(paths: list, buf: torch.Tensor, write: bool) -> None:
    """Raw O_DIRECT I/O of ``buf``'s bytes over ``paths``, each file its share, all at once (a thread each): what
    the disks give together."""
    if len(paths) == 1:
        return _raw_direct(paths[0], buf, write)
    share = -(-buf.numel() // len(paths) // RAW_BLOCK) * RAW_BLOCK
    parts = [buf[i * share:(i + 1) * share] for i in range(len(paths))]
    with cf.ThreadPoolExecutor(len(paths)) as pool:
        list(pool.map(lambda pb: _raw_direct(pb[0], pb[1], write), zip(paths, parts)))


def _raw_direct(path: Path, buf: torch.Tensor, write: bool) -> None:
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    try:
        mv = memoryview(buf.numpy())
        op = os.pwritev if write else os.preadv
        for off in range(0, len(mv), RAW_BLOCK):
            piece = mv[off: off + RAW_BLOCK]
            done = 0
            while done < len(piece):
                done += op(fd, [piece[done:]], off + done)
    finally:
        os.close(fd)


def probe_nvme(arena: DramArena, directory: Path | list, size: int, reps: int, name: str) -> list[dict]:
    """The disk through the storage tier (each backend) against raw O_DIRECT I/O of the same bytes; ``directory``
    a list: the tier striped over them, against raw I/O of each disk at once."""
    dirs = directory if isinstance(directory, list) else [directory]
    if len(dirs) == 1:
        directory = dirs[0]
    rows = []
    usable, why = kvikio_usable(dirs[0])
    backends = ["posix"] + (["kvikio"] if usable else [])
    host = _names(arena)[0]
    buf_loc = Location(host, arena.allocate(size), size)
    buf = arena.view(buf_loc.extent)
    buf.random_(0, 255)
    for backend in backends:
        tier = NvmeTier(directory, f"{name}-{backend}", size, backend=backend)
        drop = lambda: [_drop_cache(p) for p in tier.paths]
        try:
            disk = _names(tier)[0]
            mover = Mover({host: arena, disk: tier})
            loc = Location(disk, tier.allocate(size), size)
            w, rw = _paired_rates(_synced(lambda: mover.copy(buf_loc, loc).result(), tier.paths),
                                  _synced(lambda: _raw_striped(tier.paths, buf, True), tier.paths), size, reps)
            r, rr = _paired_rates(lambda: mover.copy(loc, buf_loc).result(),
                                  lambda: _raw_striped(tier.paths, buf, False), size, reps, before=drop)
            raw_ok = rw is not None
            note = f"{backend}: {tier.backend.reason}"
            raw_what = "O_DIRECT preadv/pwritev, 64 MiB blocks" if raw_ok else "n/a: no O_DIRECT here"
            rows += [_row(f"arena -> NVMe ({backend})", w, rw, note=note, raw_what=raw_what),
                     _row(f"NVMe -> arena ({backend})", r, rr, note=note, raw_what=raw_what)]
            if backend == "kvikio" and torch.cuda.is_available():
                gpu = GpuTier(torch.device("cuda"), size, 0, 0)
                device = _names(gpu)[0]
                m2 = Mover({device: gpu, host: arena, disk: tier})
                g = Location(device, gpu.allocate(size), size)
                rg, rr = _paired_rates(lambda: m2.copy(loc, g).result(),
                                       lambda: _raw_striped(tier.paths, buf, False), size, reps, before=drop)
                rows.append(_row("NVMe -> GPU (kvikio)", rg, rr, note=note, raw_what=raw_what))
                m2.close()
                gpu.close()
            mover.close()
        finally:
            tier.close()
    if not usable:
        rows.append(_row("NVMe (kvikio)", None, None, note=why))
    arena.free(buf_loc.extent)
    both = disk_rates(str(directory))  # (its gain both ways; the rates alone are the rows above)
    note = ("O_DIRECT, 256 MiB each way at once (a thread each): the same bytes one direction after the other "
            "at the rates alone, over the time both took")
    rows.append(_row("disk both ways", both.get("nvme_both"), None, unit="x one way after the other", note=note))
    return rows


def _names(*tiers) -> list[str]:
    """The registered name of each tier's class (the names its links are accounted under)."""
    return [next(n for n in registry.names() if registry.tier_type(n) is type(t)) for t in tiers]


def pin_memory_baseline(size: int) -> float | None:
    """Seconds a ``pin_memory=True`` allocation of ``size`` takes (measured on up to 4 GiB, scaled).

    Measured once per process: torch's caching host allocator would hand a second one out for free.
    """
    if not torch.cuda.is_available():
        return None
    baseline = min(size, 4 << 30)
    t0 = time.perf_counter()
    t = torch.empty(baseline, dtype=torch.uint8, pin_memory=True)
    seconds = (time.perf_counter() - t0) * size / baseline
    del t
    return seconds


def probe_arena_setup(directory: Path | str, size: int, name: str, raw: float | None) -> list[dict]:
    pin = torch.cuda.is_available()
    t0 = time.perf_counter()
    arena = DramArena.create(f"{name}-setup", size, str(directory), pin=pin)
    total = time.perf_counter() - t0
    reg, touch = arena.register_seconds, arena.touch_seconds
    arena.close()
    if pin:
        note = (f"{format_size(size)} in {directory}: create {total - reg - touch:.2f} s, touch pages {touch:.2f} s, "
                f"cudaHostRegister {reg:.2f} s; raw: pin_memory=True of up to 4 GiB, scaled")
    else:  # (an arena is touched and registered only to be pinned: those figures were not measured)
        note = (f"{format_size(size)} in {directory}: create only; touch pages and cudaHostRegister not measured: "
                "no CUDA (the arena is not pinned)")
    label = "arena setup" + (" (anonymous)" if str(directory) == "anonymous" else "")
    row = _row(label, total, raw, unit="s", note=note, raw_what="")
    row["ratio"] = raw / total if raw else None  # > 1: faster than the baseline
    return [row]


def probe_adamw(n_params: int = 1 << 26, steps: int = 5) -> list[dict]:
    """CPU AdamW and its compute copy as a run's quick probe measures them (``tiermem.plan.machine``)."""
    rate, what, threads = adamw_rate(n_params, steps)
    if what == "foreach":
        what = "foreach (fused not available on CPU in this torch)"
    copy = copy_rate(n_params, steps)
    rows = [_row("CPU AdamW", rate / 1e9, None, unit="G params/s",
                 note=f"torch {what}, {threads} threads, {n_params / 1e6:.0f}M params, median of {steps} steps"),
            _row("CPU compute copy", copy / 1e9, None, unit="G params/s",
                 note=f"fp32 -> bf16 after each CPU update (master weights), {threads} threads")]
    if torch.cuda.is_available():
        share = cpu_share_beside_copies(torch.device("cuda"), n_params, steps)
        rows.append(_row("CPU update beside copies both ways", share, None, unit="x alone",
                         note="AdamW + compute copy while pinned copies run to and from the GPU (a run's cpu_in_run)"))
    return rows


def probe_gpu_adamw(n_params: int = 1 << 28, steps: int = 5) -> list[dict]:
    """Parameters a second torch's fused AdamW updates on the GPU (the optimizer's in-place update of state
    that lives in HBM)."""
    if not torch.cuda.is_available():
        return [_row("GPU AdamW", None, None, unit="G params/s", note="no CUDA on this machine")]
    p = torch.nn.Parameter(torch.randn(n_params, device="cuda"))
    p.grad = torch.randn(n_params, device="cuda")
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    opt.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    torch.cuda.synchronize()
    rate = n_params * steps / (time.perf_counter() - t0) / 1e9
    del opt, p
    torch.cuda.empty_cache()
    return [_row("GPU AdamW", rate, None, unit="G params/s", note=f"torch fused, {n_params / 1e6:.0f}M params")]


def run_probe(size: int, nvme_path: str | list | None, arena_dir: str = "/dev/shm", reps: int = 3,
              arena_size: int | None = None) -> dict:
    """Every row of ``tiermem probe`` and the machine's sizes; ``nvme_path``: a directory (or a list of them, one per
    disk, measured striped together as a tier over them reads and writes) to measure the disk in."""
    if isinstance(nvme_path, str):
        nvme_path = [nvme_path]
    name = f"tiermem-probe-{os.getpid()}"
    rows: list[dict] = []
    pin = torch.cuda.is_available()
    arena = DramArena.create(name, 2 * size + (8 << 20), arena_dir, pin=pin)
    try:
        rows += probe_gpu(arena, size, reps)
        rows += probe_link_both_ways(size, reps)
        if nvme_path:
            rows += probe_nvme(arena, [Path(d) for d in nvme_path], size, reps, name)
        else:
            with tempfile.TemporaryDirectory(dir=".", prefix=".tiermem-probe-") as d:
                rows += probe_nvme(arena, Path(d), size, reps, name)
    finally:
        arena.close()
    raw = pin_memory_baseline(arena_size or size)
    rows += probe_arena_setup(arena_dir, arena_size or size, name, raw)
    if arena_dir != "anonymous":
        rows += probe_arena_setup("anonymous", arena_size or size, name, raw)
    rows += probe_adamw()
    rows += probe_gpu_adamw()
    machine = _machine()
    if nvme_path:  # (striped evenly: the fullest disk bounds each directory's share)
        machine["disk_free"] = min(shutil.disk_usage(d).free for d in nvme_path) * len(nvme_path)
    return {"machine": machine, "size": size, "rows": rows}


def _machine() -> dict:
    """What the planner reads besides the rows: the memory sizes (and what the machine is)."""
    info = {"cpus": os.cpu_count(), "torch": torch.__version__, "ram": psutil.virtual_memory().total}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_memory"] = torch.cuda.get_device_properties(0).total_memory
    return info


def save(result: dict, path: str) -> None:
    """Write ``result`` as a machine file (``tiermem.plan.machine_file``: what ``tiermem plan --machine`` reads),
    its rows kept beside (``tiermem top --probe``); JSON where ``path`` ends in .json, else YAML."""
    import json

    import yaml

    from tiermem.plan.machine import Machine
    from tiermem.plan.machine_file import describe

    m = Machine.from_probe_data(result, f"probe {path}", path)
    if m.disk_free is None:  # (the disk measured in a temporary directory here)
        m.disk_free = shutil.disk_usage(".").free
    info = result.get("machine", {})
    about = (f"measured by tiermem probe: {info.get('gpu', 'no GPU')}, {info.get('cpus')} cores; "
             f"gpu.bf16_tflops and a figure in `assumed` of a plan are the H200's: set them for another GPU")
    data = describe(m, Path(path).stem, about, info.get("cpus") or os.cpu_count() or 1, result["rows"],
                    result["size"])
    text = json.dumps(data, indent=1) if str(path).endswith(".json") else yaml.safe_dump(data, sort_keys=False)
    Path(path).write_text(text)


def render(result: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    # (the title at the left and the terminal's own width: a title centred in a wider console than the terminal
    # starts the output with lines of spaces)
    table = Table(title=f"tiermem probe ({format_size(result['size'])} transfers)", title_justify="left")
    for col in ("link", "tiermem", "raw", "ratio", "note"):
        table.add_column(col, justify="right" if col in ("tiermem", "raw", "ratio") else "left")
    for r in result["rows"]:
        fmt = (lambda v: "-" if v is None else f"{v:.2f} {r['unit']}")
        table.add_row(r["link"], fmt(r["tiermem"]), fmt(r["raw"]),
                      "-" if r["ratio"] is None else f"{r['ratio']:.2f}",
                      escape(r["note"] + (f" (raw: {r['raw_is']})" if r["raw_is"] else "")))
    Console().print(table)
