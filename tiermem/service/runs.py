"""A service's run: its record, journal, store and optimizer (``Run``), the trainer attached to it
(``Client``; a run of several ranks: rank 0's, the others its ``peers``), and what the service says of it."""

from __future__ import annotations

import concurrent.futures as cf
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

from tiermem.optim import StoreAdamW
from tiermem.service import protocol
from tiermem.service.journal import Journal, RunState, UndoGuard
from tiermem.specs import TensorSpec
from tiermem.store.checkpoint import complete_checkpoints


@dataclass
class Client:
    sock: socket.socket
    pid: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    rank: int = 0  # of a run of several ranks (rank 0 is the run's trainer: it loads, commits, finishes)
    groups: frozenset = frozenset()  # the groups of each committed update its GPU worker takes (alloc, flip)
    done: bool = False  # a rank other than 0 that said it is done (leave): its going away is no loss
    greeted: bool = False  # said hello: a trainer (or rank) the service pulses while it is connected
    busy_since: float | None = None  # when the request being worked on arrived (monotonic), or None

    def send(self, obj: dict) -> None:
        with self.lock:
            protocol.send(self.sock, obj)

    def due_pulse(self, now: float) -> bool:
        """Whether this peer gets the liveness event now (protocol.PULSE_SECONDS): a trainer, or a request that
        has been worked on for a pulse already."""
        since = self.busy_since
        return self.greeted or (since is not None and now - since >= protocol.PULSE_SECONDS)

    def pulse(self) -> None:
        with self.lock:
            protocol.pulse(self.sock)


@dataclass
class Run:
    record: dict
    specs: list[TensorSpec]
    store: object
    journal: Journal
    optimizer: StoreAdamW
    guard: UndoGuard
    trainer: Client | None = None
    peers: dict = field(default_factory=dict)  # rank -> Client: the other ranks of a run of several
    world: int = 1
    live: dict = field(default_factory=dict)
    trainer_store: dict = field(default_factory=dict)
    error: str | None = None
    pending: cf.Future | None = None  # the last update, journaled as updated (or failed)
    # the committed update's groups the trainer's GPU worker owes (the service redoes them if it leaves),
    # whether the service's own part of it is done, and the places handed out for the trainer's writes
    owed: set = field(default_factory=set)
    taken: set = field(default_factory=set)  # owed groups the service found no room for and updates itself
    taken_count: int = 0  # ... how many so far
    own_done: bool = True
    grants: dict = field(default_factory=dict)  # group -> (step, {name: (tier, Extent)})
    update_lock: threading.Lock = field(default_factory=threading.Lock)  # owed, own_done, pending's completion
    updates: int = 0  # updates run by this service process, and where their time went
    update_seconds: dict = field(default_factory=dict)
    # the planner's plan of a run it split (one trainer, CUDA), the seconds of the service's CPU worker in each of its
    # updates, and the split found again at their rate: told with one commit's reply, taken at the next commit
    plan: object = None
    cpu_seen: list = field(default_factory=list)
    next_split: set | None = None
    split_tried: bool = False

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.result()

    def clients(self) -> list[Client]:
        """The run's attached trainers: rank 0's, then the other ranks'."""
        return ([self.trainer] if self.trainer is not None else []) + [self.peers[r] for r in sorted(self.peers)]

    @property
    def state(self) -> RunState:
        return self.journal.state


def label_of(run: Run) -> str:
    return str(run.record["label"].get("output_dir") or run.record["run"][:16])


def no_room_note(in_place: int, taken: int) -> str:
    """The finish line's note on group updates a fragmented arena had no room for out of place (slower)."""
    out = f"; {in_place} group updates went in place for want of room in the arena" if in_place else ""
    if taken:
        out += f"; {taken} of the trainer's were handed to the service for want of room"
    return out


# beside the exact room for new state in HBM, a quarter of the largest group's, up to this: the trainer's GPU worker
# holds two groups' new places at once (the next one's, asked ahead), so two groups' room left no byte for the
# holes' misfit; with the quickstart's shape (layers larger than the embedding) the holes drifted apart over the
# steps until a group found none, from update 52 (196 of its 900 group updates handed to the service, in place).
# Within the HBM the plan leaves the service's CUDA context (SERVICE_CONTEXT), so no plan changes for it.
SLACK_CAP = 64 << 20


def room_for_new_state(specs: list[TensorSpec], plan, kinds: tuple[str, ...], tier: str, workers: int = 2,
                       slack: bool = False) -> int:
    """Room for the new state of the groups being written out of place on ``tier``: the largest group's, once per
    worker (the service's CPU worker and each trainer's GPU worker); ``slack``: and SLACK_CAP's share beside."""
    per: dict = {}
    for (g, k), t in plan.where.items():
        if k in kinds and t == tier:
            per[g] = per.get(g, 0) + plan.group_bytes[(g, k)]
    largest = max(per.values(), default=0)
    return workers * largest + (min(largest // 4, SLACK_CAP) if slack else 0)


def newest_checkpoint(record: dict) -> tuple[Path | None, str]:
    """The newest complete checkpoint in the run's output_dir (None when there is none), and what to say."""
    out = record.get("label", {}).get("output_dir")
    if not out or not Path(out).is_dir():
        return None, "No checkpoint of it is known."
    found = complete_checkpoints(out)
    if not found:
        return None, f"It has no checkpoint in {out}: start it again."
    return found[-1][1], (f"Newest checkpoint: {found[-1][1]} (the trainer's command resumes from there, "
                          "overwrite_output_dir unset).")


def kept_line(cfg, config_path: str, socket_path: Path | None = None, hbm: Path | None = None) -> str:
    """What a stopped service leaves of its run (its arena in RAM, ``hbm``: the file of its state kept in HBM beside
    it, its NVMe files on disk), how to continue the run (``socket_path``: the service's, named where it is not the
    default) and how to free them instead, its own arena only (``cfg``: the service's StoreConfig)."""
    from tiermem.service.protocol import default_socket
    from tiermem.sizes import format_size
    from tiermem.tiers.kept import arena_dir, arena_file, disk_files

    arena = arena_file(cfg)
    disk = [p for p in disk_files(cfg) if p.is_file()]
    in_ram = [hbm] if hbm is not None and hbm.is_file() else []
    rm = in_ram + disk  # (what `tiermem arenas --clean` does not remove)
    size = lambda p: format_size(p.stat().st_size) if p.is_file() else "0 B"  # noqa: E731
    held = (f"its arena {arena} holds {size(arena)} of RAM" + "".join(f", {p} {size(p)} of RAM" for p in in_ram)
            + "".join(f", {p} {size(p)} of disk" for p in disk))
    where = "" if arena_dir(cfg).resolve() == Path("/dev/shm") else f" --dir {arena_dir(cfg)}"
    socket = f" --socket {socket_path}" if socket_path is not None and socket_path != default_socket() else ""
    return (f"{held}; `tiermem serve --config {Path(config_path).resolve()}{socket}` continues it (then the trainer's "
            f"command, overwrite_output_dir unset), or free {'them' if rm else 'it'}: "
            f"`tiermem arenas{where} --clean --force --name {cfg.store_name()}`"
            + (f" and rm {' '.join(map(str, rm))}" if rm else "")
            + " (the run then starts from its newest checkpoint)")
