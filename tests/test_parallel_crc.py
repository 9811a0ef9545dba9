"""The undo copy's checksum: CRC32C pieces taken on several threads."""

import crc32c
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tiermem.store.parallel_crc import piece_crcs


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 5000), piece=st.integers(1, 700), seed=st.integers(0, 2**31), flip=st.integers(0, 10**6))
def test_pieces_are_each_slice_crc_and_a_flip_changes_its_piece(n, piece, seed, flip):
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    crcs = piece_crcs(data, piece)
    want = [f"{crc32c.crc32c(data[i: i + piece].tobytes()):08x}" for i in range(0, n, piece)] or ["00000000"]
    assert crcs == want
    if n:
        i = flip % n
        data[i] ^= 0x5A
        after = piece_crcs(data, piece)
        assert [k for k, (a, b) in enumerate(zip(crcs, after)) if a != b] == [i // piece]


def test_other_dtypes_are_taken_by_their_bytes():
    x = np.arange(3000, dtype=np.float32).reshape(30, 100)
    assert piece_crcs(x, 4096) == piece_crcs(x.view(np.uint8).reshape(-1), 4096)
    assert len(piece_crcs(x, 4096)) == 3  # 12000 bytes

