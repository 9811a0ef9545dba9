"""`report_to: tensorboard`: the run's scalars as TensorBoard event files, under `logging_dir` (default
`output_dir/runs/<date>_<host>`, as the Hugging Face Trainer puts them), with the Trainer's tag names
(`train/loss`, `train/learning_rate`, `eval/loss`...), so `tensorboard --logdir output_dir` shows them.

An event file is a sequence of TFRecords (length, masked CRC32C of the length, the bytes, their masked
CRC32C), each an `Event` protocol buffer: the first names the file version, the others carry a wall time,
a step and a `Summary` of simple scalar values. The few fields needed are encoded here, so nothing beyond
crc32c (a dependency already) is needed to write them.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from datetime import datetime
from pathlib import Path

import crc32c

from tiermem.errors import ConfigError, UserError
from trainer.model.pref_loss import FIGURES as PREF_FIGURES


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 on the wire: two's complement
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire) + payload


def _bytes_field(number: int, data: bytes) -> bytes:
    return _field(number, 2, _varint(len(data)) + data)


def _masked_crc(data: bytes) -> int:
    crc = crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """One TFRecord of ``data``."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", _masked_crc(length)) + data + struct.pack("<I", _masked_crc(data))


def event(wall_time: float, step: int | None = None, scalars: dict[str, float] | None = None,
          file_version: str | None = None) -> bytes:
    """An ``Event`` message: wall_time (1, double), step (2, int64), file_version (3), summary (5)."""
    out = _field(1, 1, struct.pack("<d", wall_time))
    if step is not None:
        out += _field(2, 0, _varint(step))
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if scalars:
        values = b"".join(_bytes_field(1, _bytes_field(1, tag.encode()) + _field(2, 5, struct.pack("<f", v)))
                          for tag, v in scalars.items())  # Summary.value (1): Value{tag (1), simple_value (2)}
        out += _bytes_field(5, values)
    return out


def default_dir(output_dir: str | Path) -> Path:
    """The Hugging Face Trainer's default logging_dir: output_dir/runs/<date>_<host>."""
    return Path(output_dir) / "runs" / f"{datetime.now().strftime('%b%d_%H-%M-%S')}_{socket.gethostname()}"


class EventWriter:
    """Appends scalar events to a new event file in ``log_dir``; flushed after each write."""

    def __init__(self, log_dir: str | Path):
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.0"
        self._f = self.path.open("ab")
        self._write(event(time.time(), file_version="brain.Event:2"))

    def _write(self, data: bytes) -> None:
        self._f.write(record(data))
        self._f.flush()

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._write(event(time.time(), step, {k: float(v) for k, v in values.items() if v is not None}))

    def close(self) -> None:
        self._f.close()


# trainer_log.jsonl fields and the Hugging Face TensorBoardCallback's tags for them
TAGS = {"loss": "train/loss", "grad_norm": "train/grad_norm", "lr": "train/learning_rate", "epoch": "train/epoch",
        "throughput": "train/tokens_per_second", "eval_loss": "eval/loss",
        **{k: f"train/{k}" for k in PREF_FIGURES}}  # (stage dpo's: train/rewards/chosen ...)


def tags_of(record: dict) -> dict[str, float]:
    """A trainer_log.jsonl record's scalars under the Trainer's tag names."""
    return {tag: record[key] for key, tag in TAGS.items() if isinstance(record.get(key), (int, float))}


class RunWriter(EventWriter):
    """The event file of a training run: each trainer_log.jsonl record's scalars at its step."""

    def record(self, rec: dict) -> None:
        values = tags_of(rec)
        if values:
            self.scalars(int(rec["current_steps"]), values)


def check_logging_dir(cfg) -> None:
    """With report_to tensorboard, that ``logging_dir`` can be made and written by this user (checked before
    anything is written: a run must not stop there after it has made its output_dir)."""
    if "tensorboard" not in str(cfg.report_to).split(",") or not cfg.logging_dir:
        return
    path = Path(cfg.logging_dir)
    above = path
    while not above.exists() and not above.is_symlink() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise ConfigError(f"logging_dir {path} cannot be made: {above} is not a directory")
    if not os.access(above, os.W_OK | os.X_OK):
        raise ConfigError(f"logging_dir {path} cannot be written: {above} is not writable by this user")


def open_writer(cfg, output_dir: str | Path) -> RunWriter | None:
    """The run's event writer when report_to names tensorboard (else None); ``cfg.logging_dir`` is set to
    where it writes, for training_args.yaml."""
    if "tensorboard" not in str(cfg.report_to).split(","):
        return None
    log_dir = Path(cfg.logging_dir) if cfg.logging_dir else default_dir(output_dir)
    cfg.logging_dir = str(log_dir)
    try:
        return RunWriter(log_dir)
    except OSError as e:  # (what the check at start could not foresee: the disk full, the directory gone)
        raise UserError(f"logging_dir {log_dir}: cannot write TensorBoard's event file: {e.strerror or e}") from None
