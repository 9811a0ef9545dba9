"""What a service discards of the runs it holds: the run a previous service left behind (``tiermem serve --fresh``),
and the run a trainer starts afresh (its ``overwrite_output_dir``: Hugging Face's meaning, as an embedded run takes
it). A mixin of ``tiermem.service.server.Service``."""

from __future__ import annotations

from tiermem.service.runs import label_of
from tiermem.tiers.kept import arena_file, disk_files


class Discarding:
    def _discard_recorded(self) -> None:
        """``--fresh``: the arena, NVMe files, HBM block file (a clean stop's: ``Recovery.hbm_file``), run record and
        journal of the store's name are removed unread."""
        for p in (arena_file(self.cfg), self.hbm_file(), self.record_path, self.journal_path, *disk_files(self.cfg)):
            if p is not None and p.exists():
                p.unlink()
                self.say(f"discarded {p}")

    def _discard_for(self, run_id: str) -> int | None:
        """A trainer of run ``run_id`` asked to start afresh (overwrite_output_dir): the run of that id this service
        holds, with no trainer attached, is discarded; the step it was at (None: nothing discarded)."""
        run = self.run
        if run is None or run.record["run"] != run_id or run.trainer is not None or not run.state.initialized:
            return None
        self.say(f"run {label_of(run)} discarded at step {run.state.committed}: its trainer starts it afresh "
                 "(overwrite_output_dir)")
        self._close_run(keep=False)
        return run.state.committed
