"""Test hooks for the crash-safety tests: ``TIERMEM_TEST_KILL_AT=POINT:KEY`` makes the process kill
itself with SIGKILL when it reaches that point (``forward:3``, ``backward:3``, ``optimizer:3`` in a
trainer: inside step 3 or right after committing it; ``update:3:1``: group 1's update 3 is written but
not yet journaled, in the service or in a trainer's GPU worker). ``TIERMEM_TEST_HOLD_AT=POINT:KEY`` makes
the thread that reaches the point wait there for good instead (a test then acts on the other process
while this one is held at a known place). Inert when the variables are unset."""

from __future__ import annotations

import os
import signal
import threading

_AT = os.environ.get("TIERMEM_TEST_KILL_AT")
_HOLD = os.environ.get("TIERMEM_TEST_HOLD_AT")


def point(name: str, *key) -> None:
    if _AT is None and _HOLD is None:
        return
    here = ":".join([name, *map(str, key)])
    if here == _AT:
        os.kill(os.getpid(), signal.SIGKILL)
    if here == _HOLD:
        held = threading.Event()
        while not held.wait(0.05):  # in slices: a signal another thread received still reaches this one
            pass
