"""One way to open a store for training, embedded or attached: a ``Session`` holds the store and its
optimizer, and answers what a training loop asks of either, so the loop has no branch on where the store
lives.

    session = open_session(specs, settings, config=store_config)                 # the store in this process
    session = open_session(specs, settings, server=path, run_id=..., label=...)  # a tiermem service's
    session.continues_at      # the step a service's run is at (None: load the weights yourself)
    ... load weights into session.store; session.loaded(step)
    ... train with session.optimizer; session.refresh_layout() before a save or the export
    session.finished() or session.stopping(error); session.close()

The store's own API (``tiermem.store.store.Store``, ``tiermem.store.queries``) and these methods are all the
trainer uses of either; ``tests/test_architecture.py`` checks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tiermem.config import StoreConfig
from tiermem.errors import UserError
from tiermem.optim import Optimizer, OptimSettings
from tiermem.plan.placement import Plan
from tiermem.service import protocol
from tiermem.service.client import Attached, attach
from tiermem.specs import TensorSpec
from tiermem.store.store import Store


@dataclass
class Session:
    """A store and its optimizer, this process's or a service's."""

    store: Store
    optimizer: Optimizer
    attached: Attached | None = None  # the service's link, when the store is a service's

    @property
    def embedded(self) -> bool:
        """Whether the store is this process's own (not a service's): its state goes with the process."""
        return self.attached is None

    @property
    def server(self) -> str | None:
        """The socket of the service the run is attached to, or None."""
        return None if self.attached is None else str(self.attached.client.path)

    @property
    def service_plan(self) -> dict | None:
        """The service's plan of the run (``tiermem.service.planning``), when it planned it; else None."""
        return None if self.attached is None else self.attached.plan

    @property
    def updated_here(self) -> list:
        """An attached run's groups that this process's GPU worker updates (the service the others), in order."""
        opt = self.optimizer
        return [] if self.attached is None else [g for g in opt.groups if g in opt.mine]

    @property
    def continues_at(self) -> int | None:
        """The step the service's run is at when it already holds this run's weights, else None."""
        return self.attached.committed if self.attached is not None and self.attached.initialized else None

    @property
    def replaced(self) -> int | None:
        """The step of this run's state the service discarded when asked to start afresh (``fresh``), else None."""
        return self.attached.replaced if self.attached is not None else None

    @property
    def named_checkpoint(self) -> dict | None:
        """The checkpoint a service that lost this run's state names to resume from ({checkpoint, step})."""
        return self.attached.resume if self.attached is not None and not self.attached.initialized else None

    @property
    def progress_sink(self):
        """Where the stats file's snapshots also go (the service's ``tiermem top``), or None."""
        return self.attached.progress if self.attached is not None else None

    def loaded(self, step: int) -> None:
        """The weights (and optimizer state, on a resume) are in the store at ``step``."""
        if self.attached is not None:
            self.store.flush("param")
            self.store.flush("master")
            self.attached.request("init", step=step)
            self.attached.optimizer.committed = step

    def refresh_layout(self) -> None:
        """Take the tensors' current places (a service moves optimizer state between steps) before the
        store is read whole: a save, the export."""
        if self.attached is not None:
            self.attached.refresh_layout()

    def finished(self) -> None:
        """The run is done and exported: a service frees its state."""
        if self.attached is not None:
            self.attached.request("finish")

    def stopping(self, error: BaseException) -> None:
        """The run stops on ``error``: a service is told why a user error stopped it (it keeps the last
        committed step for a rerun)."""
        a = self.attached
        if a is None or not isinstance(error, UserError) or a.client.lost:
            return
        try:
            a.request("stop", reason=str(error))
        except Exception:  # noqa: BLE001 - the error being raised is the one to report
            pass

    def close(self) -> None:
        """Stop the optimizer, then close the store (or detach from the service)."""
        self.optimizer.close()
        if self.attached is not None:
            self.attached.close()
        else:
            self.store.close()


def open_session(specs: list[TensorSpec], settings: OptimSettings, config: StoreConfig | None = None,
                 server: str | Path | None = None, run_id: str = "", label: dict | None = None,
                 plan: Plan | None = None, plan_input: dict | None = None, fresh: bool = False) -> Session:
    """The store for ``specs`` with its optimizer: opened here from ``config`` (its autos resolved by the
    caller; placed by ``plan``, the planner's, when given: its GPU-updated groups go to the optimizer's GPU
    worker), or attached to the service at ``server`` (``default``: this user's default socket) for run
    ``run_id`` (which plans a new run from ``plan_input``, {workload, hbm_room, keep}, when given; ``fresh``: a run the
    service holds for ``run_id`` is discarded and this one starts anew, ``Session.replaced``)."""
    if server is not None:
        attached = attach(protocol.server_socket(server), run_id, label or {}, specs, settings, plan_input,
                          fresh=fresh)
        return Session(attached.store, attached.optimizer, attached)
    store = Store.open(config, specs, streamed_kinds=("param",), plan=plan)
    try:
        on_gpu = plan.gpu_updates if plan is not None and plan.gpu_updates is not None else None
        return Session(store, settings.optimizer(store, on_gpu=on_gpu))
    except BaseException:
        store.close()
        raise
