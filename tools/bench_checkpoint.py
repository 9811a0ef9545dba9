"""Benchmark: save and load a checkpoint of a Llama-3B-shape model, against the raw disk, in one run.

    python tools/bench_checkpoint.py [--layers 28] [--dir .ckpt-bench] [--raw-size 4GiB] [--rounds 2]

Fills a store (bf16 compute copy, fp32 master and moments, all in the DRAM arena) with random state,
then: raw disk write (64 MiB blocks, fsync) and read (page cache evicted first) of --raw-size; the
checkpoint save (trainer.outputs.saver.Saver: HF safetensors + zarr state, fsynced, renamed) without checksums,
with the CRC32Cs tiermem writes, and without again (the disk's speed drifts within a run: the first and last
are averaged); then, from the one checkpoint with checksums, --rounds rounds of three resumes in a rotating
order, each after the page cache is evicted and into a new store: "unchecked" (the same files, every
checksum check skipped: the baseline), "checked" (as tiermem-train resumes: the checkpoint checked, its
large files — the model's shards — on a thread from then on while the store opens and the state loads, each
state shard's CRC32C checked before use) and "model first" (the model's shards checked before the load
starts, as a trainer's start — tokenizing, planning, timing its layer — gives them time to be). Prints each
load, the medians, the ratios to the raw disk and what the checksums cost. When the disk cannot hold a 3B
checkpoint, fewer layers are used and the table says so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import SHAPE  # noqa: E402

from tiermem.sizes import parse_size  # noqa: E402
from tiermem.specs import state_name  # noqa: E402


def evict(path: Path) -> None:
    for p in [path] if path.is_file() else path.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def raw_disk(d: Path, size: int) -> tuple[float, float]:
    block = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes()
    f = d / "raw.bin"
    t0 = time.perf_counter()
    with f.open("wb") as fh:
        for _ in range(size // len(block)):
            fh.write(block)
        fh.flush()
        os.fsync(fh.fileno())
    w = size / (time.perf_counter() - t0) / 1e9
    evict(f)
    t0 = time.perf_counter()
    with f.open("rb") as fh:
        while fh.read(64 << 20):
            pass
    r = size / (time.perf_counter() - t0) / 1e9
    f.unlink()
    return w, r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--dir", default=".ckpt-bench")
    ap.add_argument("--raw-size", default="4GiB")
    ap.add_argument("--vocab", type=int, default=SHAPE["vocab_size"], help="smaller for a quick check")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the three resumes (medians are printed)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    from tiermem.store.store import Store
    from trainer.model.config import model_config_from_dict
    from trainer.model.weights import all_weights, group_order
    from trainer.outputs import checkpoint as ckpt
    from trainer.outputs.saver import Saver
    from trainer.state import state_specs, store_config

    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    layers = args.layers
    shape = dict(SHAPE, vocab_size=args.vocab)
    per_layer = model_config_from_dict(dict(shape, num_hidden_layers=1)).layer_params()
    fixed = model_config_from_dict(dict(shape, num_hidden_layers=1)).num_params() - per_layer
    free = shutil.disk_usage(d).free
    while layers > 1 and (fixed + layers * per_layer) * 14 * 1.05 > free * 0.9:
        layers -= 1
    raw = dict(shape, num_hidden_layers=layers)
    mcfg = model_config_from_dict(raw)
    model_dir = Path(tempfile.mkdtemp(prefix="tiermem-ckbench-"))
    (model_dir / "config.json").write_text(json.dumps(raw))
    n = mcfg.num_params()
    print(f"Llama-3B shape with {layers} layers: {n / 1e9:.2f} B params; disk free {free / 1e9:.1f} GB", flush=True)

    w_raw, r_raw = raw_disk(d, parse_size(args.raw_size, "--raw-size"))
    cuda = torch.cuda.is_available()
    scfg = store_config({"placement": {k: "dram" for k in ("param", "grad", "master", "exp_avg", "exp_avg_sq")},
                         "tiers": {"gpu": {"device": "cuda" if cuda else "cpu"}}})

    def open_store():
        return Store.open(scfg, state_specs(mcfg, torch.bfloat16), streamed_kinds=("param",))

    store = open_store()
    dev = torch.device("cuda" if cuda else "cpu")
    gen = torch.Generator(dev).manual_seed(0)
    for w in all_weights(mcfg):
        t = torch.randn(w.shape, device=dev, generator=gen)
        futs = [store.write(state_name(w.name, "param"), t.to(torch.bfloat16)),
                store.write(state_name(w.name, "master"), t)]
        futs += [store.write(state_name(w.name, k), t.abs() * 1e-3) for k in ("exp_avg", "exp_avg_sq")]
        for f in futs:
            f.result()
    for g in group_order(mcfg):
        store.catalog.bump(g, to=1)

    def save(checksums: bool) -> tuple[float, int]:
        saver = Saver(store, mcfg, d, model_dir, torch.bfloat16, True, False, None,
                           lambda s: print(s, flush=True), checksums=checksums)
        t0 = time.perf_counter()
        saver.begin(1, {"trainer_state.json": {"global_step": 1}})
        last = saver.wait()
        return time.perf_counter() - t0, last["bytes"]

    path = d / "checkpoint-1"
    t_plain0, nbytes = save(False)
    shutil.rmtree(path)
    t_crc, _ = save(True)
    state_bytes = sum(p.stat().st_size for p in (path / "state.zarr").rglob("*") if p.is_file())

    from tiermem.store import checkpoint as state_ckpt

    verify_state, verify_files = state_ckpt.StateReader._verify, ckpt.verify

    def resume(how: str) -> tuple[float, float]:
        """(seconds of the state's load, seconds of the whole resume) of one of the three resumes."""
        nonlocal store
        store.close()
        evict(path)
        ckpt._checks.clear()  # (a process checks a checkpoint's large files once: each resume here anew)
        skip = how == "unchecked"
        state_ckpt.StateReader._verify = (lambda *a: None) if skip else verify_state
        ckpt.verify = (lambda *a, **k: None) if skip else verify_files
        try:
            t0 = time.perf_counter()
            ckpt.check(path, mcfg, model_dir, background=True)
            if how == "model first":
                ckpt.wait_checked(path)
            store = open_store()
            t1 = time.perf_counter()
            ckpt.load(store, path, mcfg, torch.bfloat16, True)
            end = time.perf_counter()
        finally:
            state_ckpt.StateReader._verify, ckpt.verify = verify_state, verify_files
        return end - t1, end - t0

    hows = ("unchecked", "checked", "model first")
    loads: dict[str, list[tuple[float, float]]] = {h: [] for h in hows}
    for r in range(args.rounds):
        for how in hows[r % 3:] + hows[:r % 3]:  # (a rotating order: the disk drifts within a run)
            loads[how].append(resume(how))
            print(f"round {r + 1}: {how:12} state loaded in {loads[how][-1][0]:.1f} s, resumed in "
                  f"{loads[how][-1][1]:.1f} s", flush=True)
    shutil.rmtree(path)
    t_plain1, _ = save(False)
    shutil.rmtree(path)
    store.close()
    t_plain = (t_plain0 + t_plain1) / 2
    med = {h: (statistics.median(x for x, _ in v), statistics.median(y for _, y in v)) for h, v in loads.items()}
    print(f"\n{'':40} {'GB':>7} {'s':>7} {'GB/s':>6} {'vs raw':>7}")
    print(f"{'raw disk write (fsync)':40} {'':>7} {'':>7} {w_raw:6.2f}")
    print(f"{'raw disk read':40} {'':>7} {'':>7} {r_raw:6.2f}")
    for what, t in (("unchecked", t_plain), ("with CRC32C", t_crc)):
        print(f"{'checkpoint save, ' + what:40} {nbytes / 1e9:7.1f} {t:7.1f} {nbytes / t / 1e9:6.2f} "
              f"{nbytes / t / 1e9 / w_raw:7.2f}")
    print(f"(the save without checksums: {t_plain0:.1f} s first, {t_plain1:.1f} s last; their mean above)")
    for how in hows:
        t_load, t_resume = med[how]
        print(f"{'state load, ' + how:40} {state_bytes / 1e9:7.1f} {t_load:7.1f} {state_bytes / t_load / 1e9:6.2f} "
              f"{state_bytes / t_load / 1e9 / r_raw:7.2f}")
        print(f"{'resume (check, open, load), ' + how:40} {'':>7} {t_resume:7.1f}")
    base = med["unchecked"]
    print(f"(medians of {args.rounds} rounds) checksums cost: save {t_crc / t_plain:.3f}x, load "
          f"{med['checked'][0] / base[0]:.3f}x, resume {med['checked'][1] / base[1]:.3f}x; with the model's shards "
          f"checked first, the load {med['model first'][0] / base[0]:.3f}x")


if __name__ == "__main__":
    main()
