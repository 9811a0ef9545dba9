"""The plan against the run: the predicted step beside each measured one, the compute corrected from the
first steps, and one line naming the resource that was off when the steady step misses the prediction.

    watch = PlanWatch(plan)
    for each step: notes = watch.observe(step_index, result)   # lines to print (rarely any)
    watch.predicted                                            # the current prediction's step seconds
"""

from __future__ import annotations

import statistics

from tiermem.plan.costmodel import Layout, predict

STEADY_FROM = 2  # steps before this (0-based, since the start or a resume) fill the pipeline
TOLERANCE = 0.15


class PlanWatch:
    def __init__(self, plan):
        self.plan = plan
        self.prediction = plan.prediction
        self.corrected = False
        self.warned = False
        self.seen: list = []

    @property
    def predicted(self) -> float:
        return self.prediction.step

    def live(self) -> dict:
        p = self.prediction
        return {"predicted_step_s": p.step, "busy": dict(p.busy), "bound": p.bound, "compute": p.compute,
                "wait_optimizer": p.wait_optimizer, "wait_transfer": p.wait_transfer, "bytes": dict(p.bytes)}

    def observe(self, n: int, result) -> list[str]:
        """Take the ``n``-th step of this run (0-based); lines to print."""
        self.seen.append(result)
        out = []
        if n == STEADY_FROM and not self.corrected:
            out += self._correct()
        steady = self.seen[STEADY_FROM:]
        if len(steady) >= 3 and not self.warned:
            measured = statistics.median(r.seconds for r in steady)
            off = measured / self.predicted - 1
            if abs(off) > TOLERANCE:
                self.warned = True
                out.append(self._which(steady, measured, off))
        return out

    def _correct(self) -> list[str]:
        """Scale the plan's compute by what the first steps measured (the layer timing at plan time is one
        layer alone, the data's rows may be shorter than the longest), and predict again."""
        self.corrected = True
        first = self.seen[1:STEADY_FROM + 1] or self.seen
        measured = statistics.median(r.compute for r in first)
        planned = self.prediction.compute
        if planned <= 0 or measured <= 0:
            return []
        factor = measured / planned
        w = self.plan.workload
        w2 = w.scaled(w.tokens, w.micro_batches)
        w2.fwd = {g: s * factor for g, s in w.fwd.items()}
        w2.bwd = {g: s * factor for g, s in w.bwd.items()}
        layout = Layout(self.plan.where, self.plan.gpu_updates, self.plan.passes)
        self.prediction = predict(layout, w2, self.plan.machine, self.plan.group_bytes, self.plan.params)
        return [f"plan: compute corrected by the first steps (x{factor:.3f}): predicted step "
                f"{self.prediction.step:.2f}s"]

    def _which(self, steady: list, measured: float, off: float) -> str:
        p = self.prediction
        diffs = {"GPU compute": statistics.median(r.compute for r in steady) - p.compute,
                 "waiting for transfers": statistics.median(r.wait_transfer for r in steady) - p.wait_transfer,
                 "waiting for the optimizer": statistics.median(r.wait_optimizer for r in steady) - p.wait_optimizer}
        name = max(diffs, key=lambda k: abs(diffs[k]))
        return (f"plan: the steady step takes {measured:.2f}s, {off:+.0%} off the predicted {self.predicted:.2f}s; "
                f"most of the difference is {name} ({diffs[name]:+.2f}s a step)")
