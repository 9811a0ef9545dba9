"""The processes of a data-parallel run: who this one is (torchrun's environment), the process group, and
what happens when another rank is lost.

    world = World.from_env()          # rank, world size, local rank, local world size (one process: world 1)
    world.start(timeout_s)            # torch.distributed: NCCL between GPUs, gloo on CPUs (+ a gloo group for
                                      # the small control messages of a CUDA run)
    world.broadcast_json(obj)         # rank 0's object on every rank
    world.stop()

A run without torchrun (no WORLD_SIZE, or WORLD_SIZE 1) has world size 1 and no process group: it runs as
before. ``FORCE_TORCHRUN=1 tiermem-train ...`` starts itself again under torchrun (``relaunch``), as
llamafactory-cli does: ``NPROC_PER_NODE`` processes (default: the GPUs, at least 1).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field

import torch

from tiermem.errors import ConfigError, UserError

DEFAULT_TIMEOUT_S = 600.0  # tiermem_dist_timeout: a collective, or a wait for another rank, gives up after it


class RankLost(UserError):
    """Another rank is gone (killed, or failed): this one stops too. Only one rank says so (``quiet`` on the
    others)."""

    exit_code = 1

    def __init__(self, message: str, quiet: bool = False):
        super().__init__(message)
        self.quiet = quiet


@dataclass
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    pids: dict[int, int] = field(default_factory=dict)  # local rank -> pid (the ranks of this host)
    timeout_s: float = DEFAULT_TIMEOUT_S
    cpu_group: object = None  # the gloo group of the control messages
    started: bool = False
    stopping: bool = False  # a lost rank was found: this one is stopping
    phase: str = "start"  # start, prepare (every rank checks the same things: the lead alone says them), train

    @classmethod
    def from_env(cls, environ=None) -> World:
        env = os.environ if environ is None else environ
        try:
            size = int(env.get("WORLD_SIZE", "1"))
            rank = int(env.get("RANK", "0"))
            local_rank = int(env.get("LOCAL_RANK", str(rank)))
            local_size = int(env.get("LOCAL_WORLD_SIZE", str(size)))
        except ValueError:
            raise ConfigError("RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE must be numbers (torchrun sets "
                              "them)") from None
        return cls(rank, size, local_rank, local_size)

    @property
    def several(self) -> bool:
        return self.size > 1

    @property
    def lead(self) -> bool:
        """The rank that writes the logs, the checkpoints and the exported model."""
        return self.rank == 0

    def device(self) -> torch.device:
        return torch.device(f"cuda:{self.local_rank}") if torch.cuda.is_available() else torch.device("cpu")

    def start(self, timeout_s: float) -> None:
        """Join the process group (NCCL when there is CUDA, gloo on the CPU), within ``timeout_s`` seconds for
        this and every later collective; learn the pids of this host's ranks."""
        import torch.distributed as dist

        self.timeout_s = timeout_s
        if not self.several:
            return
        timeout = datetime.timedelta(seconds=timeout_s)
        if torch.cuda.is_available():
            torch.cuda.set_device(self.local_rank)
            dist.init_process_group("nccl", timeout=timeout, device_id=torch.device(f"cuda:{self.local_rank}"))
            self.cpu_group = dist.new_group(backend="gloo", timeout=timeout)
        else:
            dist.init_process_group("gloo", timeout=timeout)
            self.cpu_group = dist.group.WORLD
        self.started = True
        pids = [None] * self.size
        dist.all_gather_object(pids, [self.local_rank, os.getpid(), self.rank - self.local_rank],
                               group=self.cpu_group)
        base = self.rank - self.local_rank
        self.pids = {lr: pid for lr, pid, b in pids if b == base}
        signal.signal(signal.SIGTERM, self._terminated)

    def _terminated(self, signum, frame) -> None:
        """torchrun stops the others when a rank fails: stop here as if that rank was found lost (once: a second
        SIGTERM while stopping is ignored, torchrun's SIGKILL after its grace period stays)."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if not self.stopping:  # (already stopping on the lost rank: a save being finished must not be cut)
            raise self.lost(signal_name="SIGTERM")

    @property
    def node(self) -> int:
        """This host's number (torchrun gives each host's ranks consecutive numbers)."""
        return self.rank // max(self.local_size, 1)

    @property
    def nodes(self) -> int:
        return self.size // max(self.local_size, 1)

    def from_host_lead(self, obj=None):
        """What this host's first rank (local rank 0) has, on every rank of the host (one broadcast per host)."""
        mine = None
        for n in range(self.nodes):
            src = n * self.local_size
            got = self.broadcast_json(obj if self.rank == src else None, src=src)
            if n == self.node:
                mine = got
        return mine

    def global_rank(self, local_rank: int) -> int:
        return self.rank - self.local_rank + local_rank

    def lost(self, dead: list[int] | None = None, cause: str = "", signal_name: str = "") -> RankLost:
        """The error that stops this rank when another is lost: one line naming it (said by the lowest rank still
        alive), or ``cause`` when none of this host's ranks is found gone."""
        import time

        from tiermem.store.shared import alive

        self.stopping = True
        t0 = time.monotonic()
        while dead is None:  # (a rank killed a moment ago may not be reaped yet: a short grace)
            gone = [r for r, pid in self.pids.items() if r != self.local_rank and not alive(pid)]
            if gone or time.monotonic() - t0 > 2.0:
                dead = gone
            else:
                time.sleep(0.05)
        if dead:
            first = self.global_rank(dead[0])
            speaker = min(r for r in self.pids if r not in dead)
            return RankLost(f"rank {first} (pid {self.pids[dead[0]]}) stopped (killed, or it failed: its own output "
                            "says why); the run stops: rerun the same command to resume from the last checkpoint",
                            quiet=speaker != self.local_rank)
        why = cause or (f"stopped by {signal_name}" if signal_name else "lost contact with the other ranks")
        return RankLost(f"rank {self.rank}: {why}; the run stops: rerun the same command to resume from the last "
                        "checkpoint", quiet=not self.lead)

    # -- small messages (the control group) ------------------------------------------------------
    def broadcast_json(self, obj=None, src: int = 0):
        """``obj`` of rank ``src`` on every rank (JSON text through the control group)."""
        if not self.several:
            return obj
        import torch.distributed as dist

        box = [json.dumps(obj) if self.rank == src else None]
        self.call(dist.broadcast_object_list, box, src=src, group=self.cpu_group)
        return json.loads(box[0])

    def sum(self, values: list[float], dtype=torch.float64) -> list[float]:
        """Each of ``values`` summed over the ranks."""
        if not self.several:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=dtype)
        self.call(dist.all_reduce, t, group=self.cpu_group)
        return t.tolist()

    def barrier(self) -> None:
        if self.several:
            import torch.distributed as dist

            self.call(dist.barrier, group=self.cpu_group)

    def call(self, fn, *args, **kw):
        """A collective; another rank's loss (the collective fails or times out) becomes one RankLost line."""
        try:
            return fn(*args, **kw)
        except RankLost:
            raise
        except RuntimeError as e:  # (torch.distributed's errors are RuntimeErrors: DistBackendError, timeouts)
            raise self.lost(cause=f"a collective with the other ranks failed ({str(e).splitlines()[0][:200]})") \
                from e

    def stop(self) -> None:
        if self.started:
            import torch.distributed as dist

            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a lost peer can leave the group unusable; we are leaving anyway
                pass
            self.started = False


def relaunch(argv: list[str], check=None) -> int | None:
    """``FORCE_TORCHRUN=1``: run ``tiermem-train argv`` again under torchrun with ``NPROC_PER_NODE`` processes
    (default: the GPUs, at least 1) and return its exit code; None when not asked (or already under torchrun).
    ``check(world)`` first refuses what that many ranks cannot run."""
    if os.environ.get("FORCE_TORCHRUN", "").lower() not in ("1", "true", "yes") or "WORLD_SIZE" in os.environ:
        return None
    raw = os.environ.get("NPROC_PER_NODE")
    if raw:
        try:
            n = int(raw)
        except ValueError:
            raise ConfigError(f"NPROC_PER_NODE must be a number of processes, got {raw!r}") from None
    else:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 1
    n = max(n, 1)
    nodes = int(os.environ.get("NNODES", "1") or 1)
    if check is not None:
        check(World(0, n * nodes, 0, n))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}"]
    if nodes > 1:  # (as llamafactory-cli: NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT)
        cmd += [f"--nnodes={nodes}", f"--node-rank={os.environ.get('NODE_RANK', '0')}"]
    if os.environ.get("MASTER_PORT"):
        cmd += [f"--master-addr={os.environ.get('MASTER_ADDR', '127.0.0.1')}",
                f"--master-port={os.environ['MASTER_PORT']}"]
    else:
        cmd.append("--standalone")
    cmd += ["-m", "trainer.cli", *argv]
    return subprocess.call(cmd)
