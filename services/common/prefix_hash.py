"""The identity of a cached KV block: a hash chained over a prompt's full blocks.

Block i of a prompt is identified by hash(hash of block i-1, the block's token ids), the chain
starting from a `salt` that names everything else that changes the KV (the model's weights, the
dtype, an adapter). Two prompts share block i's hash exactly when they share tokens 0 .. (i+1) *
block_size - 1 and the salt, so the longest run of a prompt's hashes a worker holds is the prefix
whose KV it can reuse. Workers key their prefix cache by these hashes and report them; the
gateway computes the same hashes for a prompt to route it where its prefix is cached. Both sides
call this function, so they agree by construction.

blake2b with an 8-byte digest: stable across processes and hosts (Python's `hash` is not for
bytes and str), fast in pure Python (about 1 µs per block), and 64 bits make an accidental
collision between two different prefixes a one-in-10^19 event per pair.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def block_hashes(
    token_ids: Sequence[int], block_size: int, salt: bytes, *, limit: int | None = None
) -> list[int]:
    """The chained hash (unsigned 64-bit) of each full block of `token_ids`, in order; the
    partial last block has none. `limit`: hash at most that many blocks."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    n = len(token_ids) // block_size
    if limit is not None:
        n = min(n, limit)
    out: list[int] = []
    parent = hashlib.blake2b(salt, digest_size=8).digest()
    for i in range(n):
        h = hashlib.blake2b(parent, digest_size=8)
        h.update(array("I", token_ids[i * block_size : (i + 1) * block_size]).tobytes())
        parent = h.digest()
        out.append(int.from_bytes(parent, "little"))
    return out


def cache_salt(*parts: str) -> bytes:
    """A salt from the strings that name what changes the KV (model fingerprint, dtype, ...)."""
    return hashlib.blake2b("\x1f".join(parts).encode(), digest_size=16).digest()
