"""Configuration of a decode (or colocated) instance, validated once at start-up."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

from services.engine.config import EngineConfig

ROLES = ("decode", "colocated")


@dataclass(frozen=True)
class DecodeConfig:
    model: Path
    gateway: str | None  # host:port of the gateway's registry; None runs standalone
    role: str = "decode"  # decode | colocated
    host: str = "127.0.0.1"
    port: int = 0
    worker_id: str = ""
    chunk_bytes: int = 4 * 2**20  # largest KV chunk per UCX message
    pull_window: int = 4  # chunks in flight per pull
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}")
        if not self.worker_id:
            object.__setattr__(self, "worker_id", f"{self.role}-{uuid.uuid4().hex[:8]}")
        if self.chunk_bytes <= 0 or self.pull_window <= 0:
            raise ValueError("chunk_bytes and pull_window must be positive")
