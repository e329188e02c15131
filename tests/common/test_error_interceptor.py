"""services/common/server.py's ErrorInterceptor on a real in-process gRPC server: each kind of
method (unary, server-streaming, client-streaming) turns our errors into their statuses, any
other exception into INTERNAL naming only its type, and an undecodable request into
INVALID_ARGUMENT; a handler's own abort and a normal answer pass through unchanged."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.errors import NotFound, Overloaded
from services.common.server import ErrorInterceptor


def _decode(data: bytes) -> bytes:
    data.decode("ascii")  # raises on non-ASCII: the "undecodable message" of this test
    return data


async def _outcome(request: bytes) -> bytes:
    """What each handler does for a request naming an outcome."""
    if request == b"not-found":
        raise NotFound("no such handle: h-1")
    if request == b"overloaded":
        raise Overloaded("too busy", retry_after_s=0.25)
    if request == b"bug":
        raise KeyError("secret-detail")
    return b"ok:" + request


async def unary(request, context):
    if request == b"abort":
        await context.abort(grpc.StatusCode.ALREADY_EXISTS, "its own abort")
    return await _outcome(request)


async def stream(request, context):
    yield b"first"  # a stream that fails after its first message ends with the error's status
    yield await _outcome(request)


async def client_stream(requests, context):
    seen = [r async for r in requests]
    return await _outcome(seen[-1])


HANDLERS = {
    "Unary": grpc.unary_unary_rpc_method_handler(unary, _decode),
    "Stream": grpc.unary_stream_rpc_method_handler(stream, _decode),
    "ClientStream": grpc.stream_unary_rpc_method_handler(client_stream, _decode),
}


async def _call(method: str, payload: bytes) -> tuple[grpc.StatusCode, str, list, tuple]:
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", HANDLERS),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            path = f"/t.T/{method}"
            if method == "Unary":
                call = channel.unary_unary(path)(payload, timeout=10)
                answers = [await call]
            elif method == "Stream":
                call = channel.unary_stream(path)(payload, timeout=10)
                answers = []
                try:
                    async for answer in call:
                        answers.append(answer)
                except grpc.aio.AioRpcError:
                    pass
            else:
                call = channel.stream_unary(path)(iter([b"x", payload]), timeout=10)
                answers = [await call]
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details(), [], e.trailing_metadata()
    finally:
        await server.stop(None)
    return await call.code(), await call.details(), answers, await call.trailing_metadata()


@pytest.mark.parametrize("method", ["Unary", "Stream", "ClientStream"])
@pytest.mark.parametrize(
    "payload, code, details",
    [
        (b"fine", grpc.StatusCode.OK, ""),
        (b"not-found", grpc.StatusCode.NOT_FOUND, "no such handle: h-1"),
        (b"bug", grpc.StatusCode.INTERNAL, "internal error: KeyError"),
        (b"\xff\xfe", grpc.StatusCode.INVALID_ARGUMENT, "no valid message of this method's type"),
    ],
)
def test_each_kind_of_method_answers_each_error_with_its_status(method, payload, code, details):
    got, text, answers, _ = asyncio.run(_call(method, payload))
    assert got == code, text
    assert details in text
    assert "secret-detail" not in text  # an unexpected error's message stays in the log
    if code == grpc.StatusCode.OK:
        assert answers[-1] == b"ok:fine"
    if method == "Stream" and payload != b"\xff\xfe":
        assert answers[0] == b"first"  # what was sent before the error reached the client


def test_a_refusal_with_a_retry_hint_carries_it_and_a_handlers_own_abort_passes_through():
    code, _, _, trailing = asyncio.run(_call("Unary", b"overloaded"))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("retry-after-ms", "250") in tuple(trailing or ())
    code, text, _, _ = asyncio.run(_call("Unary", b"abort"))
    assert (code, text) == (grpc.StatusCode.ALREADY_EXISTS, "its own abort")
