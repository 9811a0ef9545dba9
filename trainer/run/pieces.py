"""A step's micro-batches re-cut into the pieces the GPU computes at once (``tiermem_physical_batch_size``).

``per_device_train_batch_size`` says which rows make up a micro-batch (the data's order, the step's tokens,
what a run's outputs count); the rows the GPU runs through a layer at once are the planner's to choose: where
HBM is short, smaller pieces leave more of it to the training state; the user's own size otherwise. The loss
of a step is the mean over all of its trained tokens and its gradient their sum, so any cut into pieces gives
the same step (to rounding: the sums are added in another order).

    pieces = cut(batches, rows)        # [(input_ids, labels, tokens, mask)] of at most ``rows`` rows each

A piece is right-trimmed to its own longest row (its other positions are padding: label -100, masked). What a
micro-batch carries per row after its mask (stage dpo: the reference's log-probabilities) is cut with its rows;
stage dpo's pieces hold whole pairs (an even number of rows: ``trainer.run.preference.pair_pieces``).
"""

from __future__ import annotations


def cut(batches: list, rows: int | None) -> list:
    """``batches`` (collated micro-batches: ``(input_ids [B, T], labels [B, T], tokens, mask [B, T])``) as
    pieces of at most ``rows`` rows each, in the same order; ``rows`` None or not smaller than any micro-batch:
    ``batches`` as they are."""
    if not rows or all(b[0].shape[0] <= rows for b in batches):
        return batches
    out = []
    for b in batches:
        ids, labels, mask = b[0], b[1], b[3] if len(b) > 3 else None
        for r0 in range(0, ids.shape[0], rows):
            r1 = min(r0 + rows, ids.shape[0])
            if mask is None:
                out.append((ids[r0:r1], labels[r0:r1], int(ids[r0:r1].numel())))
                continue
            m = mask[r0:r1]
            width = max(int(m.sum(1).max()), 1)  # (right-padded rows: its longest row)
            rest = tuple(x[r0:r1] for x in b[4:])  # (per-row figures: stage dpo's reference log-probabilities)
            out.append((ids[r0:r1, :width], labels[r0:r1, :width], int(m.sum()), m[:, :width], *rest))
    return out


def candidates(rows: int, unit: int = 1) -> list[int]:
    """Rows a piece may have for micro-batches of ``rows`` rows, largest first: the whole micro-batch, then
    halves (rounded up) down to one row; ``unit``: pieces of whole units of that many rows (stage dpo's pairs: 2)."""
    if unit > 1:
        return [unit * r for r in candidates(max(rows // unit, 1))]
    out, r = [rows], rows
    while r > 1:
        r = -(-r // 2)
        if r != out[-1]:
            out.append(r)
    return out


def count(rows: int, piece: int) -> int:
    """Pieces a micro-batch of ``rows`` rows is cut into."""
    return -(-rows // max(piece, 1))

