"""A chunk's CRC-32C combined from its blocks' (what a source sends) equals the CRC-32C of its
bytes (what a puller computes over what it received), for any number and size of blocks."""

from __future__ import annotations

import crc32c
import numpy as np
import pytest

from services.kvtransfer import crc_combine


@pytest.mark.parametrize(
    ("blocks", "block_bytes"),
    [(0, 64), (1, 64), (2, 16384), (128, 16384), (255, 3), (256, 3), (257, 3), (700, 100),
     (65536 + 3, 1), (16, 512 * 1024)],
)  # fmt: skip
def test_blocks_crcs_combine_into_the_chunks(blocks, block_bytes):
    data = np.random.default_rng(blocks).integers(0, 256, blocks * block_bytes, dtype=np.uint8)
    rows = data.reshape(blocks, block_bytes)
    crcs = np.array([crc32c.crc32c(r.tobytes()) for r in rows], dtype=np.uint32)
    assert crc_combine.combine(crcs, block_bytes) == crc32c.crc32c(data.tobytes())
    if blocks > 1:  # a changed block changes it
        rows[blocks // 2, 0] ^= 1
        assert crc_combine.combine(crcs, block_bytes) != crc32c.crc32c(data.tobytes())
        crcs[blocks // 2] = crc32c.crc32c(rows[blocks // 2].tobytes())
        assert crc_combine.combine(crcs, block_bytes) == crc32c.crc32c(data.tobytes())
