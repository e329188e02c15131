"""Named errors raised inside services.

Each error carries the gRPC status it maps to (by name, so this module needs no grpc import).
Servicers translate them to status codes in exactly one place; HTTP maps those codes in turn.
"""

from __future__ import annotations


class DistServeError(Exception):
    """Base of every error the mesh raises on purpose. `status` names the gRPC status code."""

    status = "INTERNAL"


class InvalidRequest(DistServeError):
    """The caller sent something we cannot serve; the message says what and how to fix it."""

    status = "INVALID_ARGUMENT"


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
