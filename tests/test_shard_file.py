"""Checkpoint state written and read in one piece a shard (tiermem.store.shard_file): the files are the bytes
zarr writes, zarr reads them, and the one-piece read equals zarr's for any layout of tensors over chunks and
shards; a damaged shard file is an error naming it; layouts it does not know go to zarr."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiermem.errors import StorageError
from tiermem.store import checkpoint as sc
from tiermem.store.shard_file import direct_layout, read_shard, write_shard


def _write(path, sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    tensors = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
    layout = {"master": [(k, tuple(v.shape)) for k, v in tensors.items()],
              "exp_avg": [(k, tuple(v.shape)) for k, v in tensors.items()]}
    w = sc.StateWriter(path, layout)
    for kind in layout:
        for k, v in tensors.items():
            w.put(kind, k, v * (2 if kind == "exp_avg" else 1))
    w.close()
    return tensors


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(1, 700), min_size=1, max_size=6), chunk=st.sampled_from([16, 64, 100]),
       per_shard=st.integers(1, 4))
def test_one_piece_reads_equal_zarr_and_the_tensors_written(tmp_path_factory, monkeypatch, sizes, chunk, per_shard):
    monkeypatch.setattr(sc, "CHUNK_ELEMS", chunk)
    monkeypatch.setattr(sc, "SHARD_CHUNKS", per_shard)
    path = tmp_path_factory.mktemp("state") / "state.zarr"
    tensors = _write(path, sizes)
    direct = sc.StateReader(path, order=("master", "exp_avg"))
    via_zarr = sc.StateReader(path, order=("master", "exp_avg"))
    via_zarr._direct = dict.fromkeys(via_zarr._direct)  # (zarr's own read of every shard)
    assert all(v is not None for v in direct._direct.values())
    try:
        for kind in ("master", "exp_avg"):
            for k, v in tensors.items():
                a, b = direct.get(kind, k), via_zarr.get(kind, k)
                assert np.array_equal(a, b)
                assert np.array_equal(a, (v * (2 if kind == "exp_avg" else 1)).numpy())
    finally:
        direct.close()
        via_zarr.close()


def test_chunks_out_of_order_or_absent_are_placed_by_the_index(tmp_path):
    """A shard zarr wrote without its empty chunks (write_empty_chunks off): the later chunks lie elsewhere
    than in order, the absent one reads as the fill value, as zarr reads it."""
    path = tmp_path / "a.zarr"
    arr = zarr.create_array(str(path), shape=(300,), chunks=(64,), shards=(256,), dtype="float32",
                            compressors=None, fill_value=0.0, config={"write_empty_chunks": False})
    data = np.arange(300, dtype=np.float32) + 1
    data[64:128] = 0  # chunk 1 of shard 0: not stored
    arr[:] = data
    shard, chunk = direct_layout(json.loads((path / "zarr.json").read_text()))
    assert (shard, chunk) == (256, 64)
    assert np.array_equal(read_shard(path / "c" / "0", shard, chunk, 256), data[:256])
    assert np.array_equal(read_shard(path / "c" / "1", shard, chunk, 44), data[256:])


def test_a_damaged_shard_file_is_an_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(sc, "CHUNK_ELEMS", 64)
    path = tmp_path / "state.zarr"
    _write(path, [500])
    f = path / "master" / "c" / "0"
    good = f.read_bytes()
    f.write_bytes(good[:-20] + bytes(b ^ 0xFF for b in good[-20:-4]) + good[-4:])  # the index, flipped
    with pytest.raises(StorageError, match="index does not match its checksum") as e:
        read_shard(f, 512, 64, 500)  # (8 chunks of 64 a shard)
    assert str(f) in str(e.value)
    f.write_bytes(good[:10])  # cut short
    with pytest.raises(StorageError, match="cannot hold the index"):
        read_shard(f, 512, 64, 500)


def test_other_layouts_are_left_to_zarr(tmp_path):
    path = tmp_path / "z.zarr"
    zarr.create_array(str(path), shape=(100,), chunks=(10,), shards=(50,), dtype="float32")  # compressed
    assert direct_layout(json.loads((path / "zarr.json").read_text())) is None
    assert direct_layout({"codecs": "garbled"}) is None


@pytest.mark.parametrize("total,chunk,shard", [(256, 64, 256), (300, 64, 256), (1000, 64, 128), (7, 4, 16)])
def test_a_shard_written_in_one_piece_is_the_bytes_zarr_writes(tmp_path, total, chunk, shard):
    """Full shards, the last one cut short, its last chunk padded, chunks past the array's end absent."""
    path = tmp_path / "z.zarr"
    arr = zarr.create_array(str(path), shape=(total,), chunks=(chunk,), shards=(shard,), dtype="float32",
                            compressors=None, fill_value=0.0, config={"write_empty_chunks": True})
    data = np.arange(total, dtype=np.float32) + 1
    arr[:] = data
    assert direct_layout(json.loads((path / "zarr.json").read_text())) == (shard, chunk)
    for s0 in range(0, total, shard):
        write_shard(tmp_path / "mine", data[s0: s0 + shard], shard, chunk)
        assert (tmp_path / "mine").read_bytes() == (path / "c" / str(s0 // shard)).read_bytes()
