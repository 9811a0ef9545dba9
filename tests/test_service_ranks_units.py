"""Several ranks' HBM in one service, in process (issue 43): the parted device tier (a block a rank, a group's tensors
in its owner's part, each rank's trainer mapping its own part at its base), its blocks written at a clean stop and
read back, and the hello of a run of several ranks: owners said and checked, each rank told its part."""

from __future__ import annotations

import socket

import pytest
import torch

from tests.test_service_hbm_units import _ok, _service
from tiermem.tiers.extents import OutOfSpace
from tiermem.tiers.hbm_parts import PART_SPAN, PartedGpuTier, Parts, part_of
from tiermem.tiers.hbm_share import OwnedBlock

IN_HBM = {"param": "dram", "grad": "gpu", "exp_avg": "gpu", "exp_avg_sq": "gpu"}


def test_a_groups_tensors_live_in_its_owners_part_and_each_rank_maps_its_own():
    from tiermem.tiers.gpu import GpuTier

    blocks = [OwnedBlock(8192, torch.device("cpu")), OwnedBlock(8192, torch.device("cpu")), None]
    tier = PartedGpuTier(Parts(blocks, [8192, 8192, 0], {"a": 0, "b": 1, "c": 2}))
    a, b = tier.allocate_for("a", 1000), tier.allocate_for("b", 1000)
    assert part_of(a.offset) == 0 and part_of(b.offset) == 1 and b.offset >= PART_SPAN
    with pytest.raises(OutOfSpace):
        tier.allocate_for("c", 8)  # (rank 2 keeps nothing in HBM)
    with pytest.raises(OutOfSpace):
        tier.allocate_for("b", 8192)
    tier.view(b).fill_(7)
    assert (blocks[1].tensor[: 1000] == 7).all() and not blocks[0].tensor.any()
    desc = tier.describe_part(1)
    assert desc["base"] == PART_SPAN and tier.describe_part(2) is None
    mapped = GpuTier.map_shared(desc, torch.device("cpu"), 512, 2)  # (rank 1's trainer: its part, its slots)
    assert (mapped.view(b, 1000) == 7).all()
    mapped.view(b, 10).fill_(3)
    assert (tier.view(b, 10) == 3).all()
    slot = mapped.acquire_slot()
    assert slot.extent.offset >= PART_SPAN + 8192 and mapped.view(slot.extent).numel() == 512
    with pytest.raises(ValueError, match="another rank's part"):
        mapped.view(a)
    tier.free(b)
    assert tier.allocator.used_bytes() == a.nbytes
    mapped.close()
    for blk in blocks[:2]:
        blk.close()


def test_the_parts_are_written_at_a_clean_stop_and_read_back(tmp_path):
    from tiermem.service.hbm import ServiceHbm, load_block, save_block

    hbm = ServiceHbm(torch.device("cpu"))
    parts = hbm.parts([4096, 8192], {"a": 0, "b": 1})
    assert parts.blocks[0] is not parts.blocks[1] and parts.sizes == [4096, 8192]

    class Store:  # (what save_block and load_block use of a store)
        class tiers:
            device = PartedGpuTier(parts)

    parts.blocks[0].tensor.fill_(1)
    parts.blocks[1].tensor.fill_(2)
    save_block(Store, tmp_path / "x.hbm")
    assert (tmp_path / "x.hbm").stat().st_size == 4096 + 8192
    again = hbm.parts([4096, 8192], {"a": 0, "b": 1})  # (the same blocks, zeroed: a new run's)
    assert not again.blocks[1].tensor.any()
    load_block(Store, tmp_path / "x.hbm")
    assert (again.blocks[0].tensor == 1).all() and (again.blocks[1].tensor == 2).all()
    assert not (tmp_path / "x.hbm").exists()
    hbm.close()


def test_the_hello_of_several_ranks_says_the_owners_and_tells_each_rank_its_part(tmp_path):
    """Rank 0 says every group's owner (refused in one line without); the run's record keeps the parts and owners;
    each rank is told its own part; a rank owning other groups, a rejoin with another world, and the compute copy
    pinned to HBM are refused in one line."""
    from tiermem.service.runs import Client

    svc, client, theirs, hello = _service(tmp_path, IN_HBM, groups=2)
    mine1, theirs1 = socket.socketpair()
    rank1 = Client(mine1)
    try:
        for bad in (dict(hello, world=2, owns=[0]), dict(hello, world=2, owns=[0], owners=[[0, 0]]),
                    dict(hello, world=2, owns=[1], owners=[[0, 0], [1, 1]])):
            reply = svc.dispatch(client, bad)
            assert not reply["ok"] and "owner" in reply["error"] and "\n" not in reply["error"], reply
        reply = _ok(svc.dispatch(client, dict(hello, world=2, owns=[0], owners=[[0, 0], [1, 1]])))
        assert reply["hbm"]["base"] == 0 and reply["trainer_groups"] == [0]
        layout = reply["layout"]
        assert part_of(layout["exp_avg/w0"][1]) == 0 and part_of(layout["exp_avg/w1"][1]) == 1
        assert layout["w1"][0] == "dram"
        record = svc.run.record
        assert record["owners"] == [[0, 0], [1, 1]] and len(record["hbm_parts"]) == 2 and record["world"] == 2
        reply = svc.dispatch(rank1, dict(hello, id=5, rank=1, world=2, owns=[0]))
        assert not reply["ok"] and "owns other groups" in reply["error"], reply
        reply = _ok(svc.dispatch(rank1, dict(hello, id=6, rank=1, world=2, owns=[1])))
        assert reply["hbm"]["base"] == PART_SPAN and reply["trainer_groups"] == [1]
        svc._detach(svc.run)
        reply = svc.dispatch(client, dict(hello, world=3, owns=[0], owners=[[0, 0], [1, 1]]))
        assert not reply["ok"] and "each of its 2 ranks" in reply["error"], reply
        reply = svc.dispatch(client, dict(hello, world=2, owns=[1], owners=[[0, 1], [1, 0]]))
        assert not reply["ok"] and "owned by other ranks" in reply["error"], reply
        svc._close_run(keep=False)
    finally:
        theirs.close()
        theirs1.close()
        svc.release()


def test_the_compute_copy_in_hbm_for_several_ranks_is_refused_in_one_line(tmp_path):
    svc, client, theirs, hello = _service(tmp_path, dict(IN_HBM, param="gpu"), groups=2)
    try:
        reply = svc.dispatch(client, dict(hello, world=2, owns=[0], owners=[[0, 0], [1, 1]]))
        assert not reply["ok"] and "not supported yet" in reply["error"] and "\n" not in reply["error"], reply
    finally:
        theirs.close()
        svc.release()


def test_a_run_with_state_in_one_trainers_hbm_is_not_rejoined_by_several_ranks(tmp_path):
    svc, client, theirs, hello = _service(tmp_path, IN_HBM, groups=2)
    try:
        _ok(svc.dispatch(client, hello))
        svc._detach(svc.run)
        reply = svc.dispatch(client, dict(hello, world=2, owns=[0], owners=[[0, 0], [1, 1]]))
        assert not reply["ok"] and "on its trainer's GPU" in reply["error"] and "\n" not in reply["error"], reply
        svc._close_run(keep=False)
    finally:
        theirs.close()
        svc.release()
