"""CRC-32C combining: the CRC of consecutive pieces of equal size from theirs, without their
bytes (a source's chunk checksum from its blocks', taken when the layer was computed)."""

from __future__ import annotations

import numpy as np

# CRC-32C is linear: crc(A + B) = Z(crc(A)) ^ crc(B), Z being what len(B) zero bytes do to a CRC
# (a 32x32 bit matrix; the CRC's initial and final inversions cancel out, as in zlib's
# crc32_combine). So a source that took each block's CRC when the layer was computed gives the
# CRC of any run of its blocks without reading their bytes again, and the puller checks a chunk
# with one call over its bytes. Z applied to a CRC is four table look-ups, one per byte of it.

_POLY = 0x82F63B78  # CRC-32C (Castagnoli), bit-reflected
_GROUP = 256  # pieces combined by one look-up each; more pieces are combined in groups of this
_BYTES = np.array([0, 8, 16, 24], dtype=np.uint32)
_BYTE_TABLES = np.arange(4) * 256  # where each byte of a CRC has its 256 entries in a table
# _table(n)[k * 1024 + j * 256 + b]: what k pieces of n bytes after one make of byte j = b of
# its CRC. Piece i of a group has _GROUP - 1 - i after it: _OFFSETS[i, j] is where its look-ups
# for byte j start.
_OFFSETS = ((_GROUP - 1 - np.arange(_GROUP)) * 1024)[:, None] + _BYTE_TABLES
_tables: dict[int, np.ndarray] = {}  # piece bytes -> (_GROUP * 4 * 256) uint32


def _times(columns: list[int], x: int) -> int:
    out = 0
    for column in columns:
        if not x:
            break
        if x & 1:
            out ^= column
        x >>= 1
    return out


def _zeros(nbytes: int) -> list[int]:
    """What nbytes zero bytes do to a CRC: the images of its 32 bits."""
    op = [_POLY] + [1 << k for k in range(31)]  # one zero bit
    for _ in range(3):
        op = [_times(op, c) for c in op]  # squared: 2, 4, 8 bits
    out = [1 << k for k in range(32)]
    while nbytes:
        if nbytes & 1:
            out = [_times(op, c) for c in out]
        op = [_times(op, c) for c in op]
        nbytes >>= 1
    return out


def prepare(nbytes: int) -> None:
    """Make the tables `combine` uses for pieces of nbytes (~25 ms each, once): runs of up to
    _GROUP pieces, and of up to _GROUP groups of them (an 8 MiB chunk of 16 KiB blocks is 512)."""
    _table(nbytes)
    _table(nbytes * _GROUP)


def _table(nbytes: int) -> np.ndarray:
    """For pieces of nbytes: what 0.._GROUP-1 pieces after one do to each byte of its CRC."""
    table = _tables.get(nbytes)
    if table is None:
        columns = np.array(_zeros(nbytes), dtype=np.uint32).reshape(4, 8)
        one = np.zeros((4, 256), dtype=np.uint32)  # one piece, by byte of the CRC
        for b in range(1, 256):
            low = b & -b
            one[:, b] = one[:, b ^ low] ^ columns[:, low.bit_length() - 1]
        table = np.empty((_GROUP, 4, 256), dtype=np.uint32)
        table[0] = np.arange(256, dtype=np.uint32) << _BYTES[:, None]  # none after it
        for k in range(1, _GROUP):
            before = table[k - 1].reshape(-1)
            table[k] = _apply(one.reshape(-1), before).reshape(4, 256)
        table = _tables[nbytes] = table.reshape(-1)
    return table


def _apply(flat: np.ndarray, crcs: np.ndarray) -> np.ndarray:
    """A (4 * 256) table applied to each CRC."""
    return np.bitwise_xor.reduce(flat[((crcs[:, None] >> _BYTES) & 0xFF) + _BYTE_TABLES], 1)


def combine(crcs, nbytes: int) -> int:
    """The CRC-32C of consecutive pieces of `nbytes` bytes each, from theirs (in order)."""
    x = np.asarray(crcs, dtype=np.uint32)
    while len(x) > _GROUP:
        groups = -(-len(x) // _GROUP)
        padded = np.zeros(groups * _GROUP, dtype=np.uint32)  # a zero CRC adds nothing
        padded[len(padded) - len(x) :] = x  # the last group full: groups end where the data does
        at = ((padded.reshape(groups, _GROUP, 1) >> _BYTES) & 0xFF) + _OFFSETS
        x = np.bitwise_xor.reduce(_table(nbytes)[at].reshape(groups, -1), 1)
        nbytes *= _GROUP
    if len(x) < 2:
        return int(x[0]) if len(x) else 0
    at = ((x[:, None] >> _BYTES) & 0xFF) + _OFFSETS[_GROUP - len(x) :]
    return int(np.bitwise_xor.reduce(_table(nbytes)[at.reshape(-1)]))
