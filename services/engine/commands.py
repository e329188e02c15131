"""The engine commands a service runs on its engine thread: a small, closed vocabulary.

A tensor-parallel group is driven SPMD (docs/engine.md, "Tensor parallelism"): rank 0 serves
gRPC and every other rank must make the same engine calls in the same order. So every engine
mutation and every step is one of these commands, not a closure: rank 0 sends each to the other
ranks (`encode`, one JSON line, nothing pickled) and then applies it to its own engine; a
follower `decode`s and applies it. With tp == 1 a command is applied and nothing is sent.

A follower also has its own KV data plane (`kv` below, a KvHooks that the worker layer
implements; None on rank 0, which moves its heads on its event loop): the commands that start
or end a transfer tell it too. KV never moves between the ranks of a group.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

from services.common.errors import InvalidRequest
from services.common.sampling import SamplingParams
from services.engine.engine import LLMEngine
from services.engine.kv_hooks import KvHooks
from services.engine.sequence import Sequence, StepOutput


@dataclass(frozen=True)
class AddRequest:
    """engine.add_request: a prompt to prefill here."""

    prompt: list[int]
    params: SamplingParams
    request_id: str

    def apply(self, engine: LLMEngine, kv: KvHooks | None = None) -> str:
        return engine.add_request(self.prompt, self.params, self.request_id)


@dataclass(frozen=True)
class AddPrefilled:
    """engine.add_prefilled: a request whose KV will be pulled (decode)."""

    prompt: list[int]
    first_token: int | None
    params: SamplingParams
    request_id: str
    reuse_prefix: bool = False  # start from its prompt's cached prefix here; pull the rest
    # n > 1: (index, first token) of each choice to decode; first_token is None then
    choices: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:  # JSON brings lists back
        object.__setattr__(self, "choices", tuple((i, t) for i, t in self.choices))

    def apply(self, engine: LLMEngine, kv: KvHooks | None = None) -> str:
        return engine.add_prefilled(
            self.prompt,
            self.first_token,
            self.params,
            self.request_id,
            reuse_prefix=self.reuse_prefix,
            choices=self.choices,
        )


@dataclass(frozen=True)
class AdmitPulls:
    """engine.admit_pulls: blocks for queued pulled requests (decode)."""

    def apply(self, engine: LLMEngine, kv: KvHooks | None = None) -> list[Sequence]:
        return engine.admit_pulls()


@dataclass(frozen=True)
class StartDecoding:
    """engine.start_decoding: a pulled request's KV is in place (decode)."""

    request_id: str
    first_token: int | None = None

    def apply(self, engine: LLMEngine, kv: KvHooks | None = None) -> bool:
        return engine.start_decoding(self.request_id, self.first_token)


@dataclass(frozen=True)
class Abort:
    """engine.abort: cancel a request wherever it is."""

    request_id: str

    def apply(self, engine: LLMEngine, kv: KvHooks | None = None) -> bool:
        if kv is not None:  # its transfer stops before its blocks are freed
            kv.forget(self.request_id)
        return engine.abort(self.request_id)


@dataclass(frozen=True)
class Release:
    """engine.release: free the KV a prefill instance holds for a request."""

    request_id: str

    def apply(self, engine: LLMEngine, kv: KvHooks | None = None) -> int:
        if kv is not None:  # its sends stop before its blocks are freed
            kv.forget(self.request_id)
        return engine.release(self.request_id)


@dataclass(frozen=True)
class Step:
    """engine.step: one iteration (decode and colocated instances)."""

    def apply(self, engine: LLMEngine, kv: KvHooks | None = None) -> list[StepOutput]:
        return engine.step()


@dataclass(frozen=True)
class PrefillStep:
    """engine.prefill_step(hold=True): one prefill batch whose KV is held (prefill instance).
    Rank 0 runs it with its event loop's layer and scheduling callbacks (EngineLoop); a
    follower with its data plane's, so that it serves each layer as soon as it is computed."""

    def apply(self, engine: LLMEngine, kv: KvHooks | None = None) -> list[StepOutput]:
        if kv is None:
            return engine.prefill_step(hold=True)
        outputs = engine.prefill_step(hold=True, on_scheduled=kv.scheduled, on_layer=kv.layer_done)
        kv.step_done(outputs)
        return outputs


@dataclass(frozen=True)
class PullKv:
    """Pull a handle's KV into a pulled request's blocks (decode): each follower pulls the heads
    it owns and reports to rank 0; rank 0 pulls its own heads on its event loop, not here."""

    request_id: str
    handle: str  # KvHandle.encode(): the engine does not read it
    blocks: list[int]  # for the handle's blocks from `skip` on
    skip: int = 0  # the handle's first blocks the request reuses from the prefix cache

    def apply(self, engine: LLMEngine, kv: KvHooks | None = None) -> None:
        if kv is not None:
            kv.pull(self.request_id, self.handle, self.blocks, self.skip)


EngineCommand = (
    AddRequest
    | AddPrefilled
    | AdmitPulls
    | StartDecoding
    | Abort
    | Release
    | Step
    | PrefillStep
    | PullKv
)
COMMANDS: dict[str, type] = {
    c.__name__: c
    for c in (
        AddRequest,
        AddPrefilled,
        AdmitPulls,
        StartDecoding,
        Abort,
        Release,
        Step,
        PrefillStep,
        PullKv,
    )
}


def encode(command: EngineCommand) -> bytes:
    """One JSON line: {"command": NAME, "args": {field: value}}."""
    args = {f.name: getattr(command, f.name) for f in fields(command)}
    if isinstance(args.get("params"), SamplingParams):
        args["params"] = asdict(args["params"])
    return json.dumps({"command": type(command).__name__, "args": args}).encode() + b"\n"


def decode(line: bytes) -> EngineCommand:
    """The command of one line from rank 0; InvalidRequest for anything outside the vocabulary."""
    message = json.loads(line)
    cls = COMMANDS.get(message.get("command"))
    if cls is None:
        raise InvalidRequest(f"unknown engine command {message.get('command')!r}")
    args = dict(message["args"])
    if "params" in args:
        args["params"] = SamplingParams(**args["params"])
    return cls(**args)
