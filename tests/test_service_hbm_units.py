"""A service's state in HBM, in process (issue 43): the block the service owns and its trainer maps."""

from __future__ import annotations

import pytest
import torch

from tiermem.tiers.extents import Extent


def test_a_mapped_block_is_below_the_trainers_own_slots(tmp_path):
    """The trainer's device tier: the service's block at offsets below its size, its own slots above; it never
    allocates in the service's block."""
    from tiermem.tiers.gpu import GpuTier

    owner = GpuTier(torch.device("cpu"), 4096, 0, 0, share=True)
    owner.view(Extent(512, 512)).fill_(7)
    trainer = GpuTier.map_shared(owner.describe(None), torch.device("cpu"), 1024, 2)
    assert (trainer.view(Extent(512, 512)) == 7).all()
    slot = trainer.acquire_slot()
    assert slot.extent.offset >= 4096
    trainer.view(slot.extent).fill_(1)
    assert (owner.view(Extent(0, 4096)) != 1).all()
    with pytest.raises(RuntimeError, match="the service alone allocates"):
        trainer.allocate(512)
    trainer.close()
    owner.close()
