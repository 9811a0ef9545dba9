"""The shared-memory arena: shared by name across processes, removed on close, detectable when left
behind, and one-line errors when it cannot be made."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tiermem.cli.main import main
from tiermem.errors import StorageError
from tiermem.tiers.dram import DramArena, list_arenas


def test_views_are_zero_copy_and_shared_with_another_process(store_name):
    with DramArena.create(store_name, 1 << 20) as arena:
        e = arena.allocate(10_000)
        assert e.offset % 4096 == 0
        v = arena.view(e, 8).view(torch.int64)
        v.fill_(1234567)
        code = ("import sys, torch; from tiermem.tiers.dram import DramArena\n"
                f"a = DramArena.attach({store_name!r})\n"
                f"v = a.view(type('E', (), {{'offset': {e.offset}, 'nbytes': 8}})(), 8).view(torch.int64)\n"
                "assert v.item() == 1234567, v.item()\n"
                "v.fill_(42); a.close()\n")
        subprocess.run([sys.executable, "-c", code], check=True)
        assert v.item() == 42  # the other process wrote into our memory
        path = arena.path
        assert path.exists()
    assert not path.exists()  # the owner removes it on close


def test_left_behind_arena_is_detected_and_cleaned(store_name, capsys):
    code = ("import os; from tiermem.tiers.dram import DramArena\n"
            f"DramArena.create({store_name!r}, 1 << 16)\nos._exit(0)\n")
    subprocess.run([sys.executable, "-c", code], check=True)
    info = [a for a in list_arenas() if a.name == store_name]
    assert len(info) == 1 and not info[0].alive and info[0].pid != os.getpid()
    with pytest.raises(StorageError, match="left behind by pid .* `tiermem arenas --clean`"):
        DramArena.create(store_name, 1 << 16)
    assert main(["arenas", "--clean"]) == 0
    assert "left behind" in capsys.readouterr().out
    assert not info[0].path.exists()


def test_arena_errors(tmp_path, store_name):
    with pytest.raises(StorageError, match="does not exist"):
        DramArena.create(store_name, 1 << 16, tmp_path / "nope")
    with pytest.raises(StorageError, match="free; lower tiers.dram.budget"):
        DramArena.create(store_name, 1 << 50)
    assert not any(a.name == store_name for a in list_arenas())
    with DramArena.create(store_name, 1 << 16):
        with pytest.raises(StorageError, match="owned by running pid"):
            DramArena.create(store_name, 1 << 16)


def test_anonymous_arena_is_private(store_name):
    with DramArena.create(store_name, 1 << 20, "anonymous") as arena:
        assert arena.path is None
        v = arena.view(arena.allocate(4096))
        v.fill_(9)
        assert int(v.sum()) == 9 * 4096
    with pytest.raises(StorageError, match="cannot be shared"):
        DramArena.attach(store_name, "anonymous")


def test_a_pinned_arena_keeps_its_header(tmp_path, monkeypatch):
    """Pinning first touches (zeroes) the pages; the header page, which names the arena to other processes,
    must survive it."""
    import tiermem.tiers.dram as dram

    monkeypatch.setattr(dram, "cuda_register", lambda *a: None)
    monkeypatch.setattr(dram, "cuda_unregister", lambda *a: None)
    with dram.DramArena.create("hdr", 1 << 20, tmp_path, pin=True) as arena:
        assert [a.name for a in dram.list_arenas(tmp_path)] == ["hdr"]
        with dram.DramArena.attach("hdr", tmp_path) as other:
            assert other.size == arena.size


def test_a_process_attached_to_the_arena_never_allocates_in_it(store_name, nvme_dir):
    """The arena's free space is its owner's (the service writes new state there at any time): a trainer
    attached to it stages an NVMe -> GPU read through memory of its own, and may not allocate at all."""
    from tiermem.tiers.extents import Extent, ExtentAllocator
    from tiermem.tiers.gpu import GpuTier
    from tiermem.tiers.nvme import NvmeTier
    from tiermem.transfer.mover import Location, Mover

    nvme = NvmeTier(nvme_dir, store_name, 1 << 20, backend="posix")
    with DramArena.create(store_name, 1 << 20) as owner:
        mine = owner.view(Extent(4096, owner.capacity)).view(torch.int32)
        mine.fill_(-7)  # the owner's state, everywhere in the arena
        attached = DramArena.attach(store_name)
        attached.allocator = ExtentAllocator(attached.size - 4096, 4096, base=4096)  # as a trainer's store has
        with pytest.raises(RuntimeError, match="another process"):
            attached.allocate(4096)
        data = torch.arange(1024, dtype=torch.int32)
        ext = nvme.allocate(4096)
        nvme.pwrite(data.view(torch.uint8), ext).result()
        gpu = GpuTier(torch.device("cpu"), 0, 4096, 1)  # the CPU stand-in: a slot of "GPU" memory
        mover = Mover({"gpu": gpu, "dram": attached, "nvme": nvme})
        try:
            slot = gpu.acquire_slot()
            mover.copy(Location("nvme", ext, 4096), Location("gpu", slot.extent, 4096), bulk=True).result()
            assert torch.equal(gpu.view(slot.extent, 4096).view(torch.int32), data)
            assert (mine == -7).all()  # no byte of the owner's touched
            # the optimizer's state (bulk) leaves the lane the layer fetches use alone
            assert (mover.links["dram->gpu bulk"].bytes, mover.links["dram->gpu"].bytes) == (4096, 0)
        finally:
            mover.close()
            attached.close()
    nvme.close()


def test_a_read_tensor_is_not_kept_alive_by_the_store(store_name):
    """The store orders operations per group and kind through the last one's future; that future must not hold
    a read's tensor (the 14B export read each group once and kept one tensor of every group alive, until the
    host ran out of memory)."""
    import gc
    import weakref

    from tiermem.config import load_store_config
    from tiermem.specs import TensorSpec
    from tiermem.store.store import Store

    cfg = load_store_config({"tiers": {"gpu": {"device": "cpu"}, "dram": {"budget": "64MiB"}},
                             "placement": {"param": "dram"}, "name": store_name})
    specs = [TensorSpec(f"w{i}", (1000,), torch.float32, "param", 0) for i in range(2)]
    with Store.open(cfg, specs) as store:
        for s in specs:
            store.write(s.name, torch.ones(1000)).result()
        t = store.read("w1").result()
        alive = weakref.ref(t)
        del t
        gc.collect()
        assert alive() is None
        store.flush("param")  # (the tail still orders and reports)


def test_malformed_arena_headers_are_skipped_with_a_note_and_the_rest_listed(tmp_path, store_name, capsys):
    """One arena file of a malformed header (a pid that is a word, no pid, a list, garbage, a FIFO) had ended
    `tiermem arenas` in a traceback (or a wait) for every arena of the directory."""
    import json

    from tiermem.tiers.dram import MAGIC

    bad = {"word-pid": MAGIC + json.dumps({"name": "a", "pid": "x", "size": 8192, "created": 1.0}).encode(),
           "no-pid": MAGIC + json.dumps({"name": "b", "size": 8192, "created": 1.0}).encode(),
           "a-list": MAGIC + b"[1, 2]", "garbage": MAGIC + b"\xff\xfe{", "empty": b""}
    for name, head in bad.items():
        (tmp_path / f"{name}.arena").write_bytes(head.ljust(8192, b"\0"))
    os.mkfifo(tmp_path / "fifo.arena")
    with DramArena.create(store_name, 1 << 16, tmp_path) as arena:
        assert main(["arenas", "--dir", str(tmp_path)]) == 0
        out = capsys.readouterr().out
        assert f"{arena.path}" in out and "running" in out, out
        notes = [line for line in out.splitlines() if line.startswith("note: skipped")]
        assert len(notes) == len(bad) + 1, out
        assert any("fifo.arena" in n and "not a regular file" in n for n in notes), out
        assert any("word-pid.arena" in n and "'pid'" in n for n in notes), out
