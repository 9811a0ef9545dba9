"""Host memory a store may plan to take: what the OS reports, or the cgroup's limit where the process runs
under one.

    available_memory()     # bytes, the figure the default DRAM budget is sized from
    memory_figures()       # {"available", "os_available", "os_total", "cgroup_limit", "cgroup_used", "source"}

The rule (docs/architecture.md, "Several ranks"):

- no cgroup limit (none set, or "max"): what the OS reports available (MemAvailable);
- a cgroup limit below the machine's memory (a container): the smaller of the two, the OS's available and the
  cgroup's limit less what the cgroup uses (its reclaimable page cache counted as free);
- a cgroup limit above what the OS reports (a virtual machine whose memory grows as it is used: the 2-GPU
  machine reads ~31 GiB of MemTotal at start and grows to 256 GiB): the cgroup's limit less its use, since the
  OS's figure at start is far too small there.

The DRAM arena is sized once per host (several ranks share it), so the figure is the host's, not a rank's.
"""

from __future__ import annotations

from pathlib import Path

import psutil

UNLIMITED = 1 << 60  # cgroup v1 says "no limit" with a number near 2**63


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_dirs(root: Path) -> list[tuple[str, Path]]:
    """(version, directory) of this process's memory cgroup, most specific first."""
    out = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, ctrl, rel = line.split(":", 2)
        rel = rel.lstrip("/")
        if ctrl == "":  # v2
            out += [("v2", root / rel), ("v2", root)]
        elif "memory" in ctrl.split(","):
            out += [("v1", root / "memory" / rel), ("v1", root / "memory")]
    return out


def cgroup_memory(root: Path = Path("/sys/fs/cgroup")) -> tuple[int, int] | None:
    """(limit, used) of this process's memory cgroup, the reclaimable page cache not counted as used; None when
    there is no limit."""
    for version, d in _cgroup_dirs(root):
        if version == "v2":
            limit, used = _read_int(d / "memory.max"), _read_int(d / "memory.current")
            cache = _stat(d / "memory.stat", "inactive_file")
        else:
            limit, used = _read_int(d / "memory.limit_in_bytes"), _read_int(d / "memory.usage_in_bytes")
            cache = _stat(d / "memory.stat", "total_inactive_file")
        if limit is not None and limit < UNLIMITED and used is not None:
            return limit, max(used - cache, 0)
    return None


def memory_figures(root: Path = Path("/sys/fs/cgroup")) -> dict:
    vm = psutil.virtual_memory()
    cg = cgroup_memory(root)
    out = {"os_available": vm.available, "os_total": vm.total, "cgroup_limit": None, "cgroup_used": None}
    if cg is None:
        return dict(out, available=vm.available, source="the OS's available memory")
    limit, used = cg
    out.update(cgroup_limit=limit, cgroup_used=used)
    free = max(limit - used, 0)
    if limit < vm.total:
        return dict(out, available=min(vm.available, free), source="the cgroup's limit (below the machine's memory)")
    return dict(out, available=free, source="the cgroup's limit (above what the OS reports: memory that grows)")


def available_memory() -> int:
    """Bytes of host memory a store may plan to take (see the module)."""
    return memory_figures()["available"]
