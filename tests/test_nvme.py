"""The NVMe tier: O_DIRECT on disk, buffered on tmpfs, backend choice, and one-line errors that leave no
half-valid extent behind."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiermem.errors import StorageError
from tiermem.specs import TensorSpec
from tiermem.store.store import Store
from tiermem.tiers.nvme import NvmeTier, choose_backend
from tiermem.tiers.stripes import file_bytes, pieces


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


@settings(max_examples=200, deadline=None)
@given(offset=st.integers(0, 1 << 24), nbytes=st.integers(0, 1 << 22), files=st.integers(1, 5),
       unit_k=st.integers(1, 64))
def test_stripes_cover_a_request_once_and_land_where_the_round_robin_puts_them(offset, nbytes, files, unit_k):
    """A request's pieces cover its bytes in order, each within one stripe of one file, and each tier byte lands at
    the file and offset of its stripe (stripe s in file s % n at offset (s // n) * unit); the files' size holds
    every stripe of the capacity."""
    unit = unit_k * 4096
    got = pieces(offset, nbytes, files, unit)
    assert [p[2] for p in got] == [0, *(p[3] for p in got[:-1])][:len(got)] and (got[-1][3] if got else 0) == nbytes
    for f, off, start, end in got:
        stripe, within = divmod(offset + start, unit)
        assert files == 1 or (f, off) == (stripe % files, (stripe // files) * unit + within)
        assert files == 1 or within + (end - start) <= unit  # (never across a stripe)
        assert off + (end - start) <= file_bytes(offset + nbytes, files, unit)


def test_a_tier_striped_over_two_directories_reads_back_what_it_wrote(tmp_path, store_name):
    """tiers.nvme.path as a list: one file a directory, each an equal share; a request crosses the stripes of both
    (each file's own queue), a discard gives bytes back in both, and another process maps the same files."""
    a, b = tmp_path / "a", tmp_path / "b"
    tier = NvmeTier([a, b], store_name, 8 << 20, backend="posix", io_chunk=1 << 20)
    try:
        assert [p.parent for p in tier.paths] == [a, b] and len(tier.backends) == 2
        assert all(p.stat().st_size == 4 << 20 for p in tier.paths)  # (4 stripes of 1 MiB each)
        e = tier.allocate(5 << 20)
        data = torch.randint(0, 255, (5 << 20,), dtype=torch.uint8)
        tier.pwrite(data, e).result()
        with open(tier.paths[1], "rb") as f:  # (the tier's second stripe is the second file's first)
            assert f.read(1 << 20) == data[1 << 20: 2 << 20].numpy().tobytes()
        twin = NvmeTier.map_shared({"dir": [str(a), str(b)], "capacity": tier.capacity, "backend": "posix",
                                    "threads": 2, "io_chunk": 1 << 20, "direct": True}, store_name, torch.device("cpu"))
        try:
            back = torch.empty_like(data)
            twin.pread(back, e).result()
            assert torch.equal(back, data)
        finally:
            twin.close(remove=False)
    finally:
        tier.close()
    assert not any(p.exists() for p in tier.paths)


@pytest.mark.parametrize("path,needle", [([], "tiers.nvme.path"), (["/x", "/x/"], "same directory twice"),
                                         (["/x", ""], "tiers.nvme.path"), ([1, 2], "tiers.nvme.path")])
def test_a_bad_list_of_nvme_directories_is_one_line(path, needle):
    from tiermem.config import load_store_config
    from tiermem.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_store_config({"tiers": {"nvme": {"path": path}}})
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_the_quick_probe_measures_striped_drives_together(tmp_path):
    """A list of directories is measured at once, a thread each, and their rates added (the tier's stripes run so)."""
    from tiermem.plan import machine

    seen = []
    real = machine._disk_rates

    def one(d, size, block):
        seen.append(str(d))
        return {"nvme_read": 1.0, "nvme_write": 2.0, "nvme_both": 0.5 + len(seen) * 0.1}

    machine._disk_rates = one
    try:
        got = machine.disk_rates([tmp_path / "a", tmp_path / "b"])
    finally:
        machine._disk_rates = real
    assert sorted(seen) == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert got["nvme_read"] == 2.0 and got["nvme_write"] == 4.0 and got["nvme_both"] == pytest.approx(0.65)
    assert set(real(str(tmp_path), 1 << 20, 256 << 10)) == {"nvme_read", "nvme_write", "nvme_both"}
