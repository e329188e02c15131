"""Where a pull's KV goes and how it is cut: the destination, the block ranges consecutive on
both sides (`segments`), and the chunks grouped into requests (`requests_for`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from services.common.kv_handle import RankSource
from services.kvtransfer.memory import copy_into, empty_like, raw


@dataclass(frozen=True)
class KvDestination:
    """Where pulled KV lands: `data` is (layers, planes, blocks, block_size, heads, head_dim), an
    engine's KV cache or a staging buffer (a numpy array or a torch tensor: kvtransfer.memory),
    and holds the global KV heads `heads`."""

    data: Any
    heads: range

    def region(
        self, layer: int, kv: int, first: int, n: int, heads: range
    ) -> tuple[object, Callable[[], None] | None]:
        """A buffer to receive blocks first..first+n of one layer's K or V for `heads`, and
        what puts it in place once verified (None: the buffer is the place itself)."""
        view = self.data[layer, kv, first : first + n]
        if heads == self.heads:
            return raw(view), None
        lo = heads.start - self.heads.start
        part = view[:, :, lo : lo + len(heads)]
        landing = empty_like(part)
        return raw(landing), partial(copy_into, part, landing)


def segments(src: list[int], dst: list[int], max_blocks: int) -> list[tuple[int, int, int]]:
    """(index into the handle's blocks, first destination block id, count) of each range that is
    consecutive in both block lists, at most max_blocks long."""
    out = []
    i = 0
    while i < len(src):
        n = 1
        while (
            i + n < len(src)
            and n < max_blocks
            and src[i + n] == src[i] + n
            and dst[i + n] == dst[i] + n
        ):
            n += 1
        out.append((i, dst[i], n))
        i += n
    return out


@dataclass
class PullChunk:
    """One chunk of a pull: one layer's K or V for a block range (`seg`: index into the
    handle's blocks, first destination block, count) and the heads one source rank holds; the
    buffer it is received into and what puts it in place once verified (None: in place)."""

    layer: int
    kv: int
    seg: tuple[int, int, int]
    transport: object
    source: RankSource
    heads: range
    lane: int = 0  # the transport's connection (UCX: a worker of the puller's) it comes over
    buffer: object = None  # set when its request is about to go out
    land: Callable[[], None] | None = None


def requests_for(chunks: list[PullChunk]) -> list[list[PullChunk]]:
    """The requests for a pull's chunks: runs of up to the transport's max_chunks from one
    source rank (the same heads) over one lane, each run in layer order (the source sends each
    chunk once its layer is computed), the runs in the order of their first layers."""
    by_source: dict[tuple, list[PullChunk]] = {}
    for c in sorted(chunks, key=lambda c: c.layer):
        by_source.setdefault((c.source, c.heads, c.transport, c.lane), []).append(c)
    runs = [
        run[i : i + run[0].transport.max_chunks]
        for run in by_source.values()
        for i in range(0, len(run), run[0].transport.max_chunks)
    ]
    return sorted(runs, key=lambda run: run[0].layer)
