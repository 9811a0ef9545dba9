"""The catalog: every named tensor of the store, where it lives, and a version per group.

A tensor is described by its spec (``tiermem.specs.TensorSpec``). An entry records its home tier and extent
and whether its bytes there are valid: an extent becomes valid only when a write to it has completed. Each group has
a version a reader can wait on ("group g at version >= v"): the optimizer bumps it after an update, and a
checkpoint reads the state at it. The next forward pass waits for the params version, which may run
ahead of it: the update's compute copy is home, the rest of its state not yet.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from tiermem.specs import Group, TensorSpec
from tiermem.tiers.extents import Extent


@dataclass
class Entry:
    spec: TensorSpec
    tier: str
    extent: Extent
    valid: bool = False


@dataclass
class GroupState:
    version: int = 0
    params: int = 0  # the update whose compute copy is home (``params_version``)
    cond: threading.Condition = field(default_factory=threading.Condition)
    wait_seconds: float = 0.0


class Catalog:
    def __init__(self):
        self._entries: dict[str, Entry] = {}
        self._by_group: dict[tuple[Group, str], list[str]] = {}
        self._groups: dict[Group, GroupState] = {}
        self._lock = threading.Lock()
        self._bumps = 0  # counts every version bump, for waiters on "any group changed"
        self._any = threading.Condition()
        self.on_bump = None  # called with (group, version) after each bump (the service tells its trainer)

    def add(self, spec: TensorSpec, tier: str, extent: Extent) -> Entry:
        with self._lock:
            if spec.name in self._entries:
                raise ValueError(f"tensor {spec.name!r} already exists")
            entry = Entry(spec, tier, extent)
            self._entries[spec.name] = entry
            self._by_group.setdefault((spec.group, spec.kind), []).append(spec.name)
            self._groups.setdefault(spec.group, GroupState())
            return entry

    def remove(self, name: str) -> Entry:
        with self._lock:
            entry = self._entries.pop(name)
            names = self._by_group[(entry.spec.group, entry.spec.kind)]
            names.remove(name)
            if not names:
                del self._by_group[(entry.spec.group, entry.spec.kind)]
            return entry

    def __getitem__(self, name: str) -> Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"no tensor named {name!r} in the store") from None

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def group_entries(self, group: Group, kind: str) -> list[Entry]:
        return [self._entries[n] for n in self._by_group.get((group, kind), [])]

    def groups(self) -> list[Group]:
        return list(self._groups)

    # -- versions ------------------------------------------------------------------------------
    def version(self, group: Group) -> int:
        return self._groups[group].version

    def bump(self, group: Group, to: int | None = None) -> int:
        state = self._groups[group]
        with state.cond:
            state.version = state.version + 1 if to is None else to
            state.cond.notify_all()
            version = state.version
        self._notify_any()
        if self.on_bump is not None:
            self.on_bump(group, version)
        return version

    def params_version(self, group: Group) -> int:
        """The latest update whose compute copy (kind ``param``) is home: the group's version, or ahead of
        it while that update's other state is still being made durable (an attached trainer's GPU worker
        hands the new weights to the next forward before the service has journaled the new master
        weights and moments)."""
        state = self._groups[group]
        return max(state.version, state.params)

    def params_ready(self, group: Group, version: int) -> None:
        """Update ``version``'s compute copy of ``group`` is home (its other state may not be yet)."""
        state = self._groups[group]
        with state.cond:
            state.params = max(state.params, version)
            state.cond.notify_all()
        self._notify_any()

    def _notify_any(self) -> None:
        with self._any:
            self._bumps += 1
            self._any.notify_all()

    def bump_count(self) -> int:
        return self._bumps

    def wait_any_bump(self, seen: int, timeout: float) -> None:
        """Block until some group's version is bumped after ``bump_count()`` returned ``seen`` (or timeout)."""
        with self._any:
            self._any.wait_for(lambda: self._bumps != seen, timeout)

    def wait_version(self, group: Group, at_least: int, timeout: float | None = None) -> float:
        """Block until ``group`` is at version >= ``at_least``; returns the seconds waited."""
        state = self._groups[group]
        t0 = time.perf_counter()
        with state.cond:
            if not state.cond.wait_for(lambda: state.version >= at_least, timeout):
                raise TimeoutError(f"group {group!r} did not reach version {at_least} (at {state.version})")
        waited = time.perf_counter() - t0
        state.wait_seconds += waited
        return waited
