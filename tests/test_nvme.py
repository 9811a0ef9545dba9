"""The NVMe tier: O_DIRECT on disk, buffered on tmpfs, backend choice, and one-line errors that leave no
half-valid extent behind."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from tiermem.errors import StorageError
from tiermem.specs import TensorSpec
from tiermem.store.store import Store
from tiermem.tiers.nvme import NvmeTier, choose_backend


def _roundtrip(tier: NvmeTier, n: int):
    e = tier.allocate(n)
    data = torch.randint(0, 255, (n,), dtype=torch.uint8)
    tier.pwrite(data, e).result()
    back = torch.empty_like(data)
    tier.pread(back, e).result()
    assert torch.equal(data, back)


def test_posix_direct_on_disk(nvme_dir, store_name):
    tier = NvmeTier(nvme_dir, store_name, 8 << 20, backend="posix", io_chunk=1 << 20)
    try:
        assert tier.backend.direct  # a real disk allows O_DIRECT
        assert tier.path.stat().st_size == 8 << 20  # preallocated
        _roundtrip(tier, 3 << 20)  # split across chunks and threads
        _roundtrip(tier, 5000)  # unaligned length: buffered path for the tail
    finally:
        tier.close()
    assert not tier.path.exists()


def test_discarded_extents_give_their_disk_space_back(nvme_dir, store_name):
    """The state a finished run no longer reads is discarded: its blocks go back to the filesystem (the file
    keeps its size) and its extents are free; the rest reads back unchanged."""
    from tiermem.tiers.nvme import can_punch_holes

    tier = NvmeTier(nvme_dir, store_name, 16 << 20, backend="posix")
    try:
        if not can_punch_holes(nvme_dir):
            pytest.skip("this filesystem cannot punch holes")
        keep, drop = tier.allocate(4 << 20), tier.allocate(8 << 20)
        data = torch.randint(0, 255, (4 << 20,), dtype=torch.uint8)
        tier.pwrite(data, keep).result()
        tier.pwrite(torch.ones(8 << 20, dtype=torch.uint8), drop).result()
        before = tier.path.stat().st_blocks * 512
        assert tier.discard([drop]) == 8 << 20
        assert before - tier.path.stat().st_blocks * 512 == 8 << 20
        assert tier.path.stat().st_size == 16 << 20
        assert tier.allocator.free_bytes() == 12 << 20
        back = torch.empty_like(data)
        tier.pread(back, keep).result()
        assert torch.equal(back, data)
    finally:
        tier.close()


def test_posix_buffered_where_o_direct_is_refused(nvme_dir, store_name, monkeypatch, caplog):
    real_open = os.open

    def no_direct(path, flags, *args):  # what tmpfs before Linux 6.6 answers
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    tier = NvmeTier(nvme_dir, store_name, 1 << 20, backend="posix")
    try:
        assert not tier.backend.direct
        assert "does not allow O_DIRECT; using buffered I/O" in caplog.text
        _roundtrip(tier, 100_000)
    finally:
        tier.close()


def test_auto_backend_says_why(nvme_dir):
    nvme_dir.mkdir()
    backend, why = choose_backend("auto", nvme_dir)
    try:
        import kvikio  # noqa: F401
    except ImportError:
        assert backend == "posix" and "kvikio is not installed" in why
    if backend == "posix":
        with pytest.raises(StorageError, match="backend is kvikio but"):
            choose_backend("kvikio", nvme_dir)


def test_path_errors(tmp_path, store_name):
    with pytest.raises(StorageError, match="does not exist"):
        NvmeTier(tmp_path / "a" / "b", store_name, 1 << 20)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(StorageError, match="is not a directory"):
        NvmeTier(f, store_name, 1 << 20)
    with pytest.raises(StorageError, match="free; lower tiers.nvme.budget"):
        NvmeTier(tmp_path, store_name, 1 << 55)
    with pytest.raises(StorageError, match="cannot create NVMe tier directory"):
        NvmeTier("/proc/tiermem-test", store_name, 1 << 20)
    assert not list(tmp_path.glob("*.nvme"))


def test_failed_write_leaves_extent_invalid(make_cfg, monkeypatch):
    cfg = make_cfg(placement={"param": "nvme"})
    spec = TensorSpec("w", (1024,), torch.float32, "param", 0)
    with Store.open(cfg, [spec]) as store:
        good = torch.randn(1024)
        store.write("w", good).result()

        def disk_full(fd, bufs, offset):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "pwritev", disk_full)
        with pytest.raises(StorageError, match="disk is full"):
            store.write("w", torch.randn(1024)).result()
        assert not store.catalog["w"].valid
        with pytest.raises(ValueError, match="no valid data"):
            store.read("w").result()
        monkeypatch.undo()
        store.write("w", good).result()
        assert torch.equal(store.read("w").result(), good)
