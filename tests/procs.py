"""The environment of the subprocesses tests start (`tiermem serve`, `tiermem-train`): this checkout first
on the import path, and whatever the caller's PYTHONPATH had after it (on the GPU machine, packages such as
zarr are installed there, outside the interpreter's own site-packages)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child_env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


def ctrl_c_works() -> None:
    """preexec_fn of a child a test sends SIGINT to: a shell runs background commands with SIGINT
    ignored, which the child would inherit (and Python then installs no KeyboardInterrupt handler)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
