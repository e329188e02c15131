"""Where the load goes: the gateway's gRPC `Generate` or its OpenAI-compatible HTTP
`/v1/completions` (SSE), straight or through Envoy (the same protocols on another address).

A target streams one request as `Chunk`s, one per message that carried tokens, and raises
`LoadError` (a status and a message) when the request fails; the runner times the chunks.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import aiohttp
import grpc

from distserve.loadgen.requests import LoadRequest
from services.common import mesh_tls
from services.common.gen.distserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc


@dataclass(frozen=True)
class Chunk:
    """One message of a stream. `tokens`: how many tokens it carried (None where the protocol
    does not say: an SSE event carries text). `total`: the server's count of output tokens, on
    the message that gives it (gRPC's last response, HTTP's usage event), else None."""

    tokens: int | None
    total: int | None = None


class LoadError(Exception):
    """A request that failed: `status` is the gRPC code name (`INVALID_ARGUMENT`) or
    `HTTP 400`, or `HTTP stream error` for an error event after the stream began."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class Target(Protocol):
    name: str
    time_scale: float  # an emulated mesh's wall seconds per emulated second (1: real time)

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    def stream(self, request: LoadRequest, timeout_s: float | None) -> AsyncIterator[Chunk]: ...


class GrpcTarget:
    """`Gateway.Generate` over one grpc.aio channel (HTTP/2 multiplexes every request on it)."""

    def __init__(self, address: str, api_key: str | None = None, time_scale: float = 1.0) -> None:
        self.name = f"grpc://{address}"
        self.address = address
        self.time_scale = time_scale
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._channel: grpc.aio.Channel | None = None
        self._stub: gateway_pb2_grpc.GatewayStub | None = None

    async def open(self) -> None:
        self._channel = mesh_tls.aio_channel(self.address)
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        await self._channel.channel_ready()

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def stream(self, request: LoadRequest, timeout_s: float | None) -> AsyncIterator[Chunk]:
        pb = gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=request.prompt_ids),
            sampling=common_pb2.SamplingParams(
                max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True
            ),
        )
        call = self._stub.Generate(pb, timeout=timeout_s, metadata=self.metadata)
        try:
            async for r in call:
                total = r.usage.completion_tokens if r.HasField("usage") else None
                if r.token_ids or total is not None:
                    yield Chunk(len(r.token_ids), total)
        except grpc.aio.AioRpcError as e:
            raise LoadError(e.code().name, e.details() or "") from None
        finally:
            call.cancel()


class HttpTarget:
    """`POST /v1/completions` with `stream: true` and usage on; one aiohttp session (HTTP/1.1,
    one connection per request in flight, no pool limit). `base_url`: `http://host:port`."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        model: str | None = None,
        time_scale: float = 1.0,
    ) -> None:
        self.name = base_url
        self.time_scale = time_scale
        self.url = base_url.rstrip("/") + "/v1/completions"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        connector = aiohttp.TCPConnector(limit=0)
        self._session = aiohttp.ClientSession(connector=connector, headers=self.headers)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def stream(self, request: LoadRequest, timeout_s: float | None) -> AsyncIterator[Chunk]:
        body = {
            "prompt": list(request.prompt_ids),
            "max_tokens": request.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.model:
            body["model"] = self.model
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with self._session.post(self.url, json=body, timeout=timeout) as resp:
                if resp.status != 200:
                    raise LoadError(f"HTTP {resp.status}", _error_message(await resp.text()))
                async for line in resp.content:
                    if not line.startswith(b"data: "):
                        continue  # blank separators, SSE comments
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        raise LoadError("HTTP stream error", event["error"].get("message", ""))
                    if event.get("choices"):
                        yield Chunk(None)
                    elif event.get("usage"):
                        yield Chunk(0, int(event["usage"]["completion_tokens"]))
        except (aiohttp.ClientError, TimeoutError) as e:
            raise LoadError("HTTP transport error", repr(e)) from None


def _error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:200]
