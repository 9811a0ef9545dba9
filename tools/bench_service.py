"""Benchmark: a trainer attached to `tiermem serve` against the same run embedded, same command.

    python3 tools/bench_service.py [--batch 4] [--accum 4] [--seq 4096] [--steps 6] [--skip 2] [--layers N]
                                   [--json FILE] [--share S] [--attached-share S1,S2,...]  # one attached run per share
                                   [--attached-cpu-groups spread,last]  # ... per share and cpu_groups
                                   [--planned]  # both runs placed by the planner (the service plans the attached one)
                                   [--shape 3b|8b] [--nvme DIR]  # the model; an NVMe tier (state > host RAM)
                                   [--durability checkpoint|step]  # the service's, for its state in HBM
                                   [--small]   # a small model: a smoke test that runs on a CPU

Both runs are `tiermem-train` on a random-init Llama-3B shape (bf16, tiermem_init: random) over random
tokenized rows, with the same tiermem config: every kind of state in a DRAM arena under /dev/shm,
optimizer.gpu_share auto (embedded: 0.7 of the groups on the trainer's GPU worker, the rest CPU AdamW in
the trainer's process; attached: 0.85, the rest CPU AdamW in the service, where both write the new state
out of place: CPU AdamW chunk by chunk, the trainer's GPU worker to places the service hands out;
--attached-share runs the attached trainer once per listed share, against the one embedded run;
--attached-cpu-groups once per share and listed optimizer.cpu_groups of the service).
The embedded run keeps the store in the trainer's process; the attached one starts `tiermem serve` with
that config and sets tiermem_server. Prints the median step time of the steps after the first two, the
step split and the ratio attached / embedded. Layers are reduced when /dev/shm cannot hold the state.
--planned leaves placement and the optimizer's split to the planner in both runs (`placement: auto`): both may
keep state in HBM (the attached run in the service's own block, issue 43); each row then also shows the plan's
predicted step and measured / predicted. --shape 8b with --nvme DIR: the 8B shape, whose state outgrows host
RAM, with an NVMe tier in DIR (layers are then not cut to /dev/shm); --durability: the service's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.bench_train import SHAPES  # noqa: E402


def params(shape: dict) -> int:
    h, i, v, n = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"], shape["num_hidden_layers"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    return 2 * v * h + n * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) + h


def fit_layers(shape: dict, want: int, shm: Path) -> int:
    """Layers such that the state (18 B/param in bf16) and the undo copy fit 90% of /dev/shm."""
    free = shutil.disk_usage(shm).free * 0.9
    undo = 18 * shape["vocab_size"] * shape["hidden_size"]
    n = want
    while n > 1 and 18 * params(dict(shape, num_hidden_layers=n)) + undo > free:
        n -= 1
    return n


def step_times(out: Path, skip: int = 2) -> dict:
    rows = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    every = [r for r in rows if "step_seconds" in r]
    rows = every[skip:]
    med = lambda k: statistics.median(r[k] for r in rows)
    return {"step_s": med("step_seconds"), "tokens_per_s": med("throughput"), "compute_s": med("compute_seconds"),
            "wait_transfer_s": med("wait_transfer_seconds"), "wait_optimizer_s": med("wait_optimizer_seconds"),
            "steps": len(rows), "predicted_s": rows[-1].get("predicted_step_seconds"),
            "each_s": [round(r["step_seconds"], 3) for r in every],
            "finite": all(r.get(k) is None or r[k] == r[k] for r in every for k in ("loss", "grad_norm"))}


def kept_layers(out: Path) -> int | None:
    """The layers whose activations the run kept (no recompute), as its training_args.yaml says."""
    import yaml

    path = out / "training_args.yaml"
    return yaml.safe_load(path.read_text()).get("tiermem_keep_activations") if path.is_file() else None


def details(out: Path, log: Path) -> dict:
    """Where a run's time went, beyond the step split: its plan's lines, where the GPU waited longest in its last
    logged step (``waits_at``) and its optimizer's last update split (the stats file's)."""
    rows = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    stats = out / "tiermem_stats.json"
    data = json.loads(stats.read_text()) if stats.is_file() else {}
    opt = data.get("run", data).get("optimizer", {})
    lines = log.read_text().splitlines() if log.is_file() else []
    return {"plan": [ln[:300] for ln in lines if ln.startswith(("plan:", "store:"))][:6],
            "waits_at": next((r["waits_at"] for r in reversed(rows) if "waits_at" in r), {}),
            "update_s": round(opt.get("last_update_s", 0.0), 4),
            "update_split": {k: round(v, 4) for k, v in opt.get("split", {}).items() if v}}


def attach(work: Path, svc_store: dict, run, env: dict) -> dict:
    """Start `tiermem serve` with ``svc_store``, run the attached trainer (``run``), stop the service;
    the service's last line on its updates goes into the result."""
    svc_cfg = work / "serve.yaml"
    svc_cfg.write_text(json.dumps(svc_store))
    sock = work / "s.sock"
    svc = subprocess.Popen([sys.executable, "-m", "tiermem.cli", "serve", "--config", str(svc_cfg), "--socket",
                            str(sock), "--fresh"], cwd=ROOT, env=env, stdout=(work / "serve.log").open("w"),
                           stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 60
        while not sock.exists():
            if svc.poll() is not None or time.time() > deadline:
                raise SystemExit("the service did not start:\n" + (work / "serve.log").read_text())
            time.sleep(0.1)
        r = run()
    finally:
        svc.send_signal(signal.SIGTERM)
        svc.wait(timeout=120)
    for line in (work / "serve.log").read_text().splitlines():
        if "finished at step" in line:
            print(line)
            r["service_updates"] = line
        elif "planned for" in line or "in place:" in line or "from the next update" in line:
            print(line[:400])  # (the service's plan, its CPU worker in place, the updates split again)
    return r


def free_kept(stores: list[dict]) -> None:
    """Remove what the benchmark's stores keep between processes (their arenas in RAM, the service's HBM block file,
    their disk files): a benchmark cut short (``timeout``'s SIGTERM, Ctrl-C) leaves no 100 GiB arena to the next run."""
    from tiermem.config import load_store_config
    from tiermem.tiers.kept import arena_file, disk_files, hbm_file

    for store in stores:
        cfg = load_store_config(store)
        for path in [arena_file(cfg), hbm_file(cfg), *disk_files(cfg)]:
            path.unlink(missing_ok=True)


def main() -> int:
    # a SIGTERM (timeout's) unwinds as an exit: the service is stopped and the trainer killed by their cleanups
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--skip", type=int, default=2, help="steps left out of the medians (the pipeline filling; "
                    "the service splits its updates again from update 4: --skip 4 measures the split)")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the shape's, cut to fit /dev/shm)")
    ap.add_argument("--shm", default="/dev/shm")
    ap.add_argument("--json")
    ap.add_argument("--share", default="auto", help="optimizer.gpu_share of the embedded run (auto: 0.7)")
    ap.add_argument("--attached-share", default=None,
                    help="comma-separated optimizer.gpu_share values of the service, one attached run each "
                         "(default: the service's auto)")
    ap.add_argument("--attached-cpu-groups", default=None,
                    help="comma-separated optimizer.cpu_groups values of the service (spread, last), one attached "
                         "run each per share (default: the config's default, spread)")
    ap.add_argument("--planned", action="store_true",
                    help="placement and the optimizer's split from the planner in both runs (the service plans one)")
    ap.add_argument("--small", action="store_true", help="a small model (hidden 256, vocab 1024): a smoke test")
    ap.add_argument("--shape", choices=["3b", "8b"], default="3b")
    ap.add_argument("--nvme", help="a directory for the NVMe tier's file (the planner may spill state there)")
    ap.add_argument("--durability", choices=["checkpoint", "step"], default="checkpoint",
                    help="the service's tiermem durability (what its crash may lose of the state in HBM)")
    args = ap.parse_args()
    if args.planned and (args.share != "auto" or args.attached_share or args.attached_cpu_groups):
        ap.error("--planned leaves the optimizer's split to the planner: no --share, --attached-share or "
                 "--attached-cpu-groups with it")

    work = Path(tempfile.mkdtemp(prefix="bench-service-"))
    shape = dict(SHAPES[args.shape])
    if args.small:
        shape.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=1024)
    want = args.layers or shape["num_hidden_layers"]
    shape["num_hidden_layers"] = want if args.nvme else fit_layers(shape, want, Path(args.shm))
    n = params(shape)
    model = work / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(shape))
    data = work / "data"
    data.mkdir()
    rng = random.Random(0)
    with (data / "rows.jsonl").open("w") as f:
        for _ in range(args.batch * args.accum * args.steps):
            f.write(json.dumps({"input_ids": [rng.randrange(shape["vocab_size"]) for _ in range(args.seq)]}) + "\n")
    (data / "dataset_info.json").write_text(json.dumps({"rows": {"file_name": "rows.jsonl",
                                                                 "formatting": "tokenized"}}))
    store = {"tiers": {"gpu": {"device": "auto"}, "dram": {"path": args.shm}},
             "placement": {k: "dram" for k in ("param", "grad", "master", "exp_avg", "exp_avg_sq")},
             "optimizer": {"gpu_share": args.share}}
    if args.planned:
        store = {"tiers": store["tiers"], "placement": "auto"}
    if args.nvme:
        store["tiers"]["nvme"] = {"path": args.nvme}
    train = {"model_name_or_path": str(model), "tiermem_init": "random", "dataset": "rows", "dataset_dir": str(data),
             "cutoff_len": args.seq, "per_device_train_batch_size": args.batch,
             "gradient_accumulation_steps": args.accum, "max_steps": args.steps, "learning_rate": 1e-5,
             "bf16": True, "logging_steps": 1, "lr_scheduler_type": "constant", "overwrite_output_dir": True}
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    results = {"params": n, "layers": shape["num_hidden_layers"],
               "tokens_per_step": args.batch * args.accum * args.seq}
    print(f"model: Llama-{args.shape.upper()} shape, {shape['num_hidden_layers']} layers, {n / 1e9:.2f} B params; "
          f"{args.batch}x{args.accum}x{args.seq} tokens a step; state in {args.shm}", flush=True)

    def trainer(name: str, extra: dict) -> dict:
        cfg = work / f"{name}.yaml"
        cfg.write_text(json.dumps(dict(train, output_dir=str(work / name), **extra)))
        t0 = time.perf_counter()
        log = (work / f"{name}.log").open("w")
        rc = subprocess.run([sys.executable, "-m", "trainer.cli", str(cfg)], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT).returncode
        if rc != 0:
            print((work / f"{name}.log").read_text()[-3000:])
            raise SystemExit(f"{name} run failed (rc {rc})")
        r = step_times(work / name, args.skip)
        r["wall_s"] = time.perf_counter() - t0
        r["kept_layers"] = kept_layers(work / name)
        r.update(details(work / name, work / f"{name}.log"))
        shutil.rmtree(work / name, ignore_errors=True)  # the exported model
        return r

    kept = [dict(store, name="bench-embedded"), dict(store, name="bench-service")]
    try:
        return measure(args, results, trainer, store, work, env)
    finally:
        free_kept(kept)
        shutil.rmtree(work, ignore_errors=True)


def measure(args, results: dict, trainer, store: dict, work: Path, env: dict) -> int:
    """The embedded run, then one attached run per share and cpu_groups; the table last."""
    results["embedded"] = trainer("embedded", {"tiermem": dict(store, name="bench-embedded")})
    print(f"embedded: {results['embedded']}", flush=True)

    shares = args.attached_share.split(",") if args.attached_share else ["auto"]
    runs = ["embedded"]
    hows = args.attached_cpu_groups.split(",") if args.attached_cpu_groups else [None]
    for share, how in [(s, h) for s in shares for h in hows]:
        name = "attached" + ("" if share == "auto" else f" {share}") + (f" {how}" if how else "")
        optimizer = {"gpu_share": share, **({"cpu_groups": how} if how else {})}
        svc_store = dict(store, name="bench-service", durability=args.durability,
                         **({} if args.planned else {"optimizer": optimizer}))
        results[name] = attach(work, svc_store, lambda: trainer("attached", {"tiermem_server": str(work / "s.sock")}),
                               env)
        print(f"{name}: {results[name]}", flush=True)
        results[name]["ratio_step_time"] = results[name]["step_s"] / results["embedded"]["step_s"]
        runs.append(name)
    print(f"\n{'run':22} {'step s':>8} {'tok/s':>9} {'compute':>8} {'wait xfer':>9} {'wait opt':>9} {'wall s':>7}"
          f" {'/ embedded':>10} {'predicted':>9} {'/ predicted':>11} {'kept':>4}")
    for name in runs:
        r = results[name]
        pred = r.get("predicted_s")
        print(f"{name:22} {r['step_s']:8.3f} {r['tokens_per_s']:9,.0f} {r['compute_s']:8.3f} "
              f"{r['wait_transfer_s']:9.3f} {r['wait_optimizer_s']:9.3f} {r['wall_s']:7.1f}"
              f" {r.get('ratio_step_time', 1.0):10.3f}"
              + (f" {pred:9.3f} {r['step_s'] / pred:11.3f}" if pred else f" {'-':>9} {'-':>11}")
              + f" {r.get('kept_layers') if r.get('kept_layers') is not None else '-':>4}")
    for name in runs:
        r = results[name]
        print(f"{name}: update {r['update_s']:.3f} s {r['update_split']}; waited longest at {r['waits_at']}")
        print(f"  each step (s): {r['each_s']}; loss and grad norm finite: {r['finite']}")
        for line in r["plan"]:
            print(f"  {line}")
    if args.planned:
        print(f"placement auto in both runs (the service planned the attached run; durability {args.durability})")
    else:
        print(f"embedded gpu_share {args.share}; attached / embedded step time target 0.95-1.05")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
