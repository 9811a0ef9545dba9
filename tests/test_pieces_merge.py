"""trainer.run.pieces.merge: consecutive micro-batches joined into one piece, in order, padded to its longest row."""

from __future__ import annotations

import torch

from trainer.data.batches import collate
from trainer.run import pieces


def test_merged_micro_batches_keep_their_rows_in_order_padded_and_masked():
    a = collate([[1, 2, 3], [4]], [None, None], 0)
    b = collate([[5, 6, 7, 8, 9]], [None], 0)
    c = collate([[7, 7], [8]], [None, None], 0)
    ref = torch.tensor([[0.5], [1.5], [2.5], [3.5], [4.5]])
    got = pieces.cut([(*a, ref[:2]), (*b, ref[2:3]), (*c, ref[3:])], 4)  # (2 + 1 rows, then 2: at most 4 a piece)
    assert len(got) == 2
    ids, labels, tokens, mask, rest = got[0]
    assert ids.tolist() == [[1, 2, 3, 0, 0], [4, 0, 0, 0, 0], [5, 6, 7, 8, 9]] and tokens == 9
    assert labels.tolist() == [[1, 2, 3, -100, -100], [4, -100, -100, -100, -100], [5, 6, 7, 8, 9]]
    assert mask.sum(1).tolist() == [3, 1, 5] and rest.flatten().tolist() == [0.5, 1.5, 2.5]
    assert got[1][0].tolist() == [[7, 7], [8, 0]] and got[1][4].flatten().tolist() == [3.5, 4.5]


def test_unpadded_micro_batches_merge_without_a_mask():
    """Full rows (no mask: the benchmark's) stay without one, so the attention keeps its unmasked path."""
    x = [(torch.ones(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.long), 4) for _ in range(4)]
    got = pieces.cut(x, 2)
    assert [len(p) for p in got] == [3, 3] and [p[0].shape for p in got] == [torch.Size([2, 4])] * 2
    assert pieces.in_step(8, 1, 4) == 2 and pieces.in_step(8, 4, 2) == 16 and pieces.in_step(8, 4, 4) == 8
    assert pieces.cut(x, 1) is x  # (pieces of a micro-batch's own rows: as they are)
