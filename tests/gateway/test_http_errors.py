"""The one table that turns the mesh's errors into HTTP statuses and OpenAI-shaped bodies."""

from __future__ import annotations

import pytest

from services.common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidRequest,
    NotFound,
    OutOfKvBlocks,
    RemoteError,
    Unavailable,
)
from services.gateway.http_errors import error_body


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (InvalidRequest("bad", param="top_p"), 400, "invalid_request_error"),
        (NotFound("no such model", param="model"), 404, "not_found_error"),
        (OutOfKvBlocks(10, 2), 429, "rate_limit_error"),
        (Unavailable("no worker"), 503, "service_unavailable_error"),
        (DeadlineExceeded("late"), 504, "timeout_error"),
        (FailedPrecondition("models differ"), 500, "server_error"),
        (RemoteError("NOT_FOUND", "KV handle 7 lapsed"), 503, "service_unavailable_error"),
        (RemoteError("PERMISSION_DENIED", "wrong token"), 503, "service_unavailable_error"),
        (RemoteError("INTERNAL", "KeyError: secret"), 500, "server_error"),
    ],
)
def test_each_status_maps_to_one_http_status_with_an_openai_body(error, status, kind):
    got, body = error_body(error)
    assert got == status
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == kind


def test_messages_pass_through_except_for_unknown_faults():
    assert error_body(InvalidRequest("top_p must be in (0, 1]", "top_p"))[1]["error"] == {
        "message": "top_p must be in (0, 1]",
        "type": "invalid_request_error",
        "param": "top_p",
        "code": None,
    }
    assert error_body(NotFound("gone", param="model"))[1]["error"]["code"] == "model_not_found"
    assert error_body(RemoteError("INTERNAL", "KeyError: secret"))[1]["error"]["message"] == (
        "internal error"
    )
    assert "retry" in error_body(RemoteError("NOT_FOUND", "lapsed"))[1]["error"]["message"]
