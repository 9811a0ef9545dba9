"""The Python garbage collector's pauses in a training process: measured, and kept short.

A full collection walks every object the process holds while it holds the GIL. After the libraries, the model's
setup and torch.compile's graphs that is about half a million objects (0.3-0.4 s a full collection on the CPU
machine); one that lands in the optimizer's worker thread would stall the update. ``freeze`` moves every object
alive now out of the collector's sight (``gc.freeze``): the collections after it walk only what the steps make.
(On the GPU machine's 8B runs the logged pauses were 0.00-0.01 s a step, frozen or not: the collector did not
cause those runs' waits for the CPU worker.)
"""

from __future__ import annotations

import gc
import time


class GcPauses:
    """Seconds the collector has paused this process since it was made (``total``), all generations."""

    def __init__(self) -> None:
        self.total = 0.0
        self._t0: float | None = None
        self._frozen = False
        gc.callbacks.append(self._timed)

    def _timed(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.total += time.perf_counter() - self._t0
            self._t0 = None

    def freeze(self) -> int:
        """Collect once, then keep every object alive now out of later collections (not counted as a pause of a
        step). Returns the objects frozen."""
        total = self.total
        gc.collect()
        gc.freeze()
        self._frozen = True
        self.total = total
        return gc.get_freeze_count()

    def close(self) -> None:
        """Stop timing; what ``freeze`` kept out goes back to the collector (a process that trains again, as
        the tests do, does not keep the first run's objects for good)."""
        if self._timed in gc.callbacks:
            gc.callbacks.remove(self._timed)
        if self._frozen:
            gc.unfreeze()
            self._frozen = False
