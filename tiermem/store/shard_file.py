"""One shard file of a checkpoint's training state, written and read in one piece without zarr's per-chunk path.

The state is a zarr v3 array per kind (``tiermem.store.checkpoint``); zarr writes it, and reads any layout. But
zarr reads a shard chunk by chunk through its event loop at a quarter of the disk's speed (0.36-0.45 GB/s
where one read of the same file into a buffer takes 1.5-1.6 GB/s on the CPU machine; on the GPU machine's
3B checkpoint the load ran at 0.71 GB/s against the disk's 1.47). Arrays written as ``StateWriter`` writes
them — float32, one sharding codec, chunks of raw little-endian bytes, the index at the end, little-endian and
closed by its CRC32C (the zarr v3 sharding spec) — are read here instead: the whole file into one buffer
(the GIL released throughout), the index checked against its CRC32C, the chunks placed by the index (a view of
the buffer when they lie in order, as written). Any other layout is left to zarr (``direct_layout`` None).
Writing is the same in reverse (zarr wrote a shard at a third of the speed of one write of its bytes on the CPU
machine, and the GPU machine's 3B checkpoint saved at 0.56 of the disk's fsynced write): the chunks in order,
the last one padded with the fill value, then the index and its CRC32C — the bytes zarr writes for it.
"""

from __future__ import annotations

import json
import os

import numpy as np

from tiermem.errors import StorageError

EMPTY = np.uint64(2**64 - 1)  # an index entry of a chunk the shard does not hold (zarr: the fill value)
_READ = 64 << 20


def direct_layout(meta: dict) -> tuple[int, int] | None:
    """(shard elements, chunk elements) of an array's zarr.json metadata that ``read_shard`` reads, else None."""
    try:
        (codec,) = meta["codecs"]
        conf = codec["configuration"]
        ok = (meta["zarr_format"] == 3 and meta["data_type"] == "float32" and len(meta["shape"]) == 1
              and meta["chunk_key_encoding"] == {"name": "default", "configuration": {"separator": "/"}}
              and not meta.get("storage_transformers") and codec["name"] == "sharding_indexed"
              and conf["codecs"] == [{"name": "bytes", "configuration": {"endian": "little"}}]
              and conf["index_codecs"] == [{"name": "bytes", "configuration": {"endian": "little"}},
                                           {"name": "crc32c"}]
              and conf.get("index_location", "end") == "end" and meta["fill_value"] == 0.0)
        if not ok:
            return None
        (shard,), (chunk,) = meta["chunk_grid"]["configuration"]["chunk_shape"], conf["chunk_shape"]
    except (KeyError, TypeError, ValueError):
        return None
    return (int(shard), int(chunk)) if shard > 0 and chunk > 0 and shard % chunk == 0 else None


def write_shard(path: os.PathLike | str, data: np.ndarray, shard: int, chunk: int) -> None:
    """Write ``data`` (float32, at most ``shard`` elements: a shard, or the array's last one cut short) as the
    shard file at ``path``, laid out as ``direct_layout`` describes; chunks past its end are absent."""
    import crc32c

    n = shard // chunk
    data = np.ascontiguousarray(data, dtype="<f4").reshape(-1)
    present = -(-data.size // chunk)
    index = np.full((n, 2), EMPTY, dtype="<u8")
    index[:present, 0] = np.arange(present, dtype=np.uint64) * np.uint64(chunk * 4)
    index[:present, 1] = chunk * 4
    tail = index.tobytes()
    tail += crc32c.crc32c(tail).to_bytes(4, "little")
    pad = bytes(4 * (present * chunk - data.size))  # (the last chunk, full: the fill value 0.0 after the data)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for part in (memoryview(data.view(np.uint8)), memoryview(pad + tail)):
            done = 0
            while done < len(part):
                done += os.write(fd, part[done: done + _READ])
    finally:
        os.close(fd)


def layout_at(array_dir: os.PathLike | str) -> tuple[int, int] | None:
    """``direct_layout`` of the zarr array stored in ``array_dir`` (its zarr.json); None when unreadable."""
    try:
        with open(os.path.join(array_dir, "zarr.json"), "rb") as f:
            return direct_layout(json.loads(f.read()))
    except (OSError, ValueError):
        return None


def read_file(path: os.PathLike | str) -> np.ndarray:
    """A whole file's bytes, read into one buffer (``os.readv``: the GIL is released while the disk works), then
    dropped from the page cache (the caller keeps the data; the cache would only crowd the host's memory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise StorageError(f"{path}: {e.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        buf = np.empty(size, dtype=np.uint8)
        view, done = memoryview(buf), 0
        while done < size:
            n = os.readv(fd, [view[done: done + _READ]])
            if n == 0:
                raise StorageError(f"{path}: ends at {done} of {size} bytes")
            done += n
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return buf
    finally:
        os.close(fd)


def read_shard(path: os.PathLike | str, shard: int, chunk: int, length: int) -> np.ndarray:
    """The first ``length`` float32 elements of the shard file at ``path`` (a shard of ``shard`` elements in
    chunks of ``chunk``), as ``direct_layout`` describes it."""
    import crc32c

    buf = read_file(path)
    n = shard // chunk
    index_end = buf.size - 4
    index_start = index_end - 16 * n
    if index_start < 0:
        raise StorageError(f"{path}: {buf.size} bytes cannot hold the index of {n} chunks")
    stored = int.from_bytes(buf[index_end:].tobytes(), "little")
    if crc32c.crc32c(buf[index_start:index_end]) != stored:
        raise StorageError(f"{path}: the shard's index does not match its checksum")
    index = buf[index_start:index_end].view("<u8").reshape(n, 2)
    needed = -(-length // chunk)
    step = chunk * 4
    if needed <= n and all(int(index[j, 0]) == j * step and int(index[j, 1]) == step for j in range(needed)):
        return buf[: length * 4].view("<f4")  # the chunks in order, as written: a view, no copy
    out = np.zeros(length, dtype=np.float32)  # (chunks the shard does not hold: the fill value, 0.0)
    for j in range(min(needed, n)):
        off, nbytes = index[j]
        if off == EMPTY and nbytes == EMPTY:
            continue
        off, nbytes = int(off), int(nbytes)
        if nbytes != step or off + nbytes > index_start:
            raise StorageError(f"{path}: chunk {j} of the shard's index lies outside its data")
        take = min(chunk, length - j * chunk)
        out[j * chunk: j * chunk + take] = buf[off: off + take * 4].view("<f4")
    return out
