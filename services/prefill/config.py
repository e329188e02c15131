"""Configuration of a prefill instance, validated once at start-up."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

from services.common.etcd_client import EtcdConfig
from services.engine.config import EngineConfig


@dataclass(frozen=True)
class PrefillConfig:
    model: Path
    etcd: EtcdConfig | None  # the mesh's etcd to join; None runs standalone
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    ucx_port: int = 0
    worker_id: str = field(default_factory=lambda: f"prefill-{uuid.uuid4().hex[:8]}")
    lease_s: float = 30.0  # how long held KV waits for a pull before it is freed
    max_lease_s: float = 300.0  # the longest a renewal may extend a lease
    ucx: bool = True  # serve KV over UCX when ucxx is importable (gRPC is served always)
    kv_faults: str = ""  # fault injection on the KV data plane (tests only; see kvtransfer.faults)
    metrics_port: int = 0  # Prometheus /metrics; 0: any free port, -1: off
    health_port: int | None = None  # plaintext grpc.health.v1 alone (probes); None: off
    drain_timeout_s: float = 30.0  # on SIGTERM: how long in-flight work may take
    engine: EngineConfig = field(default_factory=EngineConfig)
    tensor_parallel_size: int = 1  # ranks of this instance; this process is rank 0
    threads: int | None = None  # torch threads of every rank (None: torch's choice)

    def __post_init__(self) -> None:
        if not 0 < self.lease_s <= self.max_lease_s:
            raise ValueError("need 0 < lease_s <= max_lease_s")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1")
