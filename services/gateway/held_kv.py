"""Who frees KV held on a prefill instance for a request: on the gateway's side, `HeldKv` alone.

A prefill instance holds a prompt's KV under a lease from its Prefill call until a decode
instance has pulled it. The instances free it themselves in every case they can see:
- the decode instance, with Release, once it has pulled the KV (its first reply tells the
  gateway it has it);
- the prefill instance, when its Prefill call ends before the handle went out (the caller left),
  when the request ended at its first token (nothing to decode), on Abandon, and when the lease
  lapses: the last resort for a gateway or decode instance that died.
What only the gateway can see is freed on the exit of the request's `HeldKv` (one per try of a
handoff): the client left between the first token and a decode call taking the KV, a decode call
failed or ended before it answered (its instance may have died before its own release reached
the source), a decode call could not be started, a Prefill call failed after it sent a handle, or
a Prefill call was cancelled here after it may have completed there, its handle unread. Every
release after the first is answered NOT_FOUND, so a doubt is settled by releasing.
KV on a decode instance is its own: its engine frees it when the request ends, fails or its call
is cancelled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import grpc

from services.common import telemetry
from services.common.gen.distserve.v1 import (
    common_pb2,
    kvtransfer_pb2,
    kvtransfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)


class HeldKv:
    """The KV one try of a request holds on a prefill instance, from its Prefill call until a
    decode instance has it. An async context manager: on exit, a handle known here is released
    unless a decode instance confirmed it holds the KV and its call did not fail; a Prefill call
    that ended without its result, on an instance that was reachable, is abandoned."""

    def __init__(self, channel: Callable[[str], grpc.aio.Channel], trace) -> None:
        self._channel = channel
        self._trace = trace
        self._kv: common_pb2.KvHandle | None = None
        self._taken = False
        self._prefilling: tuple[prefill_pb2_grpc.PrefillStub, str] | None = None

    @property
    def kv(self) -> common_pb2.KvHandle | None:
        return self._kv

    def prefilling(self, stub: prefill_pb2_grpc.PrefillStub, request_id: str) -> None:
        """A Prefill call for `request_id` is open on `stub`'s instance."""
        self._prefilling = (stub, request_id)

    def handle(self, kv: common_pb2.KvHandle) -> None:
        """The prefill instance sent a handle on the KV (layer-wise: before computing it)."""
        self._kv = kv

    def prefilled(self, kv: common_pb2.KvHandle | None) -> None:
        """The Prefill call returned its result; `kv`: the KV it holds now (None: nothing, the
        instance freed it itself)."""
        self._prefilling = None
        self._kv = kv

    def unreachable(self) -> None:
        """The prefill instance could not be reached: there is nobody to ask to abandon."""
        self._prefilling = None

    def taken(self) -> None:
        """A decode instance answered: it holds the KV (and releases it at the source)."""
        self._taken = True

    def doubted(self) -> None:
        """The decode call failed: its instance may have died before its release was sent."""
        self._taken = False

    async def __aenter__(self) -> HeldKv:
        return self

    async def __aexit__(self, *exc) -> None:
        if self._kv is not None and self._kv.handle_id and not self._taken:
            await self._release(self._kv)
        elif self._kv is None and self._prefilling is not None:
            await self._abandon(*self._prefilling)

    async def _release(self, kv: common_pb2.KvHandle) -> None:
        stub = kvtransfer_pb2_grpc.KvTransferStub(self._channel(kv.control_address))
        with contextlib.suppress(grpc.aio.AioRpcError):
            await stub.Release(
                kvtransfer_pb2.KvAccess(handle_id=kv.handle_id, access_token=kv.access_token),
                timeout=5,
                metadata=telemetry.outgoing(self._trace),
            )

    async def _abandon(self, stub: prefill_pb2_grpc.PrefillStub, request_id: str) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await stub.Abandon(prefill_pb2.AbandonRequest(request_id=request_id), timeout=5)
