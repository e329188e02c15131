"""A source's refusal of a chunk request, both ways: the error a source raised, as the status it
sends (`refused`), and that status as the error the puller raises (`error_of`). The reason
travels as KvChunkStatus.Refusal, the message in words beside it."""

from __future__ import annotations

from services.common.errors import (
    DeadlineExceeded,
    DistServeError,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from services.common.gen.distserve.v1 import kvtransfer_pb2

Status = kvtransfer_pb2.KvChunkStatus

# The errors a source refuses with (ChunkSource: leases.get, open, ready); any other is a
# request it cannot serve.
_REASONS: dict[type[DistServeError], int] = {
    NotFound: Status.REFUSAL_NOT_FOUND,
    PermissionDenied: Status.REFUSAL_PERMISSION_DENIED,
    DeadlineExceeded: Status.REFUSAL_LAYER_NOT_COMPUTED,
}
# What the puller raises for each; any other reason (the request's own fault, none given) is
# an InvalidRequest. A layer the source did not compute in time (its prefill stalled or died
# mid-prompt) makes the pull Unavailable: the gateway prefills the prompt again elsewhere, as
# for a source that went away, rather than failing the client's request as its own fault.
_ERRORS: dict[int, type[DistServeError]] = {
    Status.REFUSAL_NOT_FOUND: NotFound,
    Status.REFUSAL_PERMISSION_DENIED: PermissionDenied,
    Status.REFUSAL_LAYER_NOT_COMPUTED: Unavailable,
}


def refused(error: DistServeError) -> kvtransfer_pb2.KvChunkStatus:
    """The status a source sends in place of the chunks when `error` refuses the request."""
    reason = _REASONS.get(type(error), Status.REFUSAL_INVALID_REQUEST)
    return Status(ok=False, error=str(error), refusal=reason)


def error_of(status: kvtransfer_pb2.KvChunkStatus) -> DistServeError:
    """The error a puller raises for a refusal (a status that is not ok)."""
    return _ERRORS.get(status.refusal, InvalidRequest)(status.error)
