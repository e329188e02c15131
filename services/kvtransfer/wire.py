"""Fixed-size frames for the UCX data plane's small messages.

Each request and status is one UCX message of FRAME_BYTES: a 4-byte little-endian length, then a
serialized protobuf (KvChunkRequest or KvChunkStatus), then padding. Fixed sizes let many
requests share one endpoint without interleaving, and nothing is ever unpickled.
"""

from __future__ import annotations

import struct

import numpy as np

from services.common.errors import InvalidRequest
from services.common.gen.distserve.v1 import kvtransfer_pb2

MAX_CHUNKS = 32  # per request: the status frame carries a checksum for each
FRAME_BYTES = 1024  # a status with MAX_CHUNKS checksums, a request with as many ranges

ChunkRequest = kvtransfer_pb2.KvChunkRequest
ChunkRange = kvtransfer_pb2.KvChunkRange
ChunkStatus = kvtransfer_pb2.KvChunkStatus


def encode(message) -> np.ndarray:
    body = message.SerializeToString()
    if len(body) + 4 > FRAME_BYTES:
        raise InvalidRequest(f"frame of {len(body)} bytes exceeds {FRAME_BYTES - 4}")
    frame = np.zeros(FRAME_BYTES, dtype=np.uint8)
    frame[:4] = np.frombuffer(struct.pack("<I", len(body)), dtype=np.uint8)
    frame[4 : 4 + len(body)] = np.frombuffer(body, dtype=np.uint8)
    return frame


def decode(frame: np.ndarray, message_type):
    (n,) = struct.unpack("<I", frame[:4].tobytes())
    if n > FRAME_BYTES - 4:
        raise InvalidRequest("malformed frame: length exceeds the frame")
    message = message_type()
    message.ParseFromString(frame[4 : 4 + n].tobytes())
    return message


def empty_frame() -> np.ndarray:
    return np.empty(FRAME_BYTES, dtype=np.uint8)
