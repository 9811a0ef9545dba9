"""Test hooks for the crash-safety tests: ``TIERMEM_TEST_KILL_AT=POINT:KEY`` makes the process kill
itself with SIGKILL when it reaches that point (``forward:3``, ``backward:3``, ``optimizer:3`` in a
trainer: inside step 3 or right after committing it; ``update:3:1`` in the service: group 1's update 3 is
home but not yet journaled). Inert when the variable is unset."""

from __future__ import annotations

import os
import signal

_AT = os.environ.get("TIERMEM_TEST_KILL_AT")


def point(name: str, *key) -> None:
    if _AT is not None and _AT == ":".join([name, *map(str, key)]):
        os.kill(os.getpid(), signal.SIGKILL)
