"""The engine commands a service runs on its engine thread: a small, closed vocabulary.

A tensor-parallel group is driven SPMD (docs/engine.md, "Tensor parallelism"): rank 0 serves
gRPC and every other rank must make the same engine calls in the same order. So every engine
mutation and every step is one of these commands, not a closure: rank 0 sends each to the other
ranks (`encode`, one JSON line, nothing pickled) and then applies it to its own engine; a
follower `decode`s and applies it. With tp == 1 a command is applied and nothing is sent.

Two commands move KV between the ranks of a group over torch.distributed (KV is split by heads):
`GatherKv` (a prefill instance serving a chunk with every head) and `ScatterKv` (a decode
instance writing pulled KV into each rank's heads). Their tensors travel as collectives; the
JSON line says only which blocks.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from services.common.errors import InvalidRequest
from services.common.sampling import SamplingParams
from services.engine.engine import LLMEngine
from services.engine.sequence import Sequence, StepOutput


@dataclass(frozen=True)
class AddRequest:
    """engine.add_request: a prompt to prefill here."""

    prompt: list[int]
    params: SamplingParams
    request_id: str

    def apply(self, engine: LLMEngine) -> str:
        return engine.add_request(self.prompt, self.params, self.request_id)


@dataclass(frozen=True)
class AddPrefilled:
    """engine.add_prefilled: a request whose KV will be pulled (decode)."""

    prompt: list[int]
    first_token: int | None
    params: SamplingParams
    request_id: str

    def apply(self, engine: LLMEngine) -> str:
        return engine.add_prefilled(self.prompt, self.first_token, self.params, self.request_id)


@dataclass(frozen=True)
class AdmitPulls:
    """engine.admit_pulls: blocks for queued pulled requests (decode)."""

    def apply(self, engine: LLMEngine) -> list[Sequence]:
        return engine.admit_pulls()


@dataclass(frozen=True)
class StartDecoding:
    """engine.start_decoding: a pulled request's KV is in place (decode)."""

    request_id: str
    first_token: int | None = None

    def apply(self, engine: LLMEngine) -> bool:
        return engine.start_decoding(self.request_id, self.first_token)


@dataclass(frozen=True)
class Abort:
    """engine.abort: cancel a request wherever it is."""

    request_id: str

    def apply(self, engine: LLMEngine) -> bool:
        return engine.abort(self.request_id)


@dataclass(frozen=True)
class Release:
    """engine.release: free the KV a prefill instance holds for a request."""

    request_id: str

    def apply(self, engine: LLMEngine) -> int:
        return engine.release(self.request_id)


@dataclass(frozen=True)
class Step:
    """engine.step: one iteration (decode and colocated instances)."""

    def apply(self, engine: LLMEngine) -> list[StepOutput]:
        return engine.step()


@dataclass(frozen=True)
class PrefillStep:
    """engine.prefill_step(hold=True): one prefill batch whose KV is held (prefill instance).
    Rank 0 runs it with its layer and scheduling callbacks; the others without."""

    def apply(self, engine: LLMEngine) -> list[StepOutput]:
        return engine.prefill_step(hold=True)


@dataclass(frozen=True)
class GatherKv:
    """A region of one layer's K or V with every KV head, gathered on rank 0 from the ranks
    that hold them (dist.gather, rank order = head order); rank 0 gets the raw bytes of a
    fresh (num_blocks, block_size, num_kv_heads, head_dim) tensor, the others None."""

    layer: int
    kv: int
    first_block: int
    num_blocks: int

    def apply(self, engine: LLMEngine) -> Any:
        tp = engine.tp
        local = engine.runner.cache.region(
            self.layer, self.kv, self.first_block, self.num_blocks
        ).contiguous()  # (n, block_size, kv_heads / tp, head_dim)
        if tp.rank != 0:
            dist.gather(local, None, dst=0, group=tp.group)
            return None
        parts = [torch.empty_like(local) for _ in range(tp.world_size)]
        dist.gather(local, parts, dst=0, group=tp.group)
        full = torch.cat(parts, dim=2).reshape(-1).view(torch.uint8)  # heads in rank order
        return full.numpy() if full.device.type == "cpu" else full


@dataclass(frozen=True)
class ScatterKv:
    """Write a prompt's KV with every head into `blocks`: rank 0 holds it (`tokens`, (layers,
    2, num_tokens, num_kv_heads, head_dim), never sent as JSON) and scatters each rank its
    heads (dist.scatter); every rank writes its part into its cache."""

    blocks: list[int]
    num_tokens: int
    tokens: torch.Tensor | None = field(default=None, compare=False)
    local_only: ClassVar[tuple[str, ...]] = ("tokens",)

    def apply(self, engine: LLMEngine) -> None:
        tp, cache = engine.tp, engine.runner.cache
        mine = torch.empty(
            (cache.num_layers, 2, self.num_tokens, cache.num_kv_heads, cache.head_dim),
            dtype=cache.data.dtype,
            device=cache.data.device,
        )
        if tp.world_size == 1:
            mine = self.tokens
        elif tp.rank == 0:
            per = cache.num_kv_heads
            parts = [
                self.tokens[:, :, :, r * per : (r + 1) * per].contiguous()
                for r in range(tp.world_size)
            ]
            dist.scatter(mine, parts, src=0, group=tp.group)
        else:
            dist.scatter(mine, None, src=0, group=tp.group)
        for layer in range(cache.num_layers):
            for kv in (0, 1):
                cache.write_tokens(layer, kv, self.blocks, mine[layer, kv])


EngineCommand = (
    AddRequest
    | AddPrefilled
    | AdmitPulls
    | StartDecoding
    | Abort
    | Release
    | Step
    | PrefillStep
    | GatherKv
    | ScatterKv
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
        GatherKv,
        ScatterKv,
    )
}


def encode(command: EngineCommand) -> bytes:
    """One JSON line: {"command": NAME, "args": {field: value}} (rank-local fields left out)."""
    skip = getattr(command, "local_only", ())
    args = {f.name: getattr(command, f.name) for f in fields(command) if f.name not in skip}
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
