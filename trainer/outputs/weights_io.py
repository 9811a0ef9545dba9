"""Hugging Face model directories in and out of the store, one tensor at a time.

Import reads ``model.safetensors`` or the shards named by ``model.safetensors.index.json`` tensor by
tensor (memory-mapped) and writes each into the store as its compute copy and, in bf16 mode, its fp32
master. Export streams each tensor out of the store into sharded safetensors files written by a small
streaming writer (header first, then each tensor's bytes), plus ``model.safetensors.index.json``,
config.json and the tokenizer files, so ``AutoModelForCausalLM.from_pretrained(output_dir)`` loads it.

A model of the generic path reads and writes its checkpoint's own layout (``trainer.model.disk_layout``:
transformers' conversion rules, e.g. one tensor per expert on disk, the experts fused in the store): its
tensors are converted on the way in and reverted on the way out, a set of them at a time.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from pathlib import Path

import crc32c
import torch

from tiermem.errors import ConfigError, StorageError, UserError
from tiermem.files import is_regular, read_json
from tiermem.optim.finite import all_finite, weights_norm
from tiermem.specs import state_name
from trainer.model.config import ModelConfig
from trainer.model.weights import LM_HEAD, Weight, all_weights, init_weight

SHARD_BYTES = 5 * 10**9
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def weight_files(model_dir: str | Path) -> list[Path]:
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if is_regular(index, "the safetensors index"):
        data = read_json(index, "safetensors index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(s, str) and s and "\0" not in s
                                                       for s in weight_map.values()):
            raise ConfigError(f"{index}: not a valid safetensors index (its weight_map must map each tensor's name to "
                              "the file name of its shard)")
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not is_regular(d / s, "the shard")]
        if missing:
            raise ConfigError(f"{d}: shard {missing[0]} named in the index is missing")
        return [d / s for s in shards]
    if is_regular(d / "model.safetensors", "the weights"):
        return [d / "model.safetensors"]
    if any(d.glob("*.bin")) or any(d.glob("*.pth")):
        raise ConfigError(f"{d}: only safetensors weights are supported; convert the .bin/.pth weights first")
    raise ConfigError(f"{d}: no model.safetensors or model.safetensors.index.json (use tiermem_init: random "
                      "to start from config.json alone)")


def _open(path: Path):
    """A safetensors file opened (its header read and checked against the file's size), or one line."""
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a bad header or size
        raise ConfigError(f"{path}: not a readable safetensors file ({str(e)[:160]}); download it again") from None


def check_weight_files(cfg: ModelConfig, model_dir: str | Path) -> list[Path]:
    """The model's weight files, their headers checked against config.json before anything is loaded:
    every tensor the model needs is there once, of its shape, in a floating-point dtype."""
    if getattr(cfg, "generic", False):  # (as converted by transformers' rules: trainer.model.disk_layout)
        files = weight_files(model_dir)
        disk_layout(cfg, model_dir, files)
        return files
    wanted = {w.name: w for w in all_weights(cfg)}
    seen: set[str] = set()
    files = weight_files(model_dir)
    for path in files:
        with _open(path) as f:
            for key in f.keys():
                w = wanted.get(key)
                if w is None:
                    if key.endswith("rotary_emb.inv_freq") or (key == LM_HEAD and cfg.tie_word_embeddings):
                        continue
                    raise ConfigError(f"{path}: unexpected tensor {key} (does config.json match the weights?)")
                sl = f.get_slice(key)
                shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
                if dtype not in ("F32", "BF16", "F16", "F64"):
                    raise ConfigError(f"{path}: {key} is {dtype}; the model's weights must be floating point")
                if shape != w.shape:
                    raise ConfigError(f"{path}: {key} has shape {list(shape)}, config.json implies {list(w.shape)}")
                seen.add(key)
    missing = [n for n in wanted if n not in seen]
    if missing:
        raise ConfigError(f"{model_dir}: weights lack {missing[0]}" + (f" and {len(missing) - 1} more"
                                                                         if len(missing) > 1 else ""))
    return files


def _write_all(store, w: Weight, t: torch.Tensor, kinds: dict[str, torch.dtype], names: set | None = None) -> list:
    return [store.write(state_name(w.name, kind), t.to(dtype)) for kind, dtype in kinds.items()
            if names is None or state_name(w.name, kind) in names]


def import_weights(store, cfg: ModelConfig, model_dir: str | Path, kinds: dict[str, torch.dtype],
                   progress=None, names: set | None = None) -> None:
    """Load every weight of ``model_dir`` (its headers checked by ``check_weight_files``) into the store as
    each kind in ``kinds`` (kind -> dtype); ``names``: only these store names (several ranks: each writes
    what its store holds)."""
    if getattr(cfg, "generic", False):
        return _import_converted(store, cfg, model_dir, kinds, progress, names)
    wanted = {w.name: w for w in all_weights(cfg)}
    for path in check_weight_files(cfg, model_dir):
        with _open(path) as f:
            for key in f.keys():
                w = wanted.get(key)
                if w is None:  # (a tied head or rotary inv_freq: checked, not trained)
                    continue
                try:
                    t = f.get_tensor(key)
                except Exception as e:  # noqa: BLE001 - a file changed or cut since its header was read
                    raise ConfigError(f"{path}: cannot read {key} ({str(e)[:120]})") from None
                for fut in _write_all(store, w, t, kinds, names):
                    fut.result()
                if progress:
                    progress(t.numel())


def disk_layout(cfg, model_dir: str | Path, files: list[Path] | None = None):
    """A generic-path model's checkpoint layout in ``model_dir`` (``trainer.model.disk_layout``): its weight files'
    (``files``, else those found there; their headers checked), else, where it has none, the layout
    ``save_pretrained`` writes. Kept on the config."""
    from trainer.model.config import ModelConfigError
    from trainer.model.disk_layout import read_layout, saved_layout

    key = str(model_dir)
    if key not in cfg.layouts:
        if files is None:
            try:
                files = weight_files(model_dir)
            except ConfigError:
                files = []
        disk = {}
        for path in files:
            with _open(path) as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    disk[name] = (tuple(sl.get_shape()), sl.get_dtype(), str(path))
        try:
            cfg.layouts[key] = read_layout(cfg.model, disk, key) if files else saved_layout(cfg.model, key)
        except ModelConfigError as e:
            raise ConfigError(str(e)) from None
    return cfg.layouts[key]


def _converted(cfg, model_dir: str | Path, only=None):
    """Each set of ``model_dir``'s tensors converted as transformers loads them: (in-memory name, tensor) pairs;
    ``only(unit)``: the sets to read."""
    layout = disk_layout(cfg, model_dir, weight_files(model_dir))
    files: dict[str, object] = {}

    def read(name: str) -> torch.Tensor:
        path = layout.where[name]
        if path not in files:
            files[path] = _open(Path(path))
        try:
            return files[path].get_tensor(name)
        except Exception as e:  # noqa: BLE001 - a file changed or cut since its header was read
            raise ConfigError(f"{path}: cannot read {name} ({str(e)[:120]})") from None

    for unit in layout.units:
        if only is None or only(unit):
            yield from layout.convert(unit, read).items()


def _import_converted(store, cfg, model_dir, kinds, progress, names) -> None:
    wanted = {w.name: w for w in all_weights(cfg)}
    for name, t in _converted(cfg, model_dir):
        w = wanted.get(name)
        if w is None:  # (a persistent buffer: load_buffers; a tied head: the embedding's)
            continue
        for fut in _write_all(store, w, t, kinds, names):
            fut.result()
        if progress:
            progress(t.numel())


def load_buffers(cfg, model_dir: str | Path) -> None:
    """A generic-path model's persistent buffers (not trained: DeepSeek-V3's ``e_score_correction_bias``) from
    ``model_dir``'s weights, into the model the stages are made from."""
    buffers = cfg.buffers() if getattr(cfg, "generic", False) else {}
    if not buffers:
        return
    for name, t in _converted(cfg, model_dir, lambda unit: any(n in buffers for n in unit.targets)):
        if name in buffers:
            cfg.set_buffer(name, t)


def init_weights(store, cfg: ModelConfig, kinds: dict[str, torch.dtype], seed: int, device: torch.device,
                 progress=None, names: set | None = None) -> None:
    """Random initialisation from config.json alone (``tiermem_init: random``); ``names``: only these store
    names are written (every weight is drawn, in order, so each has the same values wherever it is written)."""
    gen = torch.Generator(device).manual_seed(seed)
    for w in all_weights(cfg):
        t = init_weight(w, cfg, gen, device)
        for fut in _write_all(store, w, t, kinds, names):
            fut.result()
        if progress:
            progress(t.numel())


# bytes of an exported shard written between flushes to the disk: the export then holds little of itself in the
# page cache beside a DRAM tier that takes most of the host's RAM (the 14B run's: 112.5 of 125 GiB)
WRITE_THROUGH = 256 << 20


class _ShardWriter:
    """Writes one safetensors file: the header (all names, dtypes, shapes, offsets), then the bytes in order."""

    def __init__(self, path: Path, items: list[tuple[str, tuple[int, ...], torch.dtype]]):
        header, off = {}, 0
        for name, shape, dtype in items:
            n = dtype.itemsize
            for s in shape:
                n *= s
            header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path, self.tmp = path, path.with_name(path.name + ".tmp")
        self.f = self.tmp.open("wb")
        self._dirty = 0
        self.crc = 0  # the CRC32C of the file's bytes, taken as they are written
        self._put(struct.pack("<Q", len(raw)) + raw)
        self.size = off

    def _put(self, b) -> None:
        self.f.write(b)
        self.crc = crc32c.crc32c(b, value=self.crc)
        self._dirty += len(b)
        if self._dirty >= WRITE_THROUGH:  # (the page cache holds at most this much of the export unwritten)
            self.f.flush()
            os.fdatasync(self.f.fileno())
            os.posix_fadvise(self.f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            self._dirty = 0

    def write(self, t: torch.Tensor) -> None:
        data = t.contiguous().view(-1).view(torch.uint8).numpy()  # (written and checksummed without a copy)
        for a in range(0, len(data), WRITE_THROUGH):
            self._put(data[a: a + WRITE_THROUGH])

    def close(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        """Give up the file: close it and remove what was written."""
        try:
            self.f.close()
        except OSError:
            pass
        self.tmp.unlink(missing_ok=True)


class NonFiniteWeights(UserError):
    """A weight about to be written out (a checkpoint, the exported model) is inf or NaN: it is not written."""

    def __init__(self, name: str, what: str):
        super().__init__(f"{name} holds inf or NaN weights: {what} is not written and the run stops (the last "
                         "checkpoint is intact); lower learning_rate (or weight_decay), or raise adam_epsilon")


class ModelWriter:
    """Writes a model directory in Hugging Face format from tensors handed over in ``all_weights`` order
    (``put(name, tensor)``): safetensors shards of at most SHARD_BYTES (+ index when more than one),
    config.json with the dtype, and the tokenizer files of ``model_dir``. A tensor holding inf or NaN is refused
    (``NonFiniteWeights``, naming ``what`` is written): no checkpoint or exported model holds one."""

    def __init__(self, cfg: ModelConfig, out_dir: str | Path, dtype: torch.dtype, model_dir: str | Path,
                 what: str = "the model"):
        self.cfg, self.out, self.dtype, self.model_dir = cfg, Path(out_dir), dtype, Path(model_dir)
        self.what = what
        self.out.mkdir(parents=True, exist_ok=True)
        self._exporter = None  # a generic-path model: its checkpoint's layout, from the store's tensors
        items = [(w.name, w.shape) for w in all_weights(cfg)]
        if getattr(cfg, "generic", False):
            from trainer.model.disk_layout import Exporter

            self._exporter = Exporter(disk_layout(cfg, model_dir), [n for n, _ in items], cfg.buffers())
            items = self._exporter.items
        shards, cur, size = [], [], 0
        for w in items:
            n = dtype.itemsize
            for d in w[1]:
                n *= d
            if cur and size + n > SHARD_BYTES:
                shards.append(cur)
                cur, size = [], 0
            cur.append(w)
            size += n
        shards.append(cur)
        self.names = (["model.safetensors"] if len(shards) == 1 else
                      [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
        self._plan = [(name, w) for name, shard in zip(self.names, shards) for w in shard]
        self._shards = dict(zip(self.names, shards))
        self._next = 0
        self._writer: _ShardWriter | None = None
        self.weight_map: dict[str, str] = {}
        self.total = 0
        self.crc32c: dict[str, str] = {}  # each shard's CRC32C, as written

    def put(self, name: str, t: torch.Tensor) -> None:
        if not math.isfinite(float(weights_norm([t]))) and not all_finite([t]):  # (the exact look only then)
            raise NonFiniteWeights(name, self.what)
        for n, x in self._exporter.feed(name, t) if self._exporter is not None else [(name, t)]:
            self._put(n, x)

    def _put(self, name: str, t: torch.Tensor) -> None:
        file, (want, _) = self._plan[self._next]
        if want != name:
            raise ValueError(f"expected {want} next, got {name}")
        if self._writer is None:
            self._writer = _ShardWriter(self.out / file, [(x, shape, self.dtype) for x, shape in self._shards[file]])
        if t.dtype == self.dtype:
            self._writer.write(t)
        else:  # (converted a piece at a time: the 14B export's fp32 embedding, 3.1 GB, took 1.6 GB more whole)
            flat, n = t.reshape(-1), WRITE_THROUGH // self.dtype.itemsize
            for a in range(0, flat.numel(), n):
                self._writer.write(flat[a: a + n].to(self.dtype))
        self.weight_map[name] = file
        self._next += 1
        if self._next == len(self._plan) or self._plan[self._next][0] != file:
            self._writer.close()
            self.crc32c[file] = f"{self._writer.crc:08x}"
            self.total += self._writer.size
            self._writer = None

    def abort(self) -> None:
        """Give up the shard being written (a failure): no temp file stays behind."""
        if self._writer is not None:
            self._writer.abort()
            self._writer = None

    def close(self) -> list[Path]:
        if self._next != len(self._plan):
            raise ValueError(f"model writer closed after {self._next} of {len(self._plan)} tensors")
        for stale in list(self.out.glob("model*.safetensors")) + list(self.out.glob("model.safetensors.index.json")):
            if stale.name not in self.names:
                stale.unlink()
        if len(self.names) > 1:
            _write_json(self.out / "model.safetensors.index.json",
                        {"metadata": {"total_size": self.total}, "weight_map": self.weight_map})
        config = dict(self.cfg.raw)
        dname = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[self.dtype]
        config.pop("torch_dtype", None)  # transformers 5 reads dtype and warns that torch_dtype is deprecated
        config["dtype"] = dname
        _write_json(self.out / "config.json", config)
        for fname in TOKENIZER_FILES:
            if (self.model_dir / fname).is_file() and self.model_dir.resolve() != self.out.resolve():
                shutil.copyfile(self.model_dir / fname, self.out / fname)
        return [self.out / n for n in self.names]


def export_model(store, cfg: ModelConfig, out_dir: str | Path, source_kind: str, dtype: torch.dtype,
                 model_dir: str | Path, progress=None) -> list[Path]:
    """Write the model in Hugging Face format to ``out_dir``, reading ``source_kind`` (param or master). A master
    weight the store does not hold (several ranks: it lives in another rank's HBM) is read as its compute copy,
    which the update made from it: the same values in the exported dtype (the compute copy's)."""
    writer = ModelWriter(cfg, out_dir, dtype, model_dir)
    try:
        for w in all_weights(cfg):
            name = state_name(w.name, source_kind)
            t = store.read(name if store.holds(name) else w.name).result()
            writer.put(w.name, t)
            if progress:
                progress(t.numel())
        return writer.close()
    except OSError as e:
        writer.abort()
        raise StorageError(f"cannot write the model to {out_dir}: {e.strerror or e}; free disk space and run "
                           "again (training resumes from the newest checkpoint, if any)") from None
    except BaseException:
        writer.abort()
        raise


def _write_json(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
