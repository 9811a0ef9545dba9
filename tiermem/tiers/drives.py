"""The storage tier's drives as a run's outputs see them: which of the tier's directories is on the disk the run
writes its outputs to, and whether a file there gives freed bytes back (the room a plan keeps there for the
exported model and a checkpoint: ``trainer.planning.run_plan.local_budgets``)."""

from __future__ import annotations

import os

from tiermem.tiers.nvme import can_punch_holes, directories, existing_parent


def drive_of(section, path) -> str | None:
    """The first of the storage tier's directories (``section``: its config section), as far as they exist, on
    the filesystem of ``path`` (its nearest existing parent); None when none is."""
    dev = os.stat(existing_parent(str(path))).st_dev
    same = [w for w in map(existing_parent, map(str, directories(section))) if os.stat(w).st_dev == dev]
    return same[0] if same else None


def gives_bytes_back(directory: str) -> bool:
    """Whether a file in ``directory`` gives its freed bytes back to the filesystem (holes punched in it)."""
    return can_punch_holes(directory)
