"""How a striped storage tier lays its address space over its files (one per device directory): stripes of
``unit`` bytes go round-robin, the first to file 0, the next to file 1, ...; a request becomes one piece per
stripe it touches, each read or written by its file's own queue, all at once. With one file there is no striping:
a request is one piece.

    pieces(offset, nbytes, files, unit)  # [(file, offset in that file, start, end of the buffer's bytes)]
    file_bytes(capacity, files, unit)    # each file's size for a tier of ``capacity`` bytes
"""

from __future__ import annotations


def pieces(offset: int, nbytes: int, files: int, unit: int) -> list[tuple[int, int, int, int]]:
    """The pieces of the byte range [offset, offset + nbytes) of the tier, in order: (file, offset in the file,
    start, end) with ``start:end`` the request's own bytes."""
    if files == 1:
        return [(0, offset, 0, nbytes)] if nbytes else []
    out, pos, end = [], offset, offset + nbytes
    while pos < end:
        stripe, within = divmod(pos, unit)
        n = min(unit - within, end - pos)
        out.append((stripe % files, (stripe // files) * unit + within, pos - offset, pos - offset + n))
        pos += n
    return out


def file_bytes(capacity: int, files: int, unit: int) -> int:
    """Each file's size: room for its share of the stripes that cover ``capacity`` bytes."""
    if files == 1:
        return capacity
    stripes = -(-capacity // unit)
    return -(-stripes // files) * unit
