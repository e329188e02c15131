"""A decode instance's side of a KV handle, apart from the pull itself: whether its KV can be
used here, the figures its handoff span reports, and its release at its source, which one
object owns from the request's start."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from services.common import telemetry
from services.common.errors import FailedPrecondition
from services.common.kv_handle import KvHandle
from services.kvtransfer.memory import dtype_name
from services.kvtransfer.puller import KV_DTYPES, KvPuller, PullReport

if TYPE_CHECKING:
    from services.engine.engine import LLMEngine

log = logging.getLogger("distserve.decode")


def check_handle(engine: LLMEngine, handle: KvHandle) -> None:
    """FailedPrecondition if the handle's KV cannot be used here (another model shape, an
    unknown dtype); another block size or dtype is converted as it is pulled."""
    kv = engine.kv_geometry
    shape = (kv.num_layers, kv.planes, kv.num_kv_heads, kv.head_dim)
    theirs = (handle.num_layers, handle.kv_planes, handle.num_kv_heads, handle.head_dim)
    if shape != theirs:
        raise FailedPrecondition(
            f"KV of {handle.source_instance} has (layers, planes, kv_heads, head_dim) {theirs}, "
            f"this instance {shape}: prefill and decode must serve the same model"
        )
    if handle.dtype not in KV_DTYPES:
        raise FailedPrecondition(f"KV dtype {handle.dtype!r} is not one we can read")


def can_reuse(engine: LLMEngine, handle: KvHandle) -> bool:
    """Whether a pull of `handle` may skip the prompt's prefix cached here: the cache is on
    and the KV comes in this cache's block size and dtype (else it is converted whole)."""
    cache = engine.runner.cache
    return (
        engine.prefix.enabled
        and handle.block_size == cache.block_size
        and handle.dtype == dtype_name(cache.data.dtype)
    )


def handoff_attributes(report: PullReport, seconds: float, hidden: float) -> dict[str, object]:
    """The `kv.handoff` span's figures of a pull that took `seconds`, `hidden` of them while
    prefill was still computing (docs/observability.md)."""
    attributes = {
        "kv.bytes": report.nbytes,
        "kv.chunks": report.chunks,
        "kv.chunks_retried": report.retries,
        "kv.chunks_unverified": report.unverified,  # device memory: no checksum
        "kv.transport": report.transport,
        "kv.bandwidth_bytes_per_s": report.nbytes / seconds if seconds > 0 else 0.0,
        "kv.overlap_fraction": hidden / seconds if seconds > 0 else 0.0,
        "kv.layerwise": report.layerwise,
    }
    if report.modelled_bytes:  # an emulated engine: the payload stood for this much KV
        attributes["kv.emulated_bytes"] = report.modelled_bytes
    return attributes


class SourceReleases:
    """Releases of KV handles at their sources, sent in the background: an unreachable source
    must not hold up a request (its lease frees the KV anyway)."""

    def __init__(self, puller: KvPuller) -> None:
        self.puller = puller
        self.pending: set[asyncio.Task] = set()  # on their way to their sources

    def hold(self, handle: KvHandle | None) -> HandleRelease:
        """The owner of `handle`'s release, for the life of its request."""
        return HandleRelease(handle, self)

    def send(self, handle: KvHandle, trace: telemetry.Context | None = None) -> None:
        task = asyncio.create_task(self._release(handle, trace))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _release(self, handle: KvHandle, trace: telemetry.Context | None = None) -> None:
        try:
            await self.puller.release(handle, trace)
        except Exception as e:  # the lease lapses at the source anyway
            log.warning(
                "release of %s at %s failed: %s", handle.handle_id, handle.source_instance, e
            )


class HandleRelease:
    """A request's KV handle, released at its source exactly once: as soon as its KV is here
    (`pulled`), or when the request's `with` block exits before that (a failure, a cancel)."""

    def __init__(self, handle: KvHandle | None, releases: SourceReleases) -> None:
        self._handle = handle
        self._releases = releases

    def pulled(self, handoff: telemetry.Context | None) -> None:
        """The KV is here: the source may free it (the release joins the handoff span)."""
        handle, self._handle = self._handle, None
        self._releases.send(handle, handoff)

    def __enter__(self) -> HandleRelease:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            self._releases.send(handle)
