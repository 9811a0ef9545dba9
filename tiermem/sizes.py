"""Byte sizes as people write them: '40GiB', '1.5 GB', '512MiB', 4096; and durations as people read them."""

from __future__ import annotations

import math
import re

from tiermem.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str, what: str = "size") -> int:
    """Parse a byte count; raise ConfigError naming ``what`` when it is not one."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a size like '40GiB' or a byte count, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{what}: a size cannot be negative ({value})")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"{what}: expected a size like '40GiB' or a byte count, got {value}")
        if value < 0 or value != int(value):
            raise ConfigError(f"{what}: expected a whole number of bytes, got {value}")
        return int(value)
    if isinstance(value, str):
        m = _PATTERN.match(value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ConfigError(
        f"{what}: cannot read {value!r} as a size; write e.g. '40GiB', '512MiB', '1.5GB' or a byte count"
    )


def size_or_auto(value, what: str = "size") -> int | None:
    """A config's size that may be ``auto`` (None: decided from what the machine has)."""
    return None if value in (None, "auto") else parse_size(value, what)


def format_size(n: float) -> str:
    """Human-readable binary size: 1536 -> '1.5 KiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def align_up(n: int, alignment: int) -> int:
    """Round ``n`` up to a multiple of ``alignment``."""
    return (n + alignment - 1) // alignment * alignment


def format_duration(seconds) -> str:
    """Seconds as ``str(timedelta)`` writes them (``1 day, 2:03:04``), for any number: an ETA of trillions of
    steps too, which ``timedelta`` cannot hold; ``-`` for none (None, NaN, infinity, not a number)."""
    try:
        s = float(seconds)
    except (TypeError, ValueError):
        return "-"
    if not math.isfinite(s):
        return "-"
    whole = int(abs(s))
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    day = f"{days} day{'' if days == 1 else 's'}, " if days else ""
    return f"{'-' if s <= -1 else ''}{day}{hours}:{minutes:02}:{secs:02}"
