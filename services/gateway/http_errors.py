"""HTTP statuses and OpenAI-shaped error bodies: the one place where the HTTP API's exceptions
become answers (gRPC has its own, services/common/server.py)."""

from __future__ import annotations

import json
import logging
import math

from aiohttp import web

from services.common.errors import DistServeError, RemoteError, Unavailable

log = logging.getLogger("distserve.gateway.http")

# gRPC status (DistServeError.status) -> HTTP status. Anything else is a 500 with a safe message.
HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "NOT_FOUND": 404,
    "RESOURCE_EXHAUSTED": 429,
    "FAILED_PRECONDITION": 500,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}
# What a worker answers NOT_FOUND or PERMISSION_DENIED to (a KV handle that lapsed, a wrong
# access token) is the mesh's own state, not the caller's input: 503, worth a retry.
WORKER_STATE_LOST = {"NOT_FOUND", "PERMISSION_DENIED"}
ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}
MAX_BODY_BYTES = web.AppKey("max_body_bytes", int)  # --max-body-bytes, for the 413 message


def json_response(payload: dict, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.json_response(
        payload,
        status=status,
        headers=headers,
        dumps=lambda x: json.dumps(x, ensure_ascii=False, separators=(",", ":")),
    )


def error_body(e: DistServeError) -> tuple[int, dict]:
    """The HTTP status and OpenAI-shaped body of an error: the one mapping of the HTTP API."""
    if isinstance(e, RemoteError) and e.status in WORKER_STATE_LOST:
        e = Unavailable(f"the mesh lost this request's state ({e}); retry it")
    status = HTTP_STATUS.get(e.status, 500)
    message = str(e) if e.status in HTTP_STATUS else "internal error"
    code = "model_not_found" if status == 404 and getattr(e, "param", None) == "model" else None
    error = {
        "message": message,
        "type": ERROR_TYPE.get(status, "server_error"),
        "param": getattr(e, "param", None),
        "code": code,
    }
    return status, {"error": error}


def plain_error(status: int, message: str, code: str | None = None) -> web.Response:
    error = {
        "message": message,
        "type": ERROR_TYPE.get(status, "server_error"),
        "param": None,
        "code": code,
    }
    return json_response({"error": error}, status=status)


@web.middleware
async def errors_middleware(request: web.Request, handler) -> web.StreamResponse:
    """The one place where exceptions become HTTP statuses with OpenAI-shaped bodies."""
    try:
        return await handler(request)
    except DistServeError as e:
        status, body = error_body(e)
        if status >= 500:
            log.warning("%s %s: %s: %s", request.method, request.path, e.status, e)
        response = json_response(body, status=status)
        retry_after_s = getattr(e, "retry_after_s", None)
        if retry_after_s:
            response.headers["retry-after"] = str(math.ceil(retry_after_s))
        return response
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[MAX_BODY_BYTES]
        return plain_error(
            413, f"the request body is larger than {limit} bytes", "request_too_large"
        )
    except web.HTTPNotFound:
        return plain_error(404, f"no such path: {request.path}", "not_found")
    except web.HTTPMethodNotAllowed as e:
        allowed = ", ".join(sorted(e.allowed_methods))
        message = f"{request.method} is not allowed on {request.path}; use {allowed}"
        return plain_error(405, message)
    except (web.HTTPException, ConnectionResetError):
        raise  # aiohttp's own answers; a client that went away needs none
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return plain_error(500, "internal error")
