"""The environment of the subprocesses tests start (`tiermem serve`, `tiermem-train`): this checkout first
on the import path, and whatever the caller's PYTHONPATH had after it (on the GPU machine, packages such as
zarr are installed there, outside the interpreter's own site-packages)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child_env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)
