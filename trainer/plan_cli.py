"""``tiermem plan TRAIN.yaml [key=value ...] [--json] [--probe FILE | --machine FILE]``: what a training run
would do on this machine (or a described one), before it runs. Nothing is trained and nothing is written to output_dir.

It reads the same YAML and overrides as ``tiermem-train`` and prints the state by kind, where the planner
puts it (per tier, by kind and layer range), each tier's need against its budget, the predicted step (time,
tokens/s, TFLOP/s, its split per resource and what bounds it), the smallest gradient_accumulation_steps at
which the step is compute-bound with this placement, and one line of advice when a change would help by
more than 10% (on tokens: the fewest gradient_accumulation_steps within 10% of the compute-bound rate). A run
that cannot fit in the three tiers gets one line saying how much more of what it needs (exit 2). Without a GPU
it plans for the GPU machine ``--probe FILE`` describes (a ``tiermem probe --save`` file made there), else for this
machine as a run here would go (the CPU stand-in, its figures measured now), and says which. ``--machine FILE``
plans for the machine a machine file describes (configs/machines/, docs/machines.md): its budgets and rates, the
compute estimated from FLOPs, nothing timed here; with ``--largest TRAIN.yaml`` it answers the deepest of the
model's family that fits there (``trainer.plan_largest``). Overrides make it a what-if tool:
``tiermem plan my.yaml tiermem.tiers.dram.budget=64GiB``.

Reached as ``tiermem plan`` (an entry point of the ``tiermem.commands`` group) or ``python -m trainer.plan_cli``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from tiermem.errors import ConfigError, UserError

H200_NAME = "h200"  # --probe h200: the H200 machine's figures, with no probe file (the shapes' plans of tools/)


def _args(argv):
    p = argparse.ArgumentParser(prog="tiermem plan", description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("config", nargs="?", help="training YAML (LLaMA-Factory keys), as tiermem-train takes it")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. gradient_accumulation_steps=64")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--probe", help="a `tiermem probe --save` file to plan with: the machine it describes (default: "
                                   "the config's tiermem.probe, else this machine: a quick probe of its GPU, or "
                                   "without one its CPU's figures); `h200`: the H200 machine's figures "
                                   "(docs/measurements.md)")
    p.add_argument("--machine", help="a machine file (configs/machines/*.yaml, docs/machines.md; `tiermem probe "
                                     "--save` writes one): plan for the machine it describes, its compute "
                                     "estimated from its GPU's rate")
    p.add_argument("--largest", metavar="CONFIG", help="with --machine: the largest depth (num_hidden_layers) of "
                                                       "this training YAML's model that trains on that machine, "
                                                       "and its predicted step")
    p.add_argument("--workload", help="a `tiermem plan --json` file, or a run's output_dir/tiermem_plan.json, of "
                                      "the same model and micro-batches: plan with the step measured there (its "
                                      "tokens, layer timings, kept graphs) and, unless --probe is given, the "
                                      "machine's figures it was planned with")
    return p.parse_intermixed_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """One line for arguments that do not go together."""
    if args.largest is not None and args.config is not None and "=" in args.config:
        args.overrides.insert(0, args.config)  # (with --largest the first key=value is taken for the config)
        args.config = None
    if args.largest is not None:
        if args.machine is None:
            raise ConfigError("--largest plans for a described machine: give --machine FILE too "
                              "(configs/machines/, or `tiermem probe --save FILE` of this one)")
        if args.config is not None or args.workload:
            raise ConfigError("--largest CONFIG takes the training YAML itself: give no other config or --workload")
    elif args.config is None:
        raise ConfigError("give a training YAML: tiermem plan TRAIN.yaml [key=value ...], or --largest TRAIN.yaml")
    if args.machine is not None and args.probe is not None:
        raise ConfigError("--machine and --probe both name the machine's figures: give one")


def plan(args: argparse.Namespace, depth: int | None = None) -> tuple[dict, list[str]]:
    """(the plan as data, its text lines) for ``tiermem plan``'s arguments (``depth``: the model's
    num_hidden_layers changed to that, for --largest)."""
    import torch

    from tiermem.plan.here import cpu_machine
    from tiermem.plan.machine import Machine
    from tiermem.plan.machine_file import load_machine
    from tiermem.plan.resolve import compute_device
    from tiermem.sizes import format_size
    from trainer.config import activations_role, load_train_config
    from trainer.planning import run_plan
    from trainer.run.job import model_config
    from trainer.run.when import saves
    from trainer.state import store_config, wants_cuda

    t0 = time.perf_counter()
    cfg = load_train_config(args.config or args.largest, args.overrides, here=False)
    if cfg.tiermem_server:
        raise ConfigError("tiermem plan plans a run's own store; a run attached to a service (tiermem_server) is "
                          "placed by the service")
    if args.probe and args.probe != H200_NAME and not Path(args.probe).is_file():
        raise ConfigError(f"probe file {args.probe} not found; make one with `tiermem probe --save {args.probe}`")
    mcfg = model_config(Path(cfg.model_name_or_path), cfg, depth)
    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    scfg = store_config(cfg.tiermem, here=False)
    device = compute_device(scfg)
    shape = run_plan.Shape(cfg.micro_rows, cfg.cutoff_len, cfg.gradient_accumulation_steps, cfg.pair_rows)
    measured, there, ran_pieces = _workload(args.workload, mcfg, shape) if args.workload else (None, None, None)
    pieces = cfg.tiermem_physical_batch_size  # (auto: a run's own plan replayed keeps the pieces it ran)
    pieces = ran_pieces if pieces == "auto" and ran_pieces is not None else pieces
    # (a run's plan replayed: the figures of the machine it ran on, unless a probe file is named; without a GPU and
    # without either, this machine's own: the CPU stand-in's; a machine file: the machine it describes)
    described = there is not None or bool(args.probe or scfg.probe) or args.machine is not None
    if args.machine is not None:
        machine = load_machine(args.machine)
    elif device.type != "cuda" and not described:
        machine = cpu_machine(_existing_disk(scfg), scfg.tiers.gpu.budget)
    elif args.probe == H200_NAME:
        machine = Machine.h200("the H200 machine's figures (docs/measurements.md), as --probe h200 asks")
        machine.assumed = []  # (none of them measured, as the source line says)
    else:
        machine = there if there is not None and not (args.probe or scfg.probe) else \
            run_plan.machine_for(scfg, device, args.probe)
    # (a described machine is planned as elsewhere: its budgets, its GPU's rate, nothing timed here)
    elsewhere = args.machine is not None or (device.type != "cuda" and wants_cuda(scfg) and described)
    if elsewhere:
        # no GPU here: plan for the GPU machine the figures describe (what the run would do there)
        budgets = run_plan.budgets_for(scfg, machine)
        if budgets["dram"] > machine.ram:
            raise ConfigError(f"tiers.dram.budget {format_size(budgets['dram'])} is larger than the planned "
                              f"machine's memory ({format_size(machine.ram)})")
        p = run_plan.make(mcfg, dtype, scfg, shape, machine, device, cfg.loss_chunk_tokens, time_it=False,
                          budgets=budgets, cuda=True, keep=cfg.tiermem_keep_activations, workload=measured,
                          piece_rows=pieces, activations=activations_role(cfg))
    else:
        store_config(cfg.tiermem)  # (the DRAM budget against this machine's memory)
        budgets = run_plan.local_budgets(scfg, mcfg, dtype, cfg.output_dir, saves(cfg))
        p = run_plan.make(mcfg, dtype, scfg, shape, machine, device, cfg.loss_chunk_tokens, budgets=budgets,
                          keep=cfg.tiermem_keep_activations, workload=measured,
                          piece_rows=pieces, activations=activations_role(cfg))
    if p is None:
        raise ConfigError("the placement pins every kind to a tier: nothing to plan (leave some kind to auto)")
    run_plan.keep_activations(p, cfg.tiermem_keep_activations, mcfg)
    data = run_plan.report(p, cfg.gradient_accumulation_steps)
    data["model"] = {"family": mcfg.family, "params": mcfg.num_params(), "layers": mcfg.num_layers}
    data["shape"] = {"rows": shape.rows, "tokens_per_row": shape.seq, "micro_batches": shape.micro_batches}
    data["plan_seconds"] = time.perf_counter() - t0
    if cfg.stage == "dpo":  # (the reference's log-probabilities: computed once before the first step)
        data["preference"] = {"pref_loss": cfg.pref_loss, "reference": None if cfg.pref_loss in ("orpo", "simpo")
                              else {"model": cfg.ref_model or "the starting model", "how": "computed once"}}
    text = _text(cfg, scfg, mcfg, shape, machine, p, data, budgets if elsewhere else None)
    if args.machine is not None and scfg.tiers.nvme is None and machine.disk_free:
        text.append(f"note: the config names no NVMe tier, so the machine file's disks "
                    f"({format_size(machine.disk_free)}) are not used: set tiermem.tiers.nvme.path to plan with them")
    return data, text


def _text(cfg, scfg, mcfg, shape, machine, p, data: dict, elsewhere: dict | None) -> list[str]:
    """The plan in words (``elsewhere``: the budgets of the machine a file describes, not this one)."""
    from tiermem.plan.here import in_words
    from tiermem.sizes import format_size
    from trainer.planning import run_plan
    from trainer.run import pieces
    from trainer.run.preference import describe

    pred = data["prediction"]
    n = mcfg.num_params()
    disk = ("nvme_read", "nvme_write", "nvme_both")  # (figures of no use to a run without the storage tier)
    assumed = [k for k in machine.assumed if scfg.tiers.nvme is not None or k not in disk]
    text = [f"model: {mcfg.family}, " + (f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M")
            + f" params, {mcfg.num_layers} layers, "
            f"{'bf16' if cfg.bf16 else 'fp32'}; a step: {shape.micro_batches} x {shape.rows} rows x {shape.seq} "
            f"tokens = {shape.tokens:,} tokens",
            f"machine: {machine.source}" + (f"; not measured, the H200 machine's figures for {in_words(assumed)}"
                                             if assumed else ""),
            *_disk_budget_line(scfg, machine, elsewhere),
            *([describe(cfg)] if cfg.stage == "dpo" else []),
            f"compute: {p.workload.timed}",
            "state: " + ", ".join(f"{k} {format_size(v)}" for k, v in data["state_bytes"].items())
            + f" = {format_size(sum(data['state_bytes'].values()))}",
            *(f"  {line}" for line in run_plan.where_lines(p)),
            "need: " + "; ".join(run_plan.budget_lines(p)),
            f"updates: {run_plan.updates_split(len(data['gpu_updates']), len(p.workload.groups))}; "
            f"{p.passes} pass{'es' if p.passes > 1 else ''} a step"
            + (f"; the activations of {run_plan.span(sorted(p.keep))} kept (no recompute)" if p.keep else "")
            + (f"; {run_plan.activations_line(p)}" if p.act_host else "")
            + (f"; {told} (tiermem_physical_batch_size)" if (told := pieces.told(p.micro_rows, p.piece_rows)) else ""),
            f"predicted step: {pred['step_seconds']:.2f} s = {pred['tokens_per_s']:,.0f} tokens/s, "
            f"{run_plan.tflops_text(p.workload, pred['step_seconds'])}; MFU {pred['mfu']:.0%} "
            f"({pred['mfu_attention']:.0%} with attention) of {run_plan.figure(machine.gpu_peak / 1e12)} TFLOP/s; "
            f"bound: {_bound(p)}",
            f"  split: {run_plan.split_line(p)}"]
    cb = data["compute_bound"]
    if cb is None:
        text.append("compute-bound: never with this placement, at any gradient_accumulation_steps up to 4,096 times "
                    "this one")
    elif cb["gradient_accumulation_steps"] == cfg.gradient_accumulation_steps:
        text.append("compute-bound: already, at this gradient_accumulation_steps")
    else:
        text.append(f"compute-bound from gradient_accumulation_steps {cb['gradient_accumulation_steps']}: "
                    f"step {cb['step_seconds']:.2f} s, {cb['tokens_per_s']:,.0f} tokens/s")
    if data["advice"]:
        text.append(f"advice: {data['advice']}")
    return text


def _existing_disk(scfg):
    """The storage tier's directories that exist (measured for this machine's figures; ``tiermem plan`` creates
    nothing), or None."""
    nv = scfg.tiers.nvme
    if nv is None:
        return None
    dirs = [d for d in (nv.path if isinstance(nv.path, (list, tuple)) else [nv.path]) if Path(d).is_dir()]
    return dirs or None


def _disk_budget_line(scfg, machine, budgets: dict | None) -> list[str]:
    """Where the NVMe budget of a plan for another machine comes from when the config leaves it unset: the probe
    file's disk, else (said, not mixed in silently) this machine's."""
    from tiermem.sizes import format_size

    nv = scfg.tiers.nvme
    if budgets is None or nv is None or nv.budget is not None or budgets.get("nvme") is None:
        return []
    if machine.disk_free:
        return [f"nvme budget: {format_size(budgets['nvme'])}, the free space of the disk the figures describe"]
    return [f"nvme budget: {format_size(budgets['nvme'])}, this machine's free disk space (the figures have none of "
            "theirs: set tiers.nvme.budget for the machine planned for)"]


def _workload(path: str, mcfg, shape):
    """(the step measured, the machine's figures, the rows of the pieces it was planned in) of a ``tiermem plan
    --json`` file or a run's tiermem_plan.json, if it is this model's in as many micro-batches (one line otherwise;
    the figures and the pieces None when absent)."""
    import dataclasses

    from tiermem.plan.machine import Machine
    from tiermem.plan.workload import Workload

    try:
        data = json.loads(Path(path).read_text())
        w = Workload.from_json(data["workload"] if isinstance(data, dict) and "workload" in data else data)
    except OSError as e:
        raise ConfigError(f"--workload {path}: {e.strerror or e}") from None
    except (ValueError, KeyError) as e:
        raise ConfigError(f"--workload {path}: not a `tiermem plan --json` file ({e})") from None
    if w.micro_rows and w.micro_rows != shape.rows:  # (planned in pieces: the step's micro-batches again)
        w = w.in_pieces(shape.rows)
    if len(w.layers) != mcfg.num_layers or w.micro_batches != shape.micro_batches:
        raise ConfigError(f"--workload {path} measured {len(w.layers)} layers in {w.micro_batches} micro-batches a "
                          f"step; this run has {mcfg.num_layers} layers in {shape.micro_batches}")
    ran = data.get("piece_rows") if isinstance(data, dict) else None
    ran = ran if isinstance(ran, int) and not isinstance(ran, bool) and 0 < ran <= shape.rows * shape.micro_batches \
        and (ran <= shape.rows or ran % shape.rows == 0) else None
    m = data.get("machine")
    if not isinstance(m, dict):
        return w, None, ran  # (its tokens as measured: a run's packed rows may hold fewer than cutoff_len)
    names = {f.name for f in dataclasses.fields(Machine)}
    # (figures a plan of an earlier version did not carry: the H200's then)
    later = {"duplex", "copy_drag", "cpu_copy", "cpu_in_run", "nvme_both", "gpu_peak",
             "gpu_attention_tflops", "pass_cost", "gpu_piece_rate", "gpu_expert_tflops",
             "gpu_expert_piece_rate", "gpu_expert_route_rate"}
    earlier = {"nvme_read_beside", "nvme_write_beside"}  # (figures a plan of an earlier version carried)
    rates = [k for k in (names | earlier) - {"disk_free", "source", "assumed"} if k in m]
    if not (names - later <= set(m) <= names | earlier) or not all(
            isinstance(m[k], (int, float)) and not isinstance(m[k], bool) and 0 <= m[k] < 1e18 for k in rates):
        raise ConfigError(f"--workload {path}: its machine figures are not a tiermem plan's")
    there = str(m["source"])
    there = there if len(there) <= 200 else there[:199] + "…"
    return w, dataclasses.replace(Machine.from_json(m), source=f"{path} (there: {there})"), ran


def _bound(p) -> str:
    from tiermem.plan.costmodel import describe_bound

    return describe_bound(p.prediction.bound)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    try:
        check_args(args)
        if args.largest is not None:
            from trainer.plan_largest import largest

            data, text = largest(args, plan)
        else:
            data, text = plan(args)
    except UserError as e:
        print(f"tiermem plan: error: {e}", file=sys.stderr)
        return e.exit_code
    try:
        print(json.dumps(data, indent=1, default=str) if args.json else "\n".join(text))
        sys.stdout.flush()
    except BrokenPipeError:  # (piped into head): the rest is not wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
