"""The plan watched against the run, step by step (``trainer.planning.plan_watch.PlanWatch``, when the run has a
prediction: its lines, the prediction logged beside each step, what the first steps measured written to
tiermem_plan.json, the updates split again), and each step's traffic for ``tiermem top``: the bytes each link
carried and the disk's busy time."""

from __future__ import annotations

import json
import os
from pathlib import Path

from trainer.planning.plan_watch import PlanWatch


class PlanWatcher:
    def __init__(self, job, session, ranks, out: Path, start: int, report):
        plan = job.store_plan
        self.store, self.optimizer, self.report = session.store, session.optimizer, report
        self.out, self.lead, self.start = out, ranks.lead, start
        self.watch = None
        if plan is not None and plan.prediction is not None:
            self.watch = PlanWatch(plan, start, ranks.may_resplit(plan))
            report.predicted = self.watch.predicted
        self.traffic = self.store.traffic()

    def observe(self, step: int, result, say) -> None:
        """Step ``step`` (0-based) took ``result``: the plan's lines, the corrected prediction, the traffic."""
        now, before = self.store.traffic(), self.traffic
        busy = now["disk_busy_s"] - before["disk_busy_s"]
        watch = self.watch
        if watch is not None:
            corrected = watch.measured
            disk = (now["storage_read"] - before["storage_read"], now["storage_written"] - before["storage_written"],
                    busy)  # (what the disk did in the step: bytes read, bytes written, seconds busy either way)
            for line in watch.observe(step - self.start, result, self.optimizer.last_split, disk):
                say(line)
            self.report.predicted = watch.predicted
            if corrected is None and watch.measured is not None and self.lead:
                _plan_measured(self.out / "tiermem_plan.json", watch.measured)
                if watch.resplit_to is not None:  # (from the next step's backward on)
                    self.optimizer.resplit(watch.resplit_to)
        for line in getattr(self.optimizer, "take_notes", list)():  # (an attached run's: its service's split)
            say(line)
        links, was = now["links"], before["links"]
        self.report.live["link_bytes_per_step"] = {k: n - was.get(k, 0) for k, n in links.items() if n > was.get(k, 0)}
        self.report.live["disk_busy_s_per_step"] = busy  # (either way: top's NVMe busy)
        self.traffic = now

    def live(self) -> dict | None:
        """The prediction for the stats file (tiermem top), or None."""
        return self.watch.live() if self.watch is not None else None


def _plan_measured(path: Path, measured: dict) -> None:
    """Add what the run measured against its plan (the compute's and the CPU worker's factors, the CPU rates in
    the run, the corrected prediction) to its tiermem_plan.json, as "run"."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    data["run"] = measured
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
        os.replace(tmp, path)
    except OSError:  # (a report: a full disk leaves the plan as the run started with it, and no temp file)
        tmp.unlink(missing_ok=True)

