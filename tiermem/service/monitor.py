"""What a service shows of itself (``tiermem top --socket``, ``tiermem stats --socket``): its store merged with its
trainer's, and the run's progress. A mixin of ``tiermem.service.server.Service``."""

from __future__ import annotations

import os

from tiermem.service.hbm import durability_of, on_device
from tiermem.service.runs import Client
from tiermem.store.stats import snapshot
from tiermem.tiers import registry
from tiermem.tiers.base import DEVICE, STORAGE


class Monitoring:
    def _stats(self, client: Client, msg: dict) -> dict:
        return {"snapshot": self.snapshot()}

    def snapshot(self) -> dict:
        """What ``tiermem top --socket`` shows: the service's store (tiers, NVMe link, optimizer) merged with
        the attached trainer's (GPU tier, PCIe links, waits) and its progress."""
        run = self.run
        if run is None:
            return {"pid": os.getpid(), "service": {"socket": str(self.socket_path), "run": None},
                    "store": {"store": self.cfg.store_name(), "tiers": {}, "links": {}, "waits_s": {}},
                    "run": {"phase": "idle: no run attached"}}
        snap = snapshot(run.store)
        hbm, disks = registry.primary(DEVICE), registry.of_role(STORAGE)
        snap["tiers"].pop(hbm, None)
        ts = run.trainer_store
        if ts.get("tiers", {}).get(hbm):
            snap["tiers"] = {hbm: ts["tiers"][hbm], **snap["tiers"]}
        ends = lambda k: k.split(" ")[0].split("->")  # noqa: E731 - (a link "a->b", or "a->b bulk")
        links = {k: v for k, v in (ts.get("links") or {}).items() if hbm in ends(k)}
        links.update({k: v for k, v in snap["links"].items() if set(ends(k)) & set(disks)})
        snap["links"], snap["waits_s"] = links, ts.get("waits_s", {})
        st = run.state
        versions = [run.store.catalog.version(g) for g in run.optimizer.groups]
        live = dict(run.live)
        if run.trainer is None:
            live["phase"] = "no trainer attached"
        theirs = dict(live.get("optimizer") or {})  # the trainer's: the whole update as it saw it, its GPU share
        split = {k: v for k, v in (theirs.get("split") or {}).items() if k.startswith("trainer_")}
        split.update({f"service_{k}": v for k, v in run.optimizer.last_split.items()})
        live["optimizer"] = dict(theirs, committed=st.committed, updated=st.updated,
                                 lag_groups=sum(v < st.committed for v in versions), gpu_share=run.record["gpu_share"],
                                 cpu_groups=self.plan_cfg.optimizer.cpu_groups,
                                 last_update_s=theirs.get("last_update_s") or run.optimizer.last_step_seconds,
                                 split=split)
        return {"pid": os.getpid(), "store": snap, "run": live,
                "service": {"socket": str(self.socket_path), "run": run.record["run"], "label": run.record["label"],
                            "trainer_pid": run.trainer.pid if run.trainer else None, "error": run.error,
                            "durability": durability_of(run.record, on_device(run.store))}}
