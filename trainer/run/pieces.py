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

Where HBM has room, a piece may be larger than a micro-batch: ``rows`` at least twice a micro-batch's merges
consecutive micro-batches (the step's rows in order) into pieces of at most ``rows`` rows, each padded to the
piece's longest row (padding masked, label -100). A layer-major pass (``Executor.passes``) groups whole pieces,
so a merged piece never straddles two passes.
"""

from __future__ import annotations

import torch


def cut(batches: list, rows: int | None) -> list:
    """``batches`` (collated micro-batches: ``(input_ids [B, T], labels [B, T], tokens, mask [B, T])``) as
    pieces of at most ``rows`` rows each, in the same order; ``rows`` None or not smaller than any micro-batch:
    ``batches`` as they are; ``rows`` at least twice the largest micro-batch: consecutive micro-batches merged
    (``merge``)."""
    if not rows or not batches:
        return batches
    if rows >= 2 * max(b[0].shape[0] for b in batches):
        return merge(batches, rows)
    if all(b[0].shape[0] <= rows for b in batches):
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


def merge(batches: list, rows: int) -> list:
    """Consecutive micro-batches of ``batches`` joined into pieces of at most ``rows`` rows (the order kept), each
    right-padded to its longest row: input 0, label -100, masked; per-row figures after the mask joined too."""
    out, group, n = [], [], 0
    for b in batches:
        if group and n + b[0].shape[0] > rows:
            out.append(_join(group))
            group, n = [], 0
        group.append(b)
        n += b[0].shape[0]
    if group:
        out.append(_join(group))
    return out


def _join(group: list) -> tuple:
    if len(group) == 1:
        return group[0]
    width = max(b[0].shape[1] for b in group)
    if all(len(b) == 3 and b[0].shape[1] == width for b in group):  # (rows without padding stay without a mask)
        return torch.cat([b[0] for b in group]), torch.cat([b[1] for b in group]), sum(b[2] for b in group)
    ids, labels, masks = [], [], []
    for b in group:
        pad = width - b[0].shape[1]
        mask = b[3] if len(b) > 3 else torch.ones(b[0].shape, dtype=torch.bool)
        ids.append(torch.nn.functional.pad(b[0], (0, pad), value=0))
        labels.append(torch.nn.functional.pad(b[1], (0, pad), value=-100))
        masks.append(torch.nn.functional.pad(mask, (0, pad), value=False))
    rest = tuple(torch.cat(xs) for xs in zip(*(b[4:] for b in group), strict=True))
    return (torch.cat(ids), torch.cat(labels), sum(b[2] for b in group), torch.cat(masks), *rest)


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
    """Pieces a micro-batch of ``rows`` rows is cut into (1 where a piece holds it whole or merges several)."""
    return -(-rows // max(piece, 1))


def in_step(micro_batches: int, rows: int, piece: int) -> int:
    """Pieces a step of ``micro_batches`` micro-batches of ``rows`` rows runs as with pieces of ``piece`` rows:
    cut (``count`` each) or, ``piece`` a multiple of ``rows``, merged (``piece // rows`` micro-batches each)."""
    if piece >= 2 * rows:
        return -(-micro_batches // (piece // rows))
    return micro_batches * count(rows, piece)


def told(rows: int, piece: int | None) -> str | None:
    """The pieces in words, for the plan line and the first step's note: ``each micro-batch of 4 rows runs as 2
    pieces of 2 rows`` or ``pieces of 8 rows, each 2 micro-batches of 4 rows merged``; None: micro-batches whole."""
    if not piece or not rows or rows <= piece < 2 * rows:
        return None
    if piece > rows:
        return f"pieces of {piece} rows, each {piece // rows} micro-batches of {rows} row{_s(rows)} merged"
    return f"each micro-batch of {rows} rows runs as {count(rows, piece)} pieces of {piece} row{_s(piece)}"


def _s(n: int) -> str:
    return "s" if n > 1 else ""
