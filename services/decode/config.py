"""Configuration of a decode (or colocated) instance, validated once at start-up."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

from services.common.etcd_client import EtcdConfig
from services.engine.config import EngineConfig
from services.kvtransfer.puller import PullPolicy

ROLES = ("decode", "colocated")


@dataclass(frozen=True)
class DecodeConfig:
    model: Path
    etcd: EtcdConfig | None  # the mesh's etcd to join; None runs standalone
    role: str = "decode"  # decode | colocated
    host: str = "127.0.0.1"
    port: int = 0
    worker_id: str = ""
    pull: PullPolicy = field(default_factory=PullPolicy)  # chunk size, window, retries
    kv_transport: str = "auto"  # auto (UCX when both sides have it) | ucx | grpc
    metrics_port: int = 0  # Prometheus /metrics; 0: any free port, -1: off
    health_port: int | None = None  # plaintext grpc.health.v1 alone (probes); None: off
    drain_timeout_s: float = 30.0  # on SIGTERM: how long in-flight work may take
    engine: EngineConfig = field(default_factory=EngineConfig)
    tensor_parallel_size: int = 1  # ranks of this instance; this process is rank 0
    threads: int | None = None  # torch threads of every rank (None: torch's choice)

    def __post_init__(self) -> None:
        if self.kv_transport not in ("auto", "ucx", "grpc"):
            raise ValueError("kv_transport must be auto, ucx or grpc")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}")
        if not self.worker_id:
            object.__setattr__(self, "worker_id", f"{self.role}-{uuid.uuid4().hex[:8]}")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1")
        p = self.pull
        if p.chunk_bytes <= 0 or p.window <= 0 or p.attempts <= 0 or p.chunk_timeout_s <= 0:
            raise ValueError("chunk size, window, attempts and chunk timeout must be positive")
        if p.lanes < 0:
            raise ValueError("KV lanes must be 0 (automatic) or more")
