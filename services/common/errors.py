"""Named errors raised inside services.

Each error carries the gRPC status it maps to (by name, so this module needs no grpc import).
Servicers translate them to status codes in exactly one place; HTTP maps those codes in turn.
"""

from __future__ import annotations


class DistServeError(Exception):
    """Base of every error the mesh raises on purpose. `status` names the gRPC status code."""

    status = "INTERNAL"


class InvalidRequest(DistServeError):
    """The caller sent something we cannot serve; the message says what and how to fix it.

    `param` names the offending request field where there is one (the HTTP API reports it).
    """

    status = "INVALID_ARGUMENT"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class UnsupportedModel(DistServeError):
    """The model folder describes an architecture or option the engine does not implement."""

    status = "FAILED_PRECONDITION"


class ModelLoadError(DistServeError):
    """The model folder is missing files, or a file is corrupt or does not match config.json."""

    status = "FAILED_PRECONDITION"


class OutOfKvBlocks(DistServeError):
    """The KV block pool cannot satisfy an allocation; the caller may wait, preempt or refuse."""

    status = "RESOURCE_EXHAUSTED"

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"KV cache full: {needed} blocks needed, {free} free")
        self.needed = needed
        self.free = free


class Overloaded(DistServeError):
    """The mesh refuses a request it cannot serve in time now; `retry_after_s` says when to
    try again (HTTP Retry-After, gRPC trailing metadata `retry-after-ms`)."""

    status = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotFound(DistServeError):
    """The named thing (a KV handle, a request, a model) does not exist, or no longer does."""

    status = "NOT_FOUND"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PermissionDenied(DistServeError):
    """The caller lacks the right to it (e.g. a wrong KV access token)."""

    status = "PERMISSION_DENIED"


class Unavailable(DistServeError):
    """A dependency is down or gone (no worker, a KV source that vanished); retry may help."""

    status = "UNAVAILABLE"


class DeadlineExceeded(DistServeError):
    """The request's deadline passed before it could finish."""

    status = "DEADLINE_EXCEEDED"


class RemoteError(DistServeError):
    """A downstream service answered with an error; its status is passed on unchanged."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


class FailedPrecondition(DistServeError):
    """The system is not in a state to serve this (e.g. instances with incompatible KV layouts)."""

    status = "FAILED_PRECONDITION"
