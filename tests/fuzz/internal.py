"""What the internal-RPC fuzzer (test_internal_fuzz.py) shares: every internal method read from
the .proto descriptors, hostile values of any protobuf field as hypothesis strategies, and a
generic caller that passes bytes through, bounds every call with a deadline and tallies each
answer's status.

The methods come from the descriptors, not a hand-kept list, so that a method added to a
service and not fuzzed fails `test_every_internal_method_was_fuzzed`.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

from services.common.gen.distserve.v1 import (
    decode_pb2,
    gateway_pb2,
    kvtransfer_pb2,
    planner_pb2,
    prefill_pb2,
)

RESPONSE_TIME_S = 20.0  # every call's client deadline: an answer later than this is a hang
STREAM_REPLIES = 3  # a server stream is read this far, then cancelled (a client that leaves)
# Never the answer of a handler: an exception that escaped it, or an unmapped error.
NEVER = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}

# (proto module, service): every method of these is fuzzed.
SERVICES = (
    (prefill_pb2, "Prefill"),
    (decode_pb2, "Decode"),
    (kvtransfer_pb2, "KvTransfer"),
    (planner_pb2, "Planner"),
    (planner_pb2, "Actuator"),
    (gateway_pb2, "WorkerLoadFeed"),
    (gateway_pb2, "WorkerRegistry"),
)


@dataclass(frozen=True)
class Method:
    """One RPC: its path, its message classes and whether each side streams."""

    service: str  # short name, as in SERVICES
    name: str
    path: str
    request: type[Message]
    response: type[Message]
    client_streaming: bool
    server_streaming: bool

    @property
    def key(self) -> str:
        return f"{self.service}.{self.name}"


def methods() -> dict[str, Method]:
    """Every internal method, by `Service.Method`."""
    out = {}
    for module, service in SERVICES:
        desc = module.DESCRIPTOR.services_by_name[service]
        for m in desc.methods:
            method = Method(
                service,
                m.name,
                f"/{desc.full_name}/{m.name}",
                message_factory.GetMessageClass(m.input_type),
                message_factory.GetMessageClass(m.output_type),
                m.client_streaming,
                m.server_streaming,
            )
            out[method.key] = method
    return out


# Hostile values ---------------------------------------------------------------------------

_text = st.text(st.characters(codec="utf-8"), max_size=40)
HOSTILE_TEXT = st.one_of(
    _text,
    st.sampled_from(["", "\x00", "a\x00b", "\u202e", "../../etc/passwd", "/", "🙂" * 300]),
    st.integers(1, 4).map(lambda n: "x" * 10**n),
)
_U32 = 2**32 - 1
_U64 = 2**64 - 1
_I32, _I64 = 2**31, 2**63


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = sorted(e for e in {lo, hi, 0, 1, 1024, 2**31 - 1} if lo <= e <= hi)
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi), st.integers(max(lo, 0), 64))


_SCALARS: dict[int, st.SearchStrategy] = {
    FieldDescriptor.TYPE_DOUBLE: st.floats(allow_nan=True, allow_infinity=True),
    FieldDescriptor.TYPE_FLOAT: st.floats(width=32, allow_nan=True, allow_infinity=True),
    FieldDescriptor.TYPE_INT32: _ints(-_I32, _I32 - 1),
    FieldDescriptor.TYPE_SINT32: _ints(-_I32, _I32 - 1),
    FieldDescriptor.TYPE_SFIXED32: _ints(-_I32, _I32 - 1),
    FieldDescriptor.TYPE_INT64: _ints(-_I64, _I64 - 1),
    FieldDescriptor.TYPE_SINT64: _ints(-_I64, _I64 - 1),
    FieldDescriptor.TYPE_SFIXED64: _ints(-_I64, _I64 - 1),
    FieldDescriptor.TYPE_UINT32: _ints(0, _U32),
    FieldDescriptor.TYPE_FIXED32: _ints(0, _U32),
    FieldDescriptor.TYPE_UINT64: _ints(0, _U64),
    FieldDescriptor.TYPE_FIXED64: _ints(0, _U64),
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    # Unknown values included: proto3 enums are open, a peer may send any int32.
    FieldDescriptor.TYPE_ENUM: _ints(-_I32, _I32 - 1),
    FieldDescriptor.TYPE_STRING: HOSTILE_TEXT,
    FieldDescriptor.TYPE_BYTES: st.binary(max_size=64),
}


def _is_map(f: FieldDescriptor) -> bool:
    return f.message_type is not None and f.message_type.GetOptions().map_entry


def _repeated(f: FieldDescriptor) -> bool:
    return f.is_repeated


def value(f: FieldDescriptor, depth: int = 0) -> st.SearchStrategy:
    """A hostile value of field `f`: one element, or a list of them for a repeated field (a
    dict for a map), nested messages `messages` of their type."""
    if _is_map(f):
        key, val = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
        return st.dictionaries(_one(key, depth), _one(val, depth), max_size=4)
    one = _one(f, depth)
    if not _repeated(f):
        return one
    if f.type in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64):
        # Also as long as a prompt past the context, or a block list past the pool.
        return st.one_of(
            st.lists(one, max_size=6), st.tuples(one, st.integers(1000, 2100)).map(_many)
        )
    return st.lists(one, max_size=4 if f.message_type is not None else 6)


def _many(pair: tuple[int, int]) -> list[int]:
    v, n = pair
    return [v] * n


def _one(f: FieldDescriptor, depth: int) -> st.SearchStrategy:
    if f.type == FieldDescriptor.TYPE_MESSAGE:
        return messages(f.message_type, depth + 1)
    return _SCALARS[f.type]


def messages(desc: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of type `desc` with some of their fields set to hostile values (nested
    messages to depth 3)."""
    cls = message_factory.GetMessageClass(desc)
    fields = [] if depth >= 3 else list(desc.fields)

    @st.composite
    def build(draw) -> Message:
        msg = cls()
        chosen = draw(st.lists(st.sampled_from(fields), unique=True, max_size=4)) if fields else []
        for f in chosen:
            assign(msg, f, draw(value(f, depth)))
        return msg

    return build()


def assign(msg: Message, f: FieldDescriptor, v: object) -> None:
    """Set field `f` of `msg` to `v` (as `value` draws it), replacing what it held."""
    if _is_map(f):
        target = getattr(msg, f.name)
        target.clear()
        for k, x in v.items():
            if f.message_type.fields_by_name["value"].message_type is not None:
                target[k].CopyFrom(x)
            else:
                target[k] = x
    elif _repeated(f):
        target = getattr(msg, f.name)
        del target[:]
        if f.message_type is not None:
            for x in v:
                target.add().CopyFrom(x)
        else:
            target.extend(v)
    elif f.message_type is not None:
        getattr(msg, f.name).CopyFrom(v)
    else:
        setattr(msg, f.name, v)


@st.composite
def mutated(draw, base: Message, max_fields: int = 3) -> Message:
    """`base` with up to `max_fields` of its fields (or of its set sub-messages' fields) given
    hostile values: a valid request with a few hostile values mixed in."""
    msg = type(base)()
    msg.CopyFrom(base)
    targets = [(msg, f) for f in msg.DESCRIPTOR.fields]
    for f in msg.DESCRIPTOR.fields:
        if f.message_type is not None and not _repeated(f) and msg.HasField(f.name):
            sub = getattr(msg, f.name)
            targets += [(sub, g) for g in sub.DESCRIPTOR.fields]
    if not targets:
        return msg
    picks = draw(st.lists(st.integers(0, len(targets) - 1), unique=True, max_size=max_fields))
    for i in picks:
        owner, f = targets[i]
        assign(owner, f, draw(value(f)))
    return msg


@st.composite
def raw_bytes(draw, base: Message | None = None) -> bytes:
    """Random bytes, or `base`'s bytes truncated, bit-flipped or with junk added."""
    if base is None or draw(st.booleans()):
        return draw(st.binary(max_size=300))
    data = bytearray(base.SerializeToString())
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["truncate", "flip", "append", "insert"]))
        if how == "truncate" and data:
            del data[draw(st.integers(0, len(data) - 1)) :]
        elif how == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif how == "append":
            data += draw(st.binary(min_size=1, max_size=20))
        elif how == "insert":
            i = draw(st.integers(0, len(data)))
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


# Calling ----------------------------------------------------------------------------------


@dataclass
class Answer:
    code: grpc.StatusCode
    details: str
    replies: list[Message]


@dataclass
class Tally:
    """What the fuzzer sent and saw: calls and statuses per method, and the counts the run is
    judged by (docs in test_internal_fuzz.py)."""

    calls: collections.Counter = field(default_factory=collections.Counter)
    statuses: dict[str, collections.Counter] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter)
    )
    unauthorised_kv_reads: int = 0  # FetchChunk data, or source bytes served, without the token
    unauthorised_calls: int = 0  # a KvTransfer call answered OK without the handle's token
    replays_refused: int = 0  # a released handle's token, refused again
    crashes: int = 0
    leaked_blocks: int = 0
    leaked_leases: int = 0

    def record(self, method: Method, answer: Answer) -> None:
        self.calls[method.key] += 1
        self.statuses[method.key][answer.code.name] += 1

    def line(self) -> str:
        """`internal_fuzz {json}`: the counts, for a reader of the test's output."""
        codes = collections.Counter()
        for seen in self.statuses.values():
            codes.update(seen)
        return "internal_fuzz " + json.dumps(
            {
                "calls": sum(self.calls.values()),
                "calls_per_method": dict(sorted(self.calls.items())),
                "statuses": dict(sorted(codes.items())),
                "internal_or_unknown": codes["INTERNAL"] + codes["UNKNOWN"],
                "crashes": self.crashes,
                "unauthorised_kv_reads": self.unauthorised_kv_reads,
                "unauthorised_calls": self.unauthorised_calls,
                "replays_refused": self.replays_refused,
                "leaked_blocks": self.leaked_blocks,
                "leaked_leases": self.leaked_leases,
            },
            sort_keys=False,
        )


def call(
    channel: grpc.Channel,
    method: Method,
    request: Message | bytes | Iterable[Message | bytes],
    tally: Tally | None = None,
    timeout: float = RESPONSE_TIME_S,
    read: int = STREAM_REPLIES,
) -> Answer:
    """Send `request` (a message, or bytes passed through as they are; an iterable of them to
    a client-streaming method) and read the answer: a unary reply, or up to `read` replies of
    a stream, which is then cancelled (an answer of CANCELLED). Tallied if `tally` is given."""

    def raw(m: Message | bytes) -> bytes:
        return m if isinstance(m, bytes) else m.SerializeToString()

    parse = method.response.FromString
    replies: list[Message] = []
    code, details = grpc.StatusCode.OK, ""
    try:
        if method.client_streaming:
            stub = channel.stream_unary(method.path, lambda b: b, parse)
            replies.append(stub(iter([raw(m) for m in request]), timeout=timeout))
        elif method.server_streaming:
            stream = channel.unary_stream(method.path, lambda b: b, parse)(
                raw(request), timeout=timeout
            )
            for reply in stream:
                replies.append(reply)
                if len(replies) >= read:
                    stream.cancel()
                    code = grpc.StatusCode.CANCELLED
                    break
        else:
            replies.append(
                channel.unary_unary(method.path, lambda b: b, parse)(raw(request), timeout=timeout)
            )
    except grpc.RpcError as e:
        code, details = e.code(), e.details() or ""
    answer = Answer(code, details, replies)
    if tally is not None:
        tally.record(method, answer)
    return answer
