"""A service's start over what the last service process of its store left: the run record, the journal, the arena
and NVMe files, put back as the journal says (the undo copy, the committed update finished); or, where the state is
gone (the arena lost to a reboot, the HBM lost with the process under ``durability: checkpoint``), the run's newest
checkpoint named for its trainer. What a discard removes is ``tiermem.service.discarding``'s. A part of ``Service``
(``tiermem.service.server``)."""

from __future__ import annotations

import json
from pathlib import Path

from tiermem.errors import UserError
from tiermem.service.hbm import Mirrors, load_block, lost_with_service, save_block
from tiermem.service.journal import Journal, make_private
from tiermem.service.ranks import recorded_owners
from tiermem.service.runs import newest_checkpoint
from tiermem.store.layout import reopen_store, spec_from_json
from tiermem.tiers.extents import Extent
from tiermem.tiers.kept import hbm_file


class Recovery:
    def hbm_file(self) -> Path:
        """Where a clean stop writes the run's HBM block (``tiermem.tiers.kept.hbm_file``)."""
        return hbm_file(self.cfg)

    def _save_hbm(self, run) -> None:
        """A clean stop with the update whole: write the run's HBM block beside the arena for the next start."""
        if run.record.get("hbm_capacity"):
            save_block(run.store, self.hbm_file())
            self.say(f"wrote the state kept in HBM to {self.hbm_file()} for the next start")

    def _state_gone(self, record: dict, journal: Journal, why: str) -> None:
        """The run's state cannot be put back (``why``): name its newest checkpoint, for its trainer too, and drop
        the record."""
        found, says = newest_checkpoint(record)
        self.say(f"the state of run {record['label'].get('output_dir', record['run'])} (step "
                 f"{journal.state.committed}) is gone: {why}. {says}")
        if found is not None:  # told to the run's trainer when it attaches
            self.lost = {"run": record["run"], "checkpoint": str(found), "step": journal.state.committed}
        journal.close()
        self._discard_recorded()

    def _recover(self) -> None:
        if not self.record_path.is_file():
            return
        make_private(self.record_path)
        record = json.loads(self.record_path.read_text())
        arena_dir = self.cfg.tiers.host_tier.path
        recorded = record.get("arena_dir", arena_dir)
        if Path(recorded).resolve() != Path(arena_dir).resolve():
            raise UserError(f"the run this service holds has its arena in {recorded}, but the config's "
                            f"tiers.dram.path is {arena_dir}; put the path back, or start with "
                            "--fresh to discard the run")
        arena = Path(recorded) / f"{self.cfg.store_name()}.arena"
        journal = Journal(self.journal_path)
        state = journal.state
        if not arena.is_file():
            self._state_gone(record, journal, f"its arena {arena} no longer exists (the machine restarted?)")
            return
        if state.finished or not state.initialized:  # nothing left worth keeping
            journal.close()
            self._discard_recorded()
            return
        hbm, saved = record.get("hbm_capacity", 0), self.hbm_file()
        if lost_with_service(record) and not saved.is_file():
            self._state_gone(record, journal, "the part of it kept in HBM died with the last service process "
                                              "(durability: checkpoint)")
            return
        specs = [spec_from_json(s) for s in record["specs"]]
        store = reopen_store(self.plan_cfg, specs, state.layout(record), record["nvme_capacity"], self.arena_owner(),
                             device_capacity=hbm, hbm=self.hbm, parts=record.get("hbm_parts"),
                             owners=recorded_owners(record))
        mirrors = Mirrors(store, record["mirrors"]) if record.get("mirrors") else None
        if mirrors is not None:
            mirrors.reserve()
        if hbm and saved.is_file():
            load_block(store, saved)
            self.say(f"put back the state kept in HBM from {saved} (written by the last service's stop)")
        elif mirrors is not None:
            mirrors.restore(state.versions)
            self.say(f"put back the state kept in HBM from its copies in DRAM ({len(mirrors.places)} tensors)")
        run = self._make_run(record, specs, store, journal, mirrors)
        st = run.state
        if record["undo"] is not None:
            store.tiers.host.allocator.reserve(Extent(*record["undo"]))
        for g, v in st.versions.items():
            store.catalog.bump(g, to=v)
        if st.inflight is not None and st.inflight[1] > st.versions.get(st.inflight[0], 0):
            run.guard.restore(st.inflight[0], st.undo_crc)
            self.say(f"put back group {st.inflight[0]} as it was before update {st.inflight[1]} (cut short)")
        if st.committed > st.updated:
            todo = {g for g in run.optimizer.groups if st.versions.get(g, 0) < st.committed}
            self.say(f"finishing update {st.committed} of {len(todo)} groups")
            run.optimizer.step(st.committed, st.commit_args["lr"], st.commit_args["grad_scale"], only=todo).result()
            run.journal.append("updated", step=st.committed)
        store.keep_files = False
        self.run = run
        self.say(f"recovered run {record['label'].get('output_dir', record['run'])}: step {st.committed} committed "
                 "and updated")
