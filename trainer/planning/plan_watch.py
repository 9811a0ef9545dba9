"""The plan against the run: the predicted step beside each measured one, the compute, the CPU worker's rate
and the disk's corrected from the first steps, and one line naming the resource that was off when the steady
step misses the prediction.

    watch = PlanWatch(plan)
    for each step: notes = watch.observe(step_index, result, optimizer.last_split, (read, written, disk_busy))
                                      # lines to print (rarely any): the compute, CPU worker and disk corrected,
                                      # the prediction missed, steps growing
    watch.predicted                   # the current prediction's step seconds
    watch.measured                    # what the correction measured (None before): tiermem_plan.json's "run"
"""

from __future__ import annotations

import dataclasses
import statistics

from tiermem.plan.costmodel import describe_bound, predict
from tiermem.plan.planner import layout_of, resplit

STEADY_FROM = 2  # steps before this (0-based, since the start or a resume) fill the pipeline
TOLERANCE = 0.15
FLAT = 0.05  # steady steps stay within this of each other; steps that grow are a defect to report
NOISE_S = 0.5  # shorter steps (tiny models, the CPU stand-in) vary more than any of this says
DISK_MIN_BYTES = 1 << 30  # a step's disk traffic below this says too little of the disk's rate
RESPLIT_CPU = 1.1  # the CPU worker this much slower than planned: try the other splits of the updates
RESPLIT_GAIN = 0.02  # ... and take one predicted this much faster


class PlanWatch:
    def __init__(self, plan, start: int = 0, may_resplit: bool = False):
        """``may_resplit``: when the CPU worker measures slower than planned, the correction may also choose
        another split of the updates for the same placement (``resplit_to``; the run hands it to its
        optimizer): a single process's run on CUDA."""
        self.plan, self.start, self.may_resplit = plan, start, may_resplit
        self.resplit_to: set | None = None
        self.prediction = plan.prediction
        self.corrected = False
        self.warned = False
        self.growing_said = False
        self.seen: list = []
        self.cpu_seen: list[float] = []  # the CPU worker's seconds of AdamW and compute copy, an update
        self.measured: dict | None = None
        self.disk_seen: tuple | None = None

    @property
    def predicted(self) -> float:
        return self.prediction.step

    def live(self) -> dict:
        p = self.prediction
        return {"predicted_step_s": p.step, "busy": dict(p.busy), "bound": p.bound,
                "bound_said": describe_bound(p.bound), "compute": p.compute, "wait_optimizer": p.wait_optimizer,
                "wait_transfer": p.wait_transfer, "bytes": dict(p.bytes)}

    def observe(self, n: int, result, split: dict | None = None, disk: tuple | None = None) -> list[str]:
        """Take the ``n``-th step of this run (0-based), the optimizer's split of its last finished update
        (``last_split``: seconds by part) and what the disk did in the step ((bytes read, bytes written, seconds
        busy either way): the update it waited for); lines to print."""
        self.seen.append(result)
        self.disk_seen = disk
        cpu = sum((split or {}).get(k, 0.0) for k in ("cpu_adamw", "cpu_compute_copy"))
        if cpu > 0:
            self.cpu_seen.append(cpu)
        out = []
        if n == STEADY_FROM and not self.corrected:
            out += self._correct()
        steady = self.seen[STEADY_FROM:]
        if len(steady) >= 3 and not self.warned:
            measured = statistics.median(r.seconds for r in steady)
            off = measured / self.predicted - 1
            if abs(off) > TOLERANCE and measured >= NOISE_S:
                self.warned = True
                out.append(self._which(steady, measured, off))
        if len(steady) >= 6 and not self.growing_said:
            line = self._growing(steady)
            if line:
                self.growing_said = True
                out.append(line)
        return out

    def _growing(self, steady: list) -> str | None:
        """One line when the last steady steps take longer than the first ones by more than FLAT."""
        med = lambda rs, k: statistics.median(getattr(r, k) for r in rs)
        head, tail = steady[:3], steady[-3:]
        first, last = med(head, "seconds"), med(tail, "seconds")
        if last <= first * (1 + FLAT) or first < NOISE_S:
            return None
        grew = {"waiting for transfers": med(tail, "wait_transfer") - med(head, "wait_transfer"),
                "waiting for the optimizer": med(tail, "wait_optimizer") - med(head, "wait_optimizer"),
                "GPU compute": med(tail, "compute") - med(head, "compute")}
        name = max(grew, key=lambda k: grew[k])
        return (f"plan: steps are growing: {first:.2f}s -> {last:.2f}s since step {self.start + STEADY_FROM + 1} "
                f"(+{last / first - 1:.0%}), most of it {name} ({grew[name]:+.2f}s); steady steps should stay within "
                f"{FLAT:.0%}: a defect worth reporting")

    def _correct(self) -> list[str]:
        """Scale the plan's compute by what the first steps measured (the layer timing at plan time is one
        layer alone, the data's rows may be shorter than the longest), the CPU worker's rates by its updates and
        the disk's by the last step's traffic, and predict again."""
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
        m = self.plan.machine
        cpu_planned = self.prediction.busy.get("cpu", 0.0)
        cpu = statistics.median(self.cpu_seen[-STEADY_FROM:]) if self.cpu_seen else 0.0
        slower = cpu / cpu_planned if cpu > 0 and cpu_planned > 0 else 1.0
        # (the CPU worker's rates in the run, beside whatever the plan's cpu_in_run did not foresee: the main
        # thread, the link's copies of this step's layout)
        m2 = dataclasses.replace(m, cpu_adamw=m.cpu_adamw / slower, cpu_copy=m.cpu_copy / slower)
        disk = self._disk_factor(m)
        if disk is not None:
            m2 = dataclasses.replace(m2, nvme_both=m.nvme_both * disk[0])
        self.prediction = predict(layout_of(self.plan), w2, m2, self.plan.group_bytes, self.plan.params)
        self.measured = {"compute_factor": factor, "cpu_factor": slower, "cpu_adamw": m2.cpu_adamw,
                         "cpu_copy": m2.cpu_copy, "predicted_step_seconds": self.prediction.step}
        cpu_note = (f", the CPU worker by its updates (x{slower:.2f}: {cpu:.2f}s an update, {cpu_planned:.2f}s "
                    "planned)") if slower != 1.0 else ""
        if disk is not None:
            self.measured.update(disk_factor=disk[0], nvme_both=m2.nvme_both)
            cpu_note += (f", the disk by its traffic (x{disk[0]:.2f}: {disk[1] / 1e9:.1f} GB in {disk[2]:.1f}s, "
                         f"{disk[3]:.1f}s planned)")
        out = [f"plan: compute corrected by the first steps (x{factor:.3f}){cpu_note}: predicted step "
               f"{self.prediction.step:.2f}s"]
        if self.may_resplit and slower > RESPLIT_CPU:
            found = resplit(self.plan, w2, m2)
            if found is not None and found[0] != set(self.plan.gpu_updates or ()) \
                    and found[1].step < self.prediction.step * (1 - RESPLIT_GAIN):
                was = self.prediction.step
                self.resplit_to, self.prediction = found
                self.plan.gpu_updates = set(found[0])
                n_gpu = len(found[0] & set(w.groups))
                self.measured.update(predicted_step_seconds=self.prediction.step,
                                     gpu_updates=[str(g) for g in w.groups if g in found[0]])
                out.append(f"plan: the updates split again for the CPU worker's measured rate: GPU {n_gpu} groups, "
                           f"CPU {len(w.groups) - n_gpu}; predicted step {self.prediction.step:.2f}s (was {was:.2f}s)")
        return out

    def _disk_factor(self, m) -> tuple | None:
        """(the disk's rate in the run over the plan's, bytes, seconds busy, seconds planned) from the last step's
        disk traffic (the update it waited for); None when the disk did too little to tell."""
        if not self.disk_seen:
            return None
        read, write, busy = self.disk_seen
        planned = (read / m.nvme_read + write / m.nvme_write) / m.nvme_both
        if busy < NOISE_S or planned <= 0 or read + write < DISK_MIN_BYTES:
            return None
        return min(max(planned / busy, 0.2), 5.0), read + write, busy, planned

    def _which(self, steady: list, measured: float, off: float) -> str:
        p = self.prediction
        diffs = {"GPU compute": statistics.median(r.compute for r in steady) - p.compute,
                 "waiting for transfers": statistics.median(r.wait_transfer for r in steady) - p.wait_transfer,
                 "waiting for the optimizer": statistics.median(r.wait_optimizer for r in steady) - p.wait_optimizer}
        name = max(diffs, key=lambda k: abs(diffs[k]))
        return (f"plan: the steady step takes {measured:.2f}s, {off:+.0%} off the predicted {self.predicted:.2f}s; "
                f"most of the difference is {name} ({diffs[name]:+.2f}s a step)")
