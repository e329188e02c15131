"""KvHandle: where a prompt's KV lies on a prefill instance, and the right to fetch it."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.gen.distserve.v1 import common_pb2


@dataclass(frozen=True)
class KvHandle:
    """A prompt's KV held on a prefill instance (the same blocks in every layer).

    Crosses process boundaries as common.proto's KvHandle. `runs` lists the blocks in token
    order as (first block id, count); `block_bytes` is one block of one layer's K (or V).
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
    streaming: bool = False  # layers published as prefill computes them (see common.proto)
    # Ranks the source's KV is split over by heads; chunks come gathered, with every head.
    source_tensor_parallel_size: int = 1

    @property
    def num_blocks(self) -> int:
        return sum(n for _, n in self.runs)

    @property
    def layer_bytes(self) -> int:
        return 2 * self.num_blocks * self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def blocks(self) -> list[int]:
        return [b for first, n in self.runs for b in range(first, first + n)]

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
            streaming=pb.streaming,
            source_tensor_parallel_size=pb.source_tensor_parallel_size or 1,
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
            streaming=self.streaming,
            source_tensor_parallel_size=self.source_tensor_parallel_size,
        )
