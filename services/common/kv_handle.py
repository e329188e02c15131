"""KvHandle: where a prompt's KV lies on a prefill instance, and the right to fetch it."""

from __future__ import annotations

import base64
from dataclasses import dataclass

from services.common.gen.distserve.v1 import common_pb2


@dataclass(frozen=True)
class RankSource:
    """One rank of a KV source: where it serves and the KV heads it holds (global indices)."""

    rank: int
    ucx_host: str
    ucx_port: int
    heads: range


@dataclass(frozen=True)
class KvHandle:
    """A prompt's KV held on a prefill instance (the same blocks in every layer).

    Crosses process boundaries as common.proto's KvHandle. `runs` lists the blocks in token
    order as (first block id, count); `block_bytes` is one block of one layer's plane: its K
    (or V) of `kv_planes` 2, its latent of `kv_planes` 1 (multi-head latent attention).
    """

    handle_id: str
    source_instance: str
    control_address: str
    ucx_host: str
    ucx_port: int
    num_tokens: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    runs: tuple[tuple[int, int], ...]
    block_bytes: int
    lease_expiry_unix_ms: int
    access_token: str
    layerwise: bool = False  # layers published as prefill computes them (see common.proto)
    # A tensor-parallel source's ranks, each serving the heads it holds (empty: one rank, all
    # heads, at ucx_host:ucx_port). block_bytes counts every head either way.
    rank_sources: tuple[RankSource, ...] = ()
    kv_planes: int = 2

    @property
    def num_blocks(self) -> int:
        return sum(n for _, n in self.runs)

    @property
    def layer_bytes(self) -> int:
        return self.kv_planes * self.num_blocks * self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def sources(self) -> tuple[RankSource, ...]:
        """Where each head is served: the rank sources, or the one source holding them all."""
        if self.rank_sources:
            return self.rank_sources
        return (RankSource(0, self.ucx_host, self.ucx_port, range(self.num_kv_heads)),)

    def blocks(self) -> list[int]:
        return [b for first, n in self.runs for b in range(first, first + n)]

    def encode(self) -> str:
        """The handle as text (its protobuf, base64): for JSON messages between processes."""
        return base64.b64encode(self.to_pb().SerializeToString()).decode()

    @classmethod
    def decode(cls, text: str) -> KvHandle:
        return cls.from_pb(common_pb2.KvHandle.FromString(base64.b64decode(text)))

    @classmethod
    def from_pb(cls, pb: common_pb2.KvHandle) -> KvHandle:
        return cls(
            handle_id=pb.handle_id,
            source_instance=pb.source_instance,
            control_address=pb.control_address,
            ucx_host=pb.ucx_host,
            ucx_port=pb.ucx_port,
            num_tokens=pb.num_tokens,
            block_size=pb.block_size,
            num_layers=pb.num_layers,
            num_kv_heads=pb.num_kv_heads,
            head_dim=pb.head_dim,
            dtype=pb.dtype,
            runs=tuple((r.first, r.count) for r in pb.runs),
            block_bytes=pb.block_bytes,
            lease_expiry_unix_ms=pb.lease_expiry_unix_ms,
            access_token=pb.access_token,
            layerwise=pb.layerwise,
            rank_sources=tuple(
                RankSource(
                    r.rank, r.ucx_host, r.ucx_port, range(r.first_head, r.first_head + r.num_heads)
                )
                for r in pb.rank_sources
            ),
            kv_planes=pb.kv_planes,
        )

    def to_pb(self) -> common_pb2.KvHandle:
        return common_pb2.KvHandle(
            handle_id=self.handle_id,
            source_instance=self.source_instance,
            control_address=self.control_address,
            ucx_host=self.ucx_host,
            ucx_port=self.ucx_port,
            num_tokens=self.num_tokens,
            block_size=self.block_size,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            runs=[common_pb2.BlockRun(first=f, count=n) for f, n in self.runs],
            block_bytes=self.block_bytes,
            layer_bytes=self.layer_bytes,
            lease_expiry_unix_ms=self.lease_expiry_unix_ms,
            access_token=self.access_token,
            layerwise=self.layerwise,
            rank_sources=[
                common_pb2.KvRankSource(
                    rank=r.rank,
                    ucx_host=r.ucx_host,
                    ucx_port=r.ucx_port,
                    first_head=r.heads.start,
                    num_heads=len(r.heads),
                )
                for r in self.rank_sources
            ],
            kv_planes=self.kv_planes,
        )
