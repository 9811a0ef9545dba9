"""Test hooks for the crash-safety tests, as one object: ``HOOKS``, inert unless an entry point installs
it from the environment when it starts (``install_from_env``: ``tiermem-train`` and ``tiermem serve`` do).
Production code only calls ``HOOKS.point(...)`` and reads the two slow-downs; nothing reads the
environment at import time.

- ``TIERMEM_TEST_KILL_AT=POINT:KEY``: the process kills itself with SIGKILL when it reaches that point
  (``forward:3``, ``backward:3``, ``commit:3``, ``optimizer:3`` in a trainer: inside step 3, or around
  committing it; ``update:3:1``: group 1's update 3 is written but not yet journaled, in the service or
  in a trainer's GPU worker; ``part:3``: a rank has written its part of checkpoint-3, the state its HBM holds).
- ``TIERMEM_TEST_KILL_RANK=N``: with several ranks, only rank N (torchrun's ``RANK``) kills itself there.
- ``TIERMEM_TEST_HOLD_AT=POINT:KEY``: the thread that reaches the point waits there for good instead (a
  test then acts on the other process while this one is held at a known place).
- ``TIERMEM_TEST_SLOW_UPDATE=SECONDS``: the service takes this much longer over each group's update (a
  kill then lands inside an update).
- ``TIERMEM_TEST_SLOW_SAVE=SECONDS``: a checkpoint's writer takes this much longer over each group.
- ``TIERMEM_TEST_SPLIT_ON_CPU=1``: a service on the CPU stand-in splits a planned run's updates again at its CPU
  worker's measured rate, as one on CUDA does.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass


@dataclass
class Hooks:
    kill_at: str | None = None
    hold_at: str | None = None
    slow_update: float = 0.0  # seconds added to each group's update in the service
    slow_save: float = 0.0  # seconds added to each group a checkpoint writes
    split_on_cpu: bool = False  # a service splits updates again on the CPU stand-in too

    def point(self, name: str, *key) -> None:
        """The process is at ``name:key``: die or hold there if a test asked for it."""
        if self.kill_at is None and self.hold_at is None:
            return
        here = ":".join([name, *map(str, key)])
        if here == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if here == self.hold_at:
            held = threading.Event()
            while not held.wait(0.05):  # in slices: a signal another thread received still reaches this one
                pass


HOOKS = Hooks()


def install_from_env(environ=None) -> None:
    """Set ``HOOKS`` from the TIERMEM_TEST_* variables (an entry point calls this once, at start)."""
    env = os.environ if environ is None else environ
    HOOKS.kill_at = env.get("TIERMEM_TEST_KILL_AT") or None
    if env.get("TIERMEM_TEST_KILL_RANK") not in (None, "", env.get("RANK", "0")):
        HOOKS.kill_at = None
    HOOKS.hold_at = env.get("TIERMEM_TEST_HOLD_AT") or None
    HOOKS.slow_update = float(env.get("TIERMEM_TEST_SLOW_UPDATE") or 0)
    HOOKS.slow_save = float(env.get("TIERMEM_TEST_SLOW_SAVE") or 0)
    HOOKS.split_on_cpu = env.get("TIERMEM_TEST_SPLIT_ON_CPU") == "1"
