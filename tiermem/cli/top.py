"""``tiermem top`` and ``tiermem stats``: the store's state for people (a live terminal view) and for
scripts (JSON; the Prometheus text is ``tiermem.cli.metrics``'), read from a stats snapshot only, so
watching never slows training.

    tiermem top --run OUTPUT_DIR [--once] [--probe probe.json]   # an embedded run: its tiermem_stats.json
    tiermem top [--socket PATH] [--once]                          # a service (default: the user's socket)
    tiermem stats (--run OUTPUT_DIR | [--socket PATH]) [--json | --prometheus]

The view: per tier a bar of used/capacity split by kind; per link GB/s now and on average against the
probed ceiling (a ``tiermem probe --save`` file); the step, phase and the layer on the GPU; the step-time
split (compute / waiting on transfers / waiting on the optimizer) and the step time predicted at full
overlap against the measured one; the optimizer's last update; loss, tokens/s, TFLOP/s, ETA; and the
planner's prediction of a step against the last measured one, per resource (``plan_rows``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import NamedTuple

from rich.console import Group
from rich.table import Table
from rich.text import Text

from tiermem.errors import UserError
from tiermem.files import read_bytes
from tiermem.sizes import format_duration, format_size

KIND_MARK = {"param": ("P", "cyan"), "grad": ("G", "magenta"), "master": ("M", "green"),
             "exp_avg": ("1", "yellow"), "exp_avg_sq": ("2", "blue"), "activations": ("A", "red")}
BAR = 24


class Roles(NamedTuple):
    """A store's tiers by role: the host tier and the device tier (the store's own), the tiers with a memory view
    (host and device), the storage tiers as (name, label, resource)."""

    host: str
    device: str
    memory: list[str]
    storage: list[tuple[str, str, str]]


def tier_roles(snap: dict | None) -> Roles:
    """The store's tiers by role as the snapshot says them (each tier's ``role``: no torch imported). A snapshot
    that does not say them (none, or one written before the roles were recorded) is read with this process's tiers'
    registry."""
    from tiermem.tiers.base import DEVICE, HOST, MEMORY, STORAGE

    tiers = ((snap or {}).get("store") or {}).get("tiers") or {}
    said = {n: t for n, t in tiers.items() if isinstance(t, dict) and isinstance(t.get("role"), str)}
    of = lambda role: [n for n, t in said.items() if t["role"] == role]  # noqa: E731
    if of(HOST) and of(DEVICE):
        return Roles(of(HOST)[0], of(DEVICE)[0], [n for n, t in said.items() if t["role"] in MEMORY],
                     [(n, str(said[n].get("label", n)), str(said[n].get("resource", n))) for n in of(STORAGE)])
    from tiermem.tiers import registry

    return Roles(registry.primary(HOST), registry.primary(DEVICE), [*registry.of_role(HOST), *registry.of_role(DEVICE)],
                 [(n, registry.tier_type(n).label, registry.tier_type(n).resource) for n in registry.of_role(STORAGE)])


def probe_links(snap: dict | None = None) -> dict[str, str]:
    """``tiermem probe``'s rows (by the start of their label) -> the links of the store they measured: the arena
    is the host tier, the GPU the device tier, NVMe the first storage tier (``tier_roles``)."""
    host, dev, _, disks = tier_roles(snap)
    out = {"arena -> GPU": f"{host}->{dev}", "GPU -> arena": f"{dev}->{host}"}
    for disk, _, _ in disks[:1]:
        out.update({"arena -> NVMe": f"{host}->{disk}", "NVMe -> arena": f"{disk}->{host}",
                    "NVMe -> GPU": f"{disk}->{dev}"})
    return out


def stats_path(run_dir: str | Path) -> Path:
    p = Path(run_dir) / "tiermem_stats.json"
    if not p.is_file():
        raise UserError(f"{run_dir} has no tiermem_stats.json (is it the output_dir of a tiermem-train run?)")
    return p


def read_snapshot(run_dir: str | Path) -> dict:
    """The snapshot an embedded run writes, checked where numbers go (one line naming what is not, never a
    traceback in the view or the metrics)."""
    from tiermem.store.stats import snapshot_problem

    p = stats_path(run_dir)
    for _ in range(5):  # the file is replaced atomically; a read can only race with a rename
        try:
            snap = json.loads(read_bytes(p, "stats file", 64 << 20))
            break
        except (ValueError, RecursionError):
            time.sleep(0.05)
    else:
        raise UserError(f"{p} cannot be read as JSON (is it a tiermem_stats.json?)")
    problem = snapshot_problem(snap)
    if problem is not None:
        raise UserError(f"{p}: not a tiermem stats snapshot: {problem}")
    return snap


def ceilings(probe_file: str | Path | None, snap: dict | None = None) -> dict[str, float]:
    """Link -> the raw GB/s a ``tiermem probe --save`` file measured (the best backend for NVMe), the links named
    as ``snap``'s store names them (``probe_links``)."""
    if not probe_file:
        return {}
    from tiermem.errors import ConfigError
    from tiermem.yamlfile import read_yaml

    try:  # (a machine file with the probe's rows, YAML; or an earlier probe file, JSON: YAML too)
        rows = read_yaml(probe_file, "--probe file")["rows"]
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise TypeError
    except (ConfigError, KeyError, TypeError):
        raise UserError(f"--probe {probe_file}: not a file written by tiermem probe --save") from None
    out: dict[str, float] = {}
    for r in rows:
        for prefix, link in probe_links(snap).items():
            if r.get("link", "").startswith(prefix) and r.get("raw"):
                out[link] = max(out.get(link, 0.0), float(r["raw"]))
    return out


def _bar(by_kind: dict[str, int], capacity: int) -> Text:
    t = Text()
    used_cells = 0
    for kind, (mark, style) in KIND_MARK.items():
        cells = round(by_kind.get(kind, 0) / capacity * BAR) if capacity else 0
        cells = min(cells, BAR - used_cells)
        t.append(mark * cells, style=style)
        used_cells += cells
    t.append("." * (BAR - used_cells), style="dim")
    return t


def _notes(t: dict) -> str:
    """What a tier's stats say besides its sizes: a device tier's slots, a storage tier's backend, a memory
    tier's path."""
    if "slots" in t:
        return f"{t.get('slots', 0)} slots of {format_size(t.get('slot_bytes', 0))}, {t.get('slots_free', 0)} free"
    if "backend" in t:
        return f"{t.get('backend')}"
    return f"{t.get('path')}{', pinned' if t.get('pinned') else ''}"


def _alive(pid) -> bool:
    import psutil

    return isinstance(pid, int) and psutil.pid_exists(pid)


def predict(snap: dict, ceiling: dict[str, float] | None = None) -> dict | None:
    """The step time if transfers and the optimizer overlapped the GPU's compute perfectly: the largest
    of the last step's compute, each link's bytes of a step at its probed ceiling (else at its own
    average rate) and the optimizer's last update (the next forward cannot end before it). A lower
    bound; the part that bounds it is what to speed up. None before the first step."""
    run, links = snap.get("run") or {}, (snap.get("store") or {}).get("links", {})
    split = run.get("split") or {}
    if "compute" not in split:
        return None
    parts = {"compute": float(split["compute"])}
    for link, nbytes in (run.get("link_bytes_per_step") or {}).items():
        rate = (ceiling or {}).get(link) or (links.get(link) or {}).get("gbps_avg")
        if rate:
            parts[link] = nbytes / (rate * 1e9)
    update = (run.get("optimizer") or {}).get("last_update_s")
    if update:
        parts["optimizer"] = float(update)
    bound = max(parts, key=parts.get)
    return {"seconds": parts[bound], "bound": bound, "parts": parts}


def plan_rows(snap: dict) -> list[tuple[str, str, str]]:
    """The planner's prediction of a step against the last measured one, per resource: (what, predicted,
    measured). Empty when the run was not planned (every kind pinned) or before its first step."""
    run = snap.get("run") or {}
    plan, split = run.get("plan"), run.get("split") or {}
    if not plan or "compute" not in split:
        return []
    busy, moved = plan.get("busy") or {}, plan.get("bytes") or {}
    measured_bytes = run.get("link_bytes_per_step") or {}
    split_of = (run.get("optimizer") or {}).get("split") or {}
    # (a service's split names whose part each is: service_cpu_adamw, trainer_gpu_path; an embedded run's does not)
    opt: dict[str, float] = {}
    for k, v in split_of.items():
        name = k.removeprefix("service_").removeprefix("trainer_")
        opt[name] = opt.get(name, 0.0) + (v or 0.0)
    s = lambda v: f"{v:.3f} s"
    b = lambda v: format_size(int(v))
    host, dev, memory, disks = tier_roles(snap)
    measured = lambda links: sum(measured_bytes.get(k, 0) for k in links)  # noqa: E731
    rows = [("step", s(plan["predicted_step_s"]), s(run.get("step_s") or 0.0)),
            ("GPU compute", s(plan["compute"]), s(split["compute"])),
            ("waiting for the update", s(plan["wait_optimizer"]), s(split.get("wait_optimizer", 0.0))),
            ("waiting for transfers", s(plan["wait_transfer"]), s(split.get("wait_transfer", 0.0))),
            ("PCIe to the GPU", b(moved.get("h2d", 0)), b(measured_bytes.get(f"{host}->{dev}", 0))),
            ("PCIe from the GPU", b(moved.get("d2h", 0)), b(measured_bytes.get(f"{dev}->{host}", 0)))]
    for disk, label, resource in disks:  # (each storage tier: its disk's reads, writes and busy time)
        reads, writes = [f"{disk}->{m}" for m in memory], [f"{m}->{disk}" for m in memory]
        rows += [(f"{label} read", b(moved.get(f"{resource}_read", 0)), b(measured(reads))),
                 (f"{label} write", b(moved.get(f"{resource}_write", 0)), b(measured(writes))),
                 (f"{label} busy (either way)", s(busy.get(resource, 0.0)),
                  s(run.get("disk_busy_s_per_step") or 0.0))]
    rows += [("CPU AdamW", s(busy.get("cpu", 0.0)), s(opt.get("cpu_adamw", 0.0) + opt.get("cpu_compute_copy", 0.0))),
             ("GPU AdamW", s(busy.get("gpu_adamw", 0.0)), s(opt.get("gpu_in_place", 0.0) + opt.get("gpu_path", 0.0)))]
    return rows


def _service_line(svc: dict, opt: dict) -> str:
    """The line of a frame over a service: its run, trainer, committed step, durability and error."""
    if svc.get("run") is None:
        return f"service on {svc.get('socket')}: idle, no run"
    trainer = f"trainer pid {svc['trainer_pid']}" if svc.get("trainer_pid") else "no trainer attached"
    return (f"service on {svc.get('socket')}: run {svc.get('label', {}).get('output_dir', '?')}, {trainer}; "
            f"committed step {opt.get('committed', '?')}, updated {opt.get('updated', '?')}, groups behind "
            f"{opt.get('lag_groups', 0)}" + (f"; {svc['durability']}" if svc.get("durability") else "")
            + (f"; ERROR {svc['error']}" if svc.get("error") else ""))


def render(snap: dict, ceiling: dict[str, float] | None = None):
    """One frame of ``tiermem top`` for a snapshot (a rich renderable)."""
    store, run = snap.get("store", {}), snap.get("run", {}) or {}
    ceiling = ceiling or {}
    parts = []
    step, total = run.get("step"), run.get("total_steps")
    svc = snap.get("service")
    committed = (run.get("optimizer") or {}).get("committed")
    if svc is not None and isinstance(committed, int):
        step = committed  # (a service's run is where its last commit left it: the trainer's report lags it)
    attached = svc is None or bool(svc.get("trainer_pid"))
    head = Text(f"tiermem top — {store.get('store', '?')} (pid {snap.get('pid', '?')})", style="bold")
    if total and run.get("finished"):
        head.append(f"   finished: step {step or 0}/{total}, train_loss {run.get('train_loss', float('nan')):.4f}, "
                    f"trained in {format_duration(run.get('train_runtime'))}")
    elif total:
        layer = run.get("layer")
        head.append(f"   step {step or 0}/{total} ({(step or 0) / total:.0%})   phase {run.get('phase', '-')}"
                    + (f", layer {layer}" if layer is not None and attached else "")
                    + (f"   ETA {format_duration(run.get('eta_s'))}" if attached else ""))
        if "service" not in snap and not _alive(snap.get("pid")):
            head.append(f"   stopped: pid {snap.get('pid')} is gone before the run finished", style="red")
    parts.append(head)
    if svc is not None:
        parts.append(Text(_service_line(svc, run.get("optimizer") or {})))

    parts.append(Text("tiers   (" + "  ".join(f"{m} {k}" for k, (m, _) in KIND_MARK.items()) + "  . free)",
                      style="bold"))
    tiers = Table(box=None, padding=(0, 1))
    for col, width in (("tier", 4), ("by kind", BAR), ("used", 9), ("capacity", 9), ("budget", 9)):
        tiers.add_column(col, no_wrap=True, min_width=width)
    tiers.add_column("notes")
    for name, t in store.get("tiers", {}).items():
        notes = [_notes(t)]
        budget = t.get("budget")
        tiers.add_row(name, _bar(t.get("by_kind", {}), t.get("capacity", 0)), format_size(t.get("used", 0)),
                      format_size(t.get("capacity", 0)), format_size(budget) if budget else "-", "; ".join(notes))
    parts.append(tiers)

    parts.append(Text("links", style="bold"))
    links = Table(box=None, padding=(0, 1))
    for col in ("link", "GB/s now", "GB/s avg", "ceiling", "moved", "busy s", "queue"):
        links.add_column(col, justify="left" if col == "link" else "right")
    for name, lk in store.get("links", {}).items():
        if not lk.get("bytes"):
            continue
        c = ceiling.get(name)
        links.add_row(name, f"{lk.get('gbps_now', 0):.2f}", f"{lk.get('gbps_avg', 0):.2f}",
                      f"{c:.2f}" if c else "-", format_size(lk.get("bytes", 0)), f"{lk.get('busy_s', 0):.2f}",
                      str(lk.get("queue", 0)))
    parts.append(links)

    if total:
        split = run.get("split", {})
        step_s = run.get("step_s") or 0.0
        lines = [
            f"loss {run.get('loss', float('nan')):.4f}   grad_norm {run.get('grad_norm', float('nan')):.3f}   "
            f"lr {run.get('lr', 0.0):.3e}" + (f"   eval_loss {run['eval_loss']:.4f}" if "eval_loss" in run else ""),
            f"{run.get('tokens_per_s', 0.0):,.0f} tok/s   {run.get('tflops', 0.0):.3g} TFLOP/s"
            + (f" ({run['tflops_attention']:.3g} with attention)" if run.get("tflops_attention") else "")
            + f"   step {step_s:.3f} s"
            f" = compute {split.get('compute', 0.0):.3f} + wait transfer {split.get('wait_transfer', 0.0):.3f}"
            f" + wait optimizer {split.get('wait_optimizer', 0.0):.3f}",
        ]
        rows = plan_rows(snap)
        best = None if rows else predict(snap, ceiling)  # (one prediction: the plan's, where the run has one)
        if best is not None:
            lines.append(f"predicted {best['seconds']:.3f} s at full overlap, bound by {best['bound']} ("
                         + ", ".join(f"{k} {v:.3f}" for k, v in best["parts"].items())
                         + f") vs measured {step_s:.3f} s")
        opt = run.get("optimizer") or {}
        if opt:
            busy = ", ".join(f"{k} {v:.3f}" for k, v in (opt.get("split") or {}).items() if v)
            lines.append(f"optimizer: last update {opt.get('last_update_s', 0.0):.3f} s"
                         + (f" ({busy})" if busy else "") + f"; gpu_share {opt.get('gpu_share', 0)}"
                         + ("; the CPU takes the last groups" if opt.get("cpu_groups") == "last" else ""))
        waits = store.get("waits_s", {})
        if waits:
            lines.append("store waits (not GPU idle): " + ", ".join(f"{k} {v:.2f} s" for k, v in waits.items()))
        parts.append(Text("training", style="bold"))
        parts.extend(Text(line) for line in lines)
        if rows:
            plan = run.get("plan") or {}
            bound = str(plan.get("bound_said") or plan.get("bound"))[:80]
            parts.append(Text(f"plan against the last step (bound: {bound})", style="bold"))
            table = Table(box=None, padding=(0, 1))
            for col in ("", "predicted", "measured"):
                table.add_column(col, justify="left" if not col else "right")
            for row in rows:
                table.add_row(*row)
            parts.append(table)
    return Group(*parts)


def read_service(socket_path, timeout: float | None = None) -> dict:
    """One snapshot from a running service (``tiermem serve``); one line when it does not answer within
    ``timeout`` seconds of silence (protocol.service_timeout)."""
    from tiermem.service.ask import ask

    return ask(socket_path, "stats", timeout)["snapshot"]


def top(read, once: bool, probe: str | None, interval: float = 0.5) -> int:
    """Show ``read()``'s snapshots (a run directory's stats file, or a service's) until Ctrl-C."""
    from rich.console import Console
    from rich.live import Live

    snap = read()
    ceiling = ceilings(probe, snap)  # (the probe's links named as the store names its tiers)
    console = Console()
    if once:
        console.print(render(snap, ceiling))
        return 0
    with Live(render(snap, ceiling), console=console, refresh_per_second=2) as live:
        while True:
            time.sleep(interval)
            live.update(render(read(), ceiling))
