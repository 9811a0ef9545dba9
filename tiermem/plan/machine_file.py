"""Machine files: a machine described in YAML, for the planner to plan on (``tiermem plan CFG --machine FILE``),
whether it is this one or one we do not have. ``tiermem probe --save FILE`` writes the same format from what it
measured (its rows beside, for ``tiermem top --probe``). docs/machines.md documents each field.

    gpu:   {count: 1, name: NVIDIA H200, memory: 141GiB, bf16_tflops: 989}     # + step/attention_tflops, adamw,
                                                                              #   piece_rate, pass_ms, expert_tflops,
                                                                              #   expert_piece_rate, expert_route_rate
    link:  {h2d: 55, d2h: 55}                                                 # GB/s each way, each GPU's; + duplex
    host:  {memory: 1.5TiB, cores: 96, adamw: 12}                             # G params/s; + copy, in_run
    nvme:  [{read: 14, write: 10, size: 7.68TB}, ...]                         # GB/s, each device; + both

A figure the file leaves out is the H200 machine's (``tiermem.plan.machine.H200``), or estimated from the
file's own (the CPU's AdamW rate from its cores, a streamed layer's matmuls', attention's and routed experts' rates
from the GPU's peak), and named in the plan's ``assumed`` or its source's "estimated". Several GPUs: the planner plans
one GPU's share (the host's memory, cores and disks divided evenly among them) and says so. Every mistake is
one line naming the field (exit 2).
"""

from __future__ import annotations

import math
from pathlib import Path

from tiermem.errors import ConfigError
from tiermem.plan.machine import H200, Machine
from tiermem.sizes import parse_size
from tiermem.yamlfile import read_yaml

GB = 1e9
# our H200 machine's shares, for a figure a file does not give: a streamed layer's matmuls and its attention
# (FLOP/s counting the recompute) of the GPU's dense bf16 peak, as configs/machines/h200-pcie5-125g.yaml has them
# (623 and 480 of 989: docs/machines.md), and its CPU AdamW a thread (4.0 G params/s on 14 threads)
STEP_OF_PEAK = 623 / 989
ATTENTION_OF_PEAK = 480 / 989
EXPERTS_OF_PEAK = H200["gpu_expert_tflops"] / 1e12 / 989  # (a sparse layer's routed experts: 236 of 989)
ADAMW_A_THREAD = H200["cpu_adamw"] / 14
# the machine's GPU: its section here, and the cost model's resource of its compute (tiermem.plan.costmodel; not
# the tier of that name: a plan's JSON names the resource so in ``busy_seconds`` and ``bound``, and this module,
# which names the machine's hardware in a config's words, is where the word is written)
GPU = "gpu"

FIELDS = {  # section -> {field: (kind, required)}; kinds: size, rate (> 0), share (0-2), count, text, ms (>= 0)
    "gpu": {"count": ("count", False), "name": ("text", False), "memory": ("size", True),
            "bf16_tflops": ("rate", True), "step_tflops": ("rate", False), "attention_tflops": ("rate", False),
            "adamw": ("rate", False), "piece_rate": ("rate", False), "pass_ms": ("ms", False),
            "expert_tflops": ("rate", False), "expert_piece_rate": ("rate", False),
            "expert_route_rate": ("rate", False)},
    "link": {"h2d": ("rate", True), "d2h": ("rate", True), "duplex": ("share", False),
             "copy_drag": ("share", False), "name": ("text", False)},
    "host": {"memory": ("size", True), "cores": ("count", True), "adamw": ("rate", False), "copy": ("rate", False),
             "in_run": ("share", False), "name": ("text", False)},
    "nvme": {"read": ("rate", True), "write": ("rate", True), "size": ("size", True), "both": ("share", False),
             "name": ("text", False)},
}
TOP = {"name", "about", "gpu", "link", "host", "nvme", "rows", "size"}  # (rows, size: a probe's, kept beside)


def is_machine_file(data) -> bool:
    """Whether ``data`` (a file's top-level mapping) is a machine file rather than an earlier probe file (rows
    and a ``machine`` of sizes only)."""
    return isinstance(data, dict) and "gpu" in data and "host" in data


def load_machine(path: str | Path) -> Machine:
    """The figures of a machine file, or of an earlier ``tiermem probe --save`` JSON file (rows only)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"machine file {path} not found (bundled ones: configs/machines/; this machine's: "
                          f"`tiermem probe --save {path}`)")
    neither = f"{path} is not a machine file or probe file (docs/machines.md; `tiermem probe --save FILE` writes one)"
    try:
        data = read_yaml(p, "machine file")
    except ConfigError as e:
        raise ConfigError(f"{neither}: {str(e).removeprefix(f'{p}: ')}") from None
    if not is_machine_file(data):
        if "rows" in data:
            return Machine.from_probe(p)
        raise ConfigError(f"{neither}: it has neither the sections gpu, link and host nor a probe's rows")
    return from_description(data, str(path))


def from_description(data: dict, where: str) -> Machine:
    """The Machine a machine file's mapping describes (one GPU's share where it has several)."""
    unknown = sorted(set(data) - TOP)
    if unknown:
        raise ConfigError(f"machine file {where}: unknown field {unknown[0]!r} (fields: {', '.join(sorted(TOP))})")
    for section in ("gpu", "link", "host"):
        if not isinstance(data.get(section), dict):
            raise ConfigError(f"machine file {where}: {section}: expected a mapping of its fields")
    gpu, link, host = (_section(data[s], s, where) for s in ("gpu", "link", "host"))
    disks = data.get("nvme") or []
    if not isinstance(disks, list):
        raise ConfigError(f"machine file {where}: nvme: expected a list of devices (each read, write, size)")
    disks = [_section(d, f"nvme[{i}]", where) for i, d in enumerate(disks)]
    n = gpu.get("count", 1)
    got = {"gpu_memory": gpu["memory"], "gpu_peak": gpu["bf16_tflops"] * 1e12,
           "gpu_tflops": gpu.get("step_tflops", gpu["bf16_tflops"] * STEP_OF_PEAK) * 1e12,
           "h2d": link["h2d"] * GB, "d2h": link["d2h"] * GB, "ram": host["memory"] // n,
           "cpu_adamw": host.get("adamw", ADAMW_A_THREAD / GB * _threads(host["cores"])) * GB / n}
    got["gpu_attention_tflops"] = gpu.get("attention_tflops", gpu["bf16_tflops"] * ATTENTION_OF_PEAK) * 1e12
    got["gpu_expert_tflops"] = gpu.get("expert_tflops", gpu["bf16_tflops"] * EXPERTS_OF_PEAK) * 1e12
    given = {"gpu_memory", "gpu_peak", "h2d", "d2h", "ram"} | {k for k, f in (
        ("gpu_tflops", "step_tflops"), ("gpu_attention_tflops", "attention_tflops"), ("cpu_adamw", "adamw"),
        ("gpu_expert_tflops", "expert_tflops")) if f in (host if k == "cpu_adamw" else gpu)}
    for key, section, field_, scale in (("gpu_adamw", gpu, "adamw", GB), ("gpu_piece_rate", gpu, "piece_rate", GB),
                                        ("gpu_expert_piece_rate", gpu, "expert_piece_rate", GB),
                                        ("gpu_expert_route_rate", gpu, "expert_route_rate", GB),
                                        ("pass_cost", gpu, "pass_ms", 1e-3), ("duplex", link, "duplex", 1),
                                        ("copy_drag", link, "copy_drag", 1), ("cpu_copy", host, "copy", GB / n),
                                        ("cpu_in_run", host, "in_run", 1)):
        if field_ in section:
            got[key] = section[field_] * scale
            given.add(key)
    if disks:
        got["nvme_read"] = sum(d["read"] for d in disks) * GB / n
        got["nvme_write"] = sum(d["write"] for d in disks) * GB / n
        both = [d["both"] for d in disks if "both" in d]
        if len(both) == len(disks):
            got["nvme_both"] = sum(both) / len(both)
            given.add("nvme_both")
        given |= {"nvme_read", "nvme_write"}
    free = sum(d["size"] for d in disks) // n
    name = str(data.get("name") or Path(where).stem)
    share = (f"; one GPU's share of {n}: host memory, cores and disks divided evenly (several GPUs are not planned "
             f"together)") if n > 1 else ""
    estimated = [k for k in ("gpu_tflops", "gpu_attention_tflops", "cpu_adamw", "gpu_expert_tflops") if k not in given]
    how = f"; estimated: {', '.join(estimated)}" if estimated else ""
    return Machine(**{**H200, **got}, disk_free=free, source=f"machine file {where} ({name}{share}{how})",
                   assumed=sorted(k for k in H200 if k not in given and k not in estimated))


def _threads(cores: int) -> int:
    """The CPU worker's threads on ``cores`` cores (all but two, as ``tiermem.plan.machine.worker_threads``)."""
    return cores - 2 if cores > 4 else cores


def _section(values, section: str, where: str) -> dict:
    """One section's fields checked and converted (sizes to bytes; rates, shares and counts as numbers)."""
    kinds = FIELDS[section.split("[")[0]]
    if not isinstance(values, dict):
        raise ConfigError(f"machine file {where}: {section}: expected a mapping of its fields")
    unknown = sorted(set(values) - set(kinds))
    if unknown:
        raise ConfigError(f"machine file {where}: {section}.{unknown[0]}: unknown field "
                          f"(fields: {', '.join(kinds)})")
    out = {}
    for name, (kind, required) in kinds.items():
        v = values.get(name)
        field_ = f"machine file {where}: {section}.{name}"
        if v is None:
            if required:
                raise ConfigError(f"{field_}: missing (docs/machines.md)")
            continue
        out[name] = _value(v, kind, field_)
    return out


def _value(v, kind: str, field_: str):
    if kind == "text":
        return str(v)
    if kind == "size":
        n = parse_size(v, field_)
        if n == 0:
            raise ConfigError(f"{field_}: must be more than 0 bytes")
        return n
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(f"{field_}: expected a number, got {str(v)[:40]!r}")
    if kind == "count":
        if v != int(v) or not 1 <= v <= 100_000:
            raise ConfigError(f"{field_}: expected a whole number from 1, got {v}")
        return int(v)
    if kind == "ms":
        if not 0 <= v < 1e6:
            raise ConfigError(f"{field_}: expected milliseconds from 0, got {v}")
        return float(v)
    if kind == "share":
        if not 0 <= v <= 2:
            raise ConfigError(f"{field_}: expected a ratio from 0 to 2, got {v}")
        return float(v)
    if not 0 < v < 1e9:
        raise ConfigError(f"{field_}: expected a rate above 0 (GB/s, G params/s or TFLOP/s), got {v}")
    return float(v)


def describe(m: Machine, name: str, about: str, cores: int, rows: list | None = None,
             size: int | None = None) -> dict:
    """A machine file's mapping of the figures ``m`` holds (what ``tiermem probe --save`` writes; ``rows`` and
    ``size``: the probe's measurements, kept beside). A figure ``m`` assumed is left out (read back, it is
    assumed again), but for the GPU's peak, which a file must give."""
    gb = lambda x: round(x / GB, 3)
    figures = {("gpu", "step_tflops"): ("gpu_tflops", round(m.gpu_tflops / 1e12, 1)),
               ("gpu", "attention_tflops"): ("gpu_attention_tflops", round(m.gpu_attention_tflops / 1e12, 1)),
               ("gpu", "adamw"): ("gpu_adamw", gb(m.gpu_adamw)), ("link", "duplex"): ("duplex", round(m.duplex, 3)),
               ("gpu", "piece_rate"): ("gpu_piece_rate", gb(m.gpu_piece_rate)),
               ("gpu", "expert_tflops"): ("gpu_expert_tflops", round(m.gpu_expert_tflops / 1e12, 1)),
               ("gpu", "expert_piece_rate"): ("gpu_expert_piece_rate", gb(m.gpu_expert_piece_rate)),
               ("gpu", "expert_route_rate"): ("gpu_expert_route_rate", gb(m.gpu_expert_route_rate)),
               ("gpu", "pass_ms"): ("pass_cost", round(m.pass_cost * 1e3, 3)),
               ("link", "copy_drag"): ("copy_drag", round(m.copy_drag, 3)),
               ("host", "adamw"): ("cpu_adamw", gb(m.cpu_adamw)), ("host", "copy"): ("cpu_copy", gb(m.cpu_copy)),
               ("host", "in_run"): ("cpu_in_run", round(m.cpu_in_run, 3))}
    out = {"name": name, "about": about,
           "gpu": {"count": 1, "memory": int(m.gpu_memory), "bf16_tflops": round(m.gpu_peak / 1e12, 1)},
           "link": {"h2d": gb(m.h2d), "d2h": gb(m.d2h)}, "host": {"memory": int(m.ram), "cores": cores},
           "nvme": [{"read": gb(m.nvme_read), "write": gb(m.nvme_write), "size": int(m.disk_free or 0)}]}
    for (section, field_), (key, value) in figures.items():
        if key not in m.assumed:
            out[section][field_] = value
    if "nvme_both" not in m.assumed:
        out["nvme"][0]["both"] = round(m.nvme_both, 3)
    if not m.disk_free:
        del out["nvme"]
    if rows is not None:
        out["size"], out["rows"] = size, rows
    return out
