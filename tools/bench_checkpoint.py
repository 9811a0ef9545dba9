"""Benchmark: save and load a checkpoint of a Llama-3B-shape model, against the raw disk, in one run.

    python tools/bench_checkpoint.py [--layers 28] [--dir .ckpt-bench] [--raw-size 4GiB]

Fills a store (bf16 compute copy, fp32 master and moments, all in the DRAM arena) with random state,
then: raw disk write (64 MiB blocks, fsync) and read (page cache evicted first) of --raw-size; the
checkpoint save (trainer.checkpoint.Saver: HF safetensors + zarr state, fsynced, renamed); a resume as
tiermem-train runs it (page cache evicted first): the checkpoint checked, its large files on a thread from
then on, while a new store opens, then the state loaded into it; each once without checksums and once with
the CRC32Cs tiermem writes; then once more with the model's shards checked before the load starts (as a
trainer's start, which tokenizes, plans and times its layer in between, gives them time to be). Prints GB/s
of each, the ratios to the raw disk, and what the checksums cost. When the disk cannot hold a 3B checkpoint,
fewer layers are used and the table says so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import SHAPE  # noqa: E402

from tiermem.sizes import parse_size  # noqa: E402
from tiermem.store.catalog import state_name  # noqa: E402


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
    args = ap.parse_args()
    from tiermem.store.store import Store
    from trainer import checkpoint as ckpt
    from trainer.model.config import model_config_from_dict
    from trainer.model.weights import all_weights, group_order
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

    rows = {}
    for checksums in (False, True):  # the same save and load without CRC32Cs, then with them
        saver = ckpt.Saver(store, mcfg, d, model_dir, torch.bfloat16, True, False, None,
                           lambda s: print(s, flush=True), checksums=checksums)
        t0 = time.perf_counter()
        saver.begin(1, {"trainer_state.json": {"global_step": 1}})
        last = saver.wait()
        t_save = time.perf_counter() - t0
        path = d / "checkpoint-1"
        state_bytes = sum(p.stat().st_size for p in (path / "state.zarr").rglob("*") if p.is_file())
        store.close()
        evict(path)
        # a resume as tiermem-train runs it: the checkpoint checked (its large files on a thread from then on),
        # a new store opened (the trainer also tokenizes and plans there), the state loaded
        t0 = time.perf_counter()
        ckpt.check(path, mcfg, model_dir, background=True)
        store = open_store()
        t1 = time.perf_counter()
        ckpt.load(store, path, mcfg, torch.bfloat16, True)
        t_load, t_resume = time.perf_counter() - t1, time.perf_counter() - t0
        rows[checksums] = (last["bytes"], t_save, state_bytes, t_load, t_resume)
        if checksums:  # the model's shards checked first (a trainer's start gives them that time), then the load
            import google_crc32c

            store.close()
            evict(path)
            t0 = time.perf_counter()
            ckpt.check(path, mcfg, model_dir, background=True)
            ckpt.wait_checked(path)
            t_model = time.perf_counter() - t0
            store = open_store()
            t1 = time.perf_counter()
            ckpt.load(store, path, mcfg, torch.bfloat16, True)
            first = time.perf_counter() - t1
            print(f"the model's shards checked alone: {t_model:.1f} s (google_crc32c: {google_crc32c.implementation}); "
                  f"then the state loaded in {first:.1f} s", flush=True)
            rows["model first"] = (last["bytes"], t_save, state_bytes, first, t_model + first)
        shutil.rmtree(path)
    store.close()
    print(f"\n{'':34} {'GB':>7} {'s':>7} {'GB/s':>6} {'vs raw':>7}")
    print(f"{'raw disk write (fsync)':34} {'':>7} {'':>7} {w_raw:6.2f}")
    print(f"{'raw disk read':34} {'':>7} {'':>7} {r_raw:6.2f}")
    for checksums, (nbytes, t_save, state_bytes, t_load, t_resume) in rows.items():
        what = {False: "without checksums", True: "with CRC32C",
                "model first": "CRC32C, model checked first"}[checksums]
        save_gbs, load_gbs = nbytes / t_save / 1e9, state_bytes / t_load / 1e9
        if checksums != "model first":
            print(f"{'checkpoint save, ' + what:34} {nbytes / 1e9:7.1f} {t_save:7.1f} {save_gbs:6.2f} "
                  f"{save_gbs / w_raw:7.2f}")
        print(f"{'checkpoint load (state), ' + what:34} {state_bytes / 1e9:7.1f} {t_load:7.1f} {load_gbs:6.2f} "
              f"{load_gbs / r_raw:7.2f}")
        print(f"{'resume, ' + what:34} {'':>7} {t_resume:7.1f}")
    (_, s0, _, l0, r0), (_, s1, _, l1, r1), (_, _, _, l2, _) = rows[False], rows[True], rows["model first"]
    print(f"checksums cost: save {s1 / s0:.3f}x, load {l1 / l0:.3f}x, resume {r1 / r0:.3f}x; "
          f"the load after the model's shards were checked {l2 / l0:.3f}x")


if __name__ == "__main__":
    main()
