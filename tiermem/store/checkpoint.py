"""The store's training state on disk: one zarr v3 array per kind, sharded, uncompressed.

All tensors of a kind (``master``, ``exp_avg``, ... in a given order) are laid end to end in one flat
array; its attributes hold each tensor's name, offset and shape. Shards are large (1 GiB) so a checkpoint
is a few big files, each written in one piece from a host buffer as tensors stream in; chunks equal to
the fill value are written too (``write_empty_chunks``), so a missing file is an error, never zeros.
Every shard's data carries a CRC32C (the array's ``crc32c`` attribute, one per shard, computed on the
host buffer as it is written, so it costs no second pass over the bytes), checked as the shard is read
back: a flipped byte is an error, never a wrong number. ``file_crc32c`` checksums other files.

    w = StateWriter(path, {"master": [(name, shape), ...], ...});  w.put("master", name, tensor) ...; w.close()
    r = StateReader(path);  r.get("master", name) -> numpy array
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import os
import re
from pathlib import Path

import numpy as np
import torch

from tiermem.errors import StorageError
from tiermem.store.shard_file import layout_at, read_shard, write_shard

CHUNK_ELEMS = 1 << 22  # 16 MiB of fp32
SHARD_CHUNKS = 64  # 1 GiB shards


def complete_checkpoints(out_dir: str | Path) -> list[tuple[int, Path]]:
    """The complete checkpoints in a run's ``out_dir`` (``checkpoint-N`` holding its ``checkpoint.json``,
    which a save writes last), oldest first: what a trainer resumes from, and what a service names."""
    out = Path(out_dir)
    found = []
    if out.is_dir():
        for p in out.iterdir():
            m = re.match(r"^checkpoint-(\d+)$", p.name)
            if m and p.is_dir() and (p / "checkpoint.json").is_file():
                found.append((int(m.group(1)), p))
    return sorted(found)


def crc32c_of(data) -> str:
    """The CRC32C of a contiguous numpy array's bytes, as 8 hex digits. The ``crc32c`` package releases the GIL
    while it runs (0.13 s for a 1 GiB shard), so the reading and copying threads beside it go on."""
    import crc32c

    return f"{crc32c.crc32c(np.ascontiguousarray(data).reshape(-1).view(np.uint8)):08x}"


def file_crc32c(path: str | Path, block: int = 64 << 20) -> str:
    """The CRC32C of a file's bytes, as 8 hex digits."""
    import crc32c

    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(block):
            crc = crc32c.crc32c(chunk, value=crc)
    return f"{crc:08x}"


class StateWriter:
    def __init__(self, path: str | Path, layout: dict[str, list[tuple[str, tuple[int, ...]]]], checksums: bool = True):
        """``checksums``: a CRC32C of every shard (False: none, as tiermem wrote before; benchmarks)."""
        import zarr

        self.path = Path(path)
        self._group = zarr.open_group(str(self.path), mode="w")
        self._kinds = {}
        for kind, tensors in layout.items():
            total = sum(math.prod(shape) for _, shape in tensors)
            chunk = min(CHUNK_ELEMS, max(total, 1))
            shard = chunk * min(SHARD_CHUNKS, math.ceil(max(total, 1) / chunk))
            arr = self._group.create_array(kind, shape=(total,), chunks=(chunk,), shards=(shard,), dtype="float32",
                                           compressors=None, fill_value=0.0,
                                           config={"write_empty_chunks": True})
            entries, off = [], 0
            for name, shape in tensors:
                entries.append([name, off, list(shape)])
                off += math.prod(shape)
            arr.attrs["tensors"] = entries
            direct = layout_at(self.path / kind)  # (as this zarr laid the array out; else zarr writes the shards)
            self._kinds[kind] = {"arr": arr, "kind": kind, "chunk": chunk, "direct": direct,
                                 "order": [e[0] for e in entries],
                                 "next": 0, "pos": 0,
                                 "buf": np.empty(shard, dtype=np.float32), "fill": 0, "shard": shard, "total": total,
                                 "crc": [] if checksums else None}
        # each shard's CRC32C is taken on a thread of its own while the same buffer is written
        self._crc = cf.ThreadPoolExecutor(1, thread_name_prefix="tiermem-ckpt-crc") if checksums else None

    def put(self, kind: str, name: str, tensor: torch.Tensor) -> None:
        """Append the next tensor of ``kind`` (tensors come in the layout's order)."""
        k = self._kinds[kind]
        if k["order"][k["next"]] != name:
            raise ValueError(f"{kind}: expected {k['order'][k['next']]} next, got {name}")
        k["next"] += 1
        flat = tensor.detach().reshape(-1).to(torch.float32).cpu().numpy()
        i = 0
        while i < flat.size:
            n = min(flat.size - i, k["shard"] - k["fill"])
            k["buf"][k["fill"]: k["fill"] + n] = flat[i: i + n]
            k["fill"] += n
            i += n
            if k["fill"] == k["shard"] or k["pos"] + k["fill"] == k["total"]:
                self._flush(k)

    def _flush(self, k) -> None:
        if k["fill"]:
            data = k["buf"][: k["fill"]]
            crc = self._crc.submit(crc32c_of, data) if self._crc is not None else None
            if k["direct"] == (k["shard"], k["chunk"]):
                folder = self.path / k["kind"] / "c"
                folder.mkdir(parents=True, exist_ok=True)
                write_shard(folder / str(k["pos"] // k["shard"]), data, k["shard"], k["chunk"])
            else:
                k["arr"][k["pos"]: k["pos"] + k["fill"]] = data
            if crc is not None:
                k["crc"].append(crc.result())
            k["pos"] += k["fill"]
            k["fill"] = 0

    def close(self) -> list[Path]:
        """Check every tensor came, record the shards' checksums, fsync every file; returns the files."""
        for kind, k in self._kinds.items():
            if k["next"] != len(k["order"]) or k["pos"] != k["total"]:
                raise ValueError(f"{kind}: {k['next']} of {len(k['order'])} tensors written")
            if k["crc"] is not None:
                k["arr"].attrs["crc32c"] = k["crc"]
        if self._crc is not None:
            self._crc.shutdown()
        return fsync_tree(self.path)


class StateReader:
    """A checkpoint's training state, read a tensor at a time in the order written. Whole shards are read,
    one ahead of the one in use — across kinds too, in ``order`` (the order the caller reads the kinds in) —
    and each shard's CRC32C is checked on another thread before any of it is used."""

    def __init__(self, path: str | Path, order: tuple[str, ...] = ()):
        import zarr

        self.path = Path(path)
        try:
            self._group = zarr.open_group(str(self.path), mode="r")
        except Exception as e:  # noqa: BLE001 - any failure to open is a damaged checkpoint
            raise StorageError(f"{self.path}: not a readable training-state store ({e})") from None
        self.index: dict[str, dict[str, tuple[int, tuple[int, ...]]]] = {}
        self.crcs: dict[str, list[str] | None] = {}
        self._direct: dict[str, tuple[int, int] | None] = {}  # kinds whose shard files are read in one piece
        for kind in self._group.array_keys():
            arr = self._group[kind]
            self._direct[kind] = layout_at(self.path / kind)
            self.index[kind] = {n: (off, tuple(shape)) for n, off, shape in arr.attrs["tensors"]}
            self.crcs[kind] = arr.attrs.get("crc32c")  # (none in checkpoints written before checksums)
        self.order = [k for k in order if k in self.index] + sorted(k for k in self.index if k not in order)
        self._cache: dict[str, tuple[int, np.ndarray]] = {}
        self._ahead: dict[str, tuple[int, cf.Future]] = {}
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="tiermem-ckpt-read")
        self._check = cf.ThreadPoolExecutor(1, thread_name_prefix="tiermem-ckpt-crc")

    def _read_shard(self, kind: str, s0: int) -> tuple[np.ndarray, cf.Future]:
        """A shard's data, and a future of its checksum's check (taken on another thread: the next shard's
        read overlaps it)."""
        arr = self._group[kind]
        shard = arr.shards[0] if arr.shards else arr.chunks[0]
        direct = self._direct.get(kind)
        if direct is not None:
            data = read_shard(self.path / kind / "c" / str(s0 // shard), shard, direct[1],
                              min(shard, arr.shape[0] - s0))
            return data, self._check.submit(self._verify, kind, s0 // shard, data)
        try:
            data = arr[s0: min(s0 + shard, arr.shape[0])]
        except Exception as e:  # noqa: BLE001 - a truncated, missing or garbled shard
            raise StorageError(f"{self.path / kind}: cannot read shard at {s0} ({str(e)[:160]})") from None
        return data, self._check.submit(self._verify, kind, s0 // shard, data)

    def _verify(self, kind: str, n: int, data: np.ndarray) -> None:
        crcs = self.crcs.get(kind)
        if crcs is not None and (n >= len(crcs) or crc32c_of(data) != crcs[n]):
            raise StorageError(f"{self.path / kind}: shard {n} does not match its checksum")

    def get(self, kind: str, name: str) -> np.ndarray:
        """One tensor. Reading a kind's tensors in order reads each shard once, the next one ahead."""
        off, shape = self.index[kind][name]
        n = math.prod(shape)
        arr = self._group[kind]
        shard = arr.shards[0] if arr.shards else arr.chunks[0]
        whole = n and off // shard == (off + n - 1) // shard and self._direct.get(kind) is not None
        out = None if whole else np.empty(n, dtype=np.float32)
        i = 0
        while i < n:  # read whole shards once (tensors come in order), slice tensors out of them
            s0 = (off + i) // shard * shard
            cached = self._cache.get(kind)
            if cached is None or cached[0] != s0:
                ahead = self._ahead.pop(kind, None)
                data, check = ahead[1].result() if ahead is not None and ahead[0] == s0 else self._read_shard(kind, s0)
                if s0 + shard < arr.shape[0]:
                    self._ahead[kind] = (s0 + shard, self._pool.submit(self._read_shard, kind, s0 + shard))
                elif kind in self.order and self.order.index(kind) + 1 < len(self.order):  # the next kind's first
                    after = self.order[self.order.index(kind) + 1]
                    self._ahead.setdefault(after, (0, self._pool.submit(self._read_shard, after, 0)))
                check.result()  # refused before use
                cached = self._cache[kind] = (s0, data)
            take = min(n - i, s0 + cached[1].size - (off + i))
            start = off + i - s0
            if out is None:  # within one shard read in one piece: a view of it (a buffer of its own, never reused)
                return cached[1][start: start + take].reshape(shape)
            out[i: i + take] = cached[1][start: start + take]
            i += take
        return out.reshape(shape)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._check.shutdown(wait=True, cancel_futures=True)
        self._cache.clear()
        self._ahead.clear()


def fsync_tree(root: str | Path) -> list[Path]:
    """fsync every file under ``root``, then every directory from the deepest up; returns the files."""
    root = Path(root)
    files = sorted(p for p in root.rglob("*") if p.is_file())
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for d in sorted({p.parent for p in root.rglob("*")} | {root}, key=lambda p: len(p.parts), reverse=True):
        fsync_dir(d)
    return files


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
