"""One run per ``output_dir``: its lock, and what a run that stopped before its end leaves there.

The run's lead rank takes ``output_dir/.tiermem-train.lock`` (an exclusive ``flock``) before it writes anything
there and holds it until it exits; the file says, as JSON, who holds it (pid, host, start time). A second run
on the same ``output_dir`` is refused in one line naming the first's pid, before it reads, writes or removes
anything there (a checkpoint the first is saving included). The kernel drops the lock when its process ends,
``kill -9`` included: the next run takes it over (with a ``note:`` line when its holder died without letting
go).

The lock file stays when a run stops before its end (an error, Ctrl-C, a kill): it marks the directory as this
tool's. A directory that holds no checkpoint is "not empty" for a new run unless everything in it is what such
a run writes (``LEFT``) and the lock file is there to say it was this tool's run: the same command then starts
again instead of being refused, while a user's own files in ``output_dir`` still make the run refuse it. A run
that finishes removes the lock file (holding the lock: a run waiting to take it checks that the file it locked
is still the one at the path).

``overwrite_output_dir: true`` over an earlier run (a run that starts from step 0, not a resume): once the lock is
taken, the earlier run's top-level outputs (``LEFT``: the exported model, the results, the logs and plots) are
moved into ``previous-YYYYmmdd-HHMMSS/`` beside them, with one note naming them, before the new run writes; its
``checkpoint-N`` folders stay, as Hugging Face's Trainer keeps them (a checkpoint of the same step is replaced when
this run saves it), and so do TensorBoard's ``runs/`` (one folder a run) and files of the user's own.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from pathlib import Path

from tiermem.errors import UserError
from tiermem.service.owner import try_lock
from trainer.outputs.weights_io import TOKENIZER_FILES

LOCK = ".tiermem-train.lock"
TOOL = "tiermem-train"

# what a run writes in output_dir before its end (the names of a checkpoint-N aside): its records, the exported
# model, the results and plots, the temporary names each is written under first
LEFT = {"training_args.yaml", "tiermem_plan.json", "trainer_log.jsonl", "trainer_log.pending.jsonl",
        "tiermem_stats.json", "store_stats.json", "train_results.json", "eval_results.json", "all_results.json",
        "trainer_state.json", "training_loss.png", "training_eval_loss.png", "config.json",
        "model.safetensors.index.json", "runs", *TOKENIZER_FILES}
LEFT_PATTERNS = (re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors"), re.compile(r"\.checkpoint-\d+\.tmp-.+"),
                 re.compile(r"previous-\d{8}-\d{6}(-\d+)?"))
KEPT = {"runs"}  # what a new run over an earlier one leaves in place: each run's TensorBoard folder is its own


class OutputDirInUse(UserError):
    """Another live run holds the output_dir's lock."""

    def __init__(self, out: Path, note: dict):
        who = f"pid {note.get('pid', '?')}" + (f" on {note['host']}" if note.get("host") not in (None, _host())
                                               else "")
        since = (f", started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(note['started']))}"
                 if isinstance(note.get("started"), (int, float)) else "")
        super().__init__(f"output_dir {out} is in use by another tiermem-train run ({who}{since}); one run per "
                         "output_dir: wait for it to end, or choose another output_dir")


def _host() -> str:
    return socket.gethostname()


def read_note(out: Path) -> dict:
    """What ``out``'s lock file says (``{}`` when there is none, or it is not this tool's)."""
    try:
        note = json.loads((Path(out) / LOCK).read_text())
    except (OSError, ValueError):
        return {}
    return note if isinstance(note, dict) and note.get("tool") == TOOL else {}


def check_free(out: Path) -> None:
    """Refuse (``OutputDirInUse``) when a live run holds ``out``'s lock; creates nothing."""
    path = Path(out) / LOCK
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return  # no lock file (or none we may read: taking the lock says so)
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise OutputDirInUse(Path(out), read_note(out)) from None
    except OSError:
        pass  # (a filesystem without locks: taking it says so)
    finally:
        os.close(fd)


class OutputLock:
    """``out``'s lock, held by this process until ``release``."""

    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd

    @classmethod
    def take(cls, out: Path, say) -> OutputLock:
        """Lock ``out`` (an existing directory) for this run, or refuse in one line when another holds it; a lock
        whose holder died without letting go is taken over with a note."""
        path = Path(out) / LOCK
        while True:
            fd = try_lock(path)
            if fd is None:
                raise OutputDirInUse(Path(out), read_note(out))
            try:
                same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # (the run that held it finished and removed the file meanwhile: lock the new one)
        before = read_note(out)
        if before.get("pid") not in (None, os.getpid()) and "ended" not in before:
            say(f"note: output_dir {out} was locked by tiermem-train pid {before['pid']}, which is gone without "
                "letting go (killed?): this run takes it over")
        _write(fd, {"tool": TOOL, "pid": os.getpid(), "host": _host(), "started": time.time()})
        return cls(path, fd)

    def release(self, finished: bool) -> None:
        """Let go: a ``finished`` run removes the lock file; one that stopped before its end leaves it (saying
        when it ended), the mark of an interrupted run of this tool."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if finished:
                self.path.unlink(missing_ok=True)
            else:
                _write(fd, dict(read_note(self.path.parent), ended=time.time()))
        except OSError:
            pass  # (the lock goes with the descriptor all the same)
        finally:
            os.close(fd)


def _write(fd: int, note: dict) -> None:
    data = json.dumps(note).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def interrupted_run(out: Path) -> bool:
    """Whether ``out`` holds nothing but what a run of this tool left when it stopped before its end (and the lock
    file that says it was one): a new run may start there."""
    out = Path(out)
    if not read_note(out):
        return False
    return all(p.name == LOCK or p.name in LEFT or p.name.removesuffix(".tmp") in LEFT
               or any(r.fullmatch(p.name.removesuffix(".tmp")) for r in LEFT_PATTERNS) for p in out.iterdir())


def earlier_outputs(out: Path) -> list[Path]:
    """The top-level files an earlier run left in ``out`` that a new run would write again (its checkpoints, the
    lock, ``runs/`` and the folders earlier runs were set aside in excluded), in name order."""
    def ours(name: str) -> bool:
        name = name.removesuffix(".tmp")
        return (name in LEFT - KEPT or LEFT_PATTERNS[0].fullmatch(name) is not None)

    return sorted((p for p in Path(out).iterdir() if ours(p.name)), key=lambda p: p.name) if Path(out).is_dir() else []


def set_aside(out: Path, say) -> Path | None:
    """``overwrite_output_dir`` over an earlier run: its outputs in ``out`` moved into a new ``previous-<time>``
    folder there, saying so in one note; the folder (None: there was nothing to move)."""
    found = earlier_outputs(out)
    if not found:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(max(p.stat(follow_symlinks=False).st_mtime
                                                               for p in found)))
    dest, n = Path(out) / f"previous-{stamp}", 1
    while dest.exists():
        dest, n = Path(out) / f"previous-{stamp}-{n}", n + 1
    dest.mkdir()
    for p in found:
        os.replace(p, dest / p.name)
    named = [p.name for p in found if p.name in ("model.safetensors", "train_results.json", "trainer_log.jsonl",
                                                  "training_loss.png")] or [p.name for p in found[:3]]
    more = len(found) - len(named)
    say(f"note: overwrite_output_dir: this run starts over from step 0; the earlier run's {', '.join(named)}"
        f"{f' and {more} more' if more else ''} moved to {dest} (its checkpoint-N folders stay; one this run saves "
        "replaces the one of the same step)")
    return dest
