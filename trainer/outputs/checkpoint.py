"""Checkpoints: ``output_dir/checkpoint-N`` holds the whole training state after N optimizer steps and
the model in Hugging Face format; written while training goes on, visible only when complete.

    checkpoint-N/
      model*.safetensors (+ index), config.json, tokenizer files   # loads for inference
      state.zarr/          master weights and both Adam moments, fp32 (tiermem.store.checkpoint)
      state-rank*.zarr/    several ranks: the state that lived in that rank's HBM, written by that rank
                           (trainer.parallel.checkpoint_part); state.zarr then holds the rest
      trainer_state.json   Hugging Face's TrainerState as of step N (trainer.outputs.hf_outputs)
      tiermem_state.json   step, epoch, RNG state, the resolved config
      checkpoint.json      written last: format, step, the model's tensor shapes, the tokenizer's digest,
                           every file with its size and (but the state's shard files, whose data carries
                           its own CRC32C per shard) its CRC32C: resume checks them all before training on

Saving is ``trainer.outputs.saver``'s (in the background, whole or absent); here: the layout's names, the
check of a checkpoint before a resume (whole, this model's, this tokenizer's), the load into the store, and the
RNG state. The data order and learning rate are functions of the step, so the step is the whole data position.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import hashlib
import json
import shutil
from pathlib import Path

import torch

from tiermem.config import MOMENTS
from tiermem.errors import ConfigError, StorageError
from tiermem.specs import state_name
from tiermem.store.checkpoint import StateReader, file_crc32c
from tiermem.store.checkpoint import complete_checkpoints as checkpoints
from trainer.model.weights import all_weights, group_order
from trainer.outputs.weights_io import TOKENIZER_FILES

FORMAT = 2  # 1: sizes only; 2: sizes and CRC32C checksums
SMALL = 64 << 20  # files up to this size are verified before the store is filled; larger ones while it is


def tokenizer_digest(model_dir: str | Path) -> str:
    h = hashlib.sha256()
    for name in sorted(TOKENIZER_FILES):
        p = Path(model_dir) / name
        if p.is_file() and name != "generation_config.json":
            h.update(name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def signature(mcfg) -> list:
    return [[w.name, list(w.shape)] for w in all_weights(mcfg)]


def is_state_chunks(rel: str) -> bool:
    """True for a data file of the state's zarr arrays (state*.zarr/<kind>/c/...), not its metadata."""
    parts = Path(rel).parts
    return len(parts) > 3 and parts[0].startswith("state") and parts[0].endswith(".zarr") and parts[2] == "c"


def part_name(rank: int) -> str:
    """The folder of a checkpoint holding the state a rank kept in its HBM."""
    return f"state-rank{rank}.zarr"


def part_tmp(out_dir: Path, step: int, rank: int) -> Path:
    """Where a rank writes its part of checkpoint-``step`` before the saver moves it in (``remove_partial``
    removes what a crash left there)."""
    return Path(out_dir) / f".checkpoint-{step}.tmp-part{rank}"


def state_readers(path: Path) -> list:
    """The checkpoint's state stores: state.zarr, then each rank's part, as StateReaders."""
    found = [path / "state.zarr"] + sorted(p for p in path.glob("state-rank*.zarr") if p.is_dir())
    readers = []
    try:
        for p in found:
            readers.append(StateReader(p, order=("master", *MOMENTS)))
    except BaseException:
        for r in readers:
            r.close()
        raise
    return readers


def _reader_of(readers: list, kind: str, name: str):
    """The reader holding tensor ``name`` of ``kind``; StorageError when none does."""
    for r in readers:
        if name in r.index.get(kind, {}):
            return r
    raise StorageError(f"no {kind} of {name} in its state")


def remove_partial(out_dir: str | Path) -> None:
    """Remove what interrupted saves left behind (never a complete checkpoint)."""
    out = Path(out_dir)
    if out.is_dir():
        for p in out.glob(".checkpoint-*.tmp-*"):
            shutil.rmtree(p, ignore_errors=True)


# the checks of checkpoints' large files started by ``check`` (path -> future), for ``load`` to wait on
_checker = cf.ThreadPoolExecutor(1, thread_name_prefix="tiermem-ckpt-verify")
_checks: dict[Path, cf.Future] = {}


def wait_checked(path: str | Path) -> None:
    """Wait for the check of the large files that ``check(..., background=True)`` started (its mismatch is raised
    here); ``load`` then does not check them again."""
    fut = _checks.get(Path(path).resolve())
    if fut is not None:
        fut.result()


def check(path: str | Path, mcfg, model_dir, background: bool = False, trust_old: bool = False) -> dict:
    """The checkpoint's manifest, after checking it is whole and belongs to this model and tokenizer: its
    small files' checksums here; the large files' (the model's shards, which a resume does not read) on a
    thread from now on when ``background`` (the process that loads it: ``load`` waits for that check before
    it returns), else in ``load``. A format-1 manifest (sizes only: nothing but the state's own shard checksums
    can be verified, and a downgraded manifest would pass) is refused unless ``trust_old``
    (``tiermem_trust_old_checkpoints``)."""
    path = Path(path)
    mpath = path / "checkpoint.json"
    if not path.is_dir():
        raise ConfigError(f"resume_from_checkpoint: {path} is not a directory")
    try:
        manifest = json.loads(mpath.read_bytes())
    except (OSError, ValueError):
        raise ConfigError(f"{path} is not a complete tiermem checkpoint (no readable checkpoint.json)") from None
    if not isinstance(manifest, dict) or ("crc32c" in manifest and manifest["crc32c"] != manifest_crc(manifest)) \
            or (manifest.get("format") == FORMAT and "crc32c" not in manifest):
        raise ConfigError(f"{path} is damaged: checkpoint.json does not match its checksum{_other_checkpoint(path)}")
    if manifest.get("format") not in (1, FORMAT):
        raise ConfigError(f"{path}: checkpoint format {manifest.get('format')} is not one this version reads")
    if manifest.get("format") == 1 and not trust_old:
        raise ConfigError(f"{path} is a format-1 checkpoint: its manifest records file sizes only, no checksums, so "
                          "its files cannot be verified; set tiermem_trust_old_checkpoints: true to resume from it "
                          "as it is")
    if manifest.get("model_only"):
        raise ConfigError(f"{path} holds the model only (saved with save_only_model): it cannot resume training")
    mine = signature(mcfg)
    if manifest.get("model") != mine:
        theirs = {n: s for n, s in manifest.get("model", [])}
        diff = next((f"{n} is {theirs[n] if n in theirs else 'absent'} there, {s} here" for n, s in mine
                     if theirs.get(n) != s), "its tensors differ")
        raise ConfigError(f"{path} belongs to another model: {diff}")
    if manifest.get("tokenizer") != tokenizer_digest(model_dir):
        raise ConfigError(f"{path} was trained with a different tokenizer than {model_dir}'s")
    hint = _other_checkpoint(path)
    for rel, rec in _files(manifest).items():
        f = path / rel
        if not f.is_file():
            raise ConfigError(f"{path} is damaged: {rel} is missing{hint}")
        if f.stat().st_size != rec["size"]:
            raise ConfigError(f"{path} is damaged: {rel} has {f.stat().st_size} bytes, {rec['size']} were "
                              f"written{hint}")
    verify(path, manifest, large=False)
    for name in ("trainer_state.json", "tiermem_state.json"):
        try:
            if name == "trainer_state.json" or (path / name).exists():
                json.loads((path / name).read_text())
        except (OSError, ValueError):
            raise ConfigError(f"{path} is damaged: {name} is not readable JSON{hint}") from None
    if background and path.resolve() not in _checks:  # (read while the run tokenizes, opens the store, plans)
        _checks[path.resolve()] = _checker.submit(verify, path, manifest, True)
    return manifest


def manifest_crc(manifest: dict) -> str:
    """The CRC32C of the manifest's content (all but its own checksum), canonically serialised."""
    import crc32c

    body = json.dumps({k: v for k, v in manifest.items() if k != "crc32c"}, sort_keys=True).encode()
    return f"{crc32c.crc32c(body):08x}"


def _files(manifest: dict) -> dict[str, dict]:
    """The manifest's files as {relative path: {"size": n, "crc32c": hex (format 2)}}."""
    files = manifest.get("files", {})
    if not isinstance(files, dict):
        return {}
    return {rel: rec if isinstance(rec, dict) else {"size": rec} for rel, rec in files.items()}


def _other_checkpoint(path: Path) -> str:
    """The hint of a damaged checkpoint's error line: the newest other complete one beside it."""
    others = [p for _, p in checkpoints(path.parent) if p.resolve() != path.resolve()]
    if others:
        return f"; resume from {others[-1]} instead (resume_from_checkpoint={others[-1]})"
    return "; no other checkpoint is beside it: start again, or remove it"


def verify(path: Path, manifest: dict, large: bool) -> None:
    """Compare the CRC32C of the checkpoint's files (those up to SMALL bytes, or the larger ones) with the
    manifest's; a mismatch is one line naming the file."""
    path = Path(path)
    for rel, rec in _files(manifest).items():
        if "crc32c" not in rec or (rec["size"] > SMALL) != large:
            continue
        if file_crc32c(path / rel) != rec["crc32c"]:
            raise ConfigError(f"{path} is damaged: {rel} does not match its checksum{_other_checkpoint(path)}")


def load(store, path: str | Path, mcfg, dtype: torch.dtype, has_master: bool, progress=None,
         only: set | None = None) -> int:
    """Fill the store from a checked checkpoint; the groups' versions become its step. Returns the step.
    Store tensors the store does not hold (another rank's HBM) are left out; ``only``: just these store names
    (a rank loading its own HBM-resident state, the versions left alone)."""
    path = Path(path)
    manifest = json.loads((path / "checkpoint.json").read_text())
    step = int(manifest["step"])
    try:
        readers = state_readers(path)
    except StorageError as e:
        raise ConfigError(f"{path} is damaged: {e}{_other_checkpoint(path)}") from None
    pending: list = []
    checked = _checks.pop(path.resolve(), None) or _checker.submit(verify, path, manifest, True)

    def wanted(name: str) -> bool:
        return store.holds(name) and (only is None or name in only)

    try:
        for kind in ("master", *MOMENTS):  # kind by kind: each array streams from disk in order
            for w in all_weights(mcfg):
                names = ([state_name(w.name, "param")] + ([state_name(w.name, "master")] if has_master else [])
                         if kind == "master" else [state_name(w.name, kind)])
                names = [n for n in names if wanted(n)]
                if not names:
                    continue
                try:
                    t = torch.from_numpy(_reader_of(readers, kind, w.name).get(kind, w.name))
                except StorageError as e:
                    raise ConfigError(f"{path} is damaged: {e}{_other_checkpoint(path)}") from None
                for n in names:
                    pending.append(store.write(n, t.to(dtype) if store.spec(n).kind == "param" else t))
                while len(pending) > 8:  # a few copies in flight while the next tensor is read
                    pending.pop(0).result()
                if progress:
                    progress(t.numel() // 3)
        for f in pending:
            f.result()
        checked.result()
    finally:
        for r in readers:
            r.close()
    if only is None:
        for g in group_order(mcfg):
            store.set_version(g, step)
    return step


def tiermem_state(path: Path) -> dict:
    """A checkpoint's own state (step, epoch, RNG state, config): tiermem_state.json, or trainer_state.json
    in checkpoints written before that file."""
    own = Path(path) / "tiermem_state.json"
    return json.loads((own if own.is_file() else Path(path) / "trainer_state.json").read_text())


def rng_state() -> dict:
    return {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}


def set_rng_state(state: dict) -> None:
    import numpy as np

    if "torch" in state:
        torch.set_rng_state(torch.from_numpy(np.frombuffer(base64.b64decode(state["torch"]), dtype=np.uint8).copy()))
