"""`python -m services.gateway`: run the gateway (public API and worker registry)."""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from services.common.gen.distserve.v1 import gateway_pb2, gateway_pb2_grpc
from services.common.model_config import ModelConfig
from services.common.server import announce_ready, setup_logging, start_server, wait_for_signal
from services.common.tokenizer import Tokenizer
from services.gateway.registry import Registry
from services.gateway.request import Limits
from services.gateway.router import Router
from services.gateway.servicer import GatewayServicer, RegistryServicer

log = logging.getLogger("distserve.gateway")


@dataclass(frozen=True)
class GatewayConfig:
    model: Path  # the model folder: tokenizer and limits (the gateway never loads weights)
    host: str = "127.0.0.1"
    port: int = 50051
    worker_lease_s: float = 3.0  # a worker that does not heartbeat this long is dropped
    max_tokens: int | None = None  # largest max_tokens accepted; default: the model's context


def parse(argv: list[str] | None = None) -> GatewayConfig:
    p = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__)
    p.add_argument("--model", type=Path, required=True, help="model folder (tokenizer, limits)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    p.add_argument("--worker-lease-s", type=float, default=3.0)
    p.add_argument("--max-tokens", type=int, help="largest max_tokens a request may ask")
    a = p.parse_args(argv)
    return GatewayConfig(a.model, a.host, a.port, a.worker_lease_s, a.max_tokens)


async def serve(config: GatewayConfig) -> None:
    model = ModelConfig.from_dir(config.model)
    tokenizer = Tokenizer.from_dir(config.model)
    registry = Registry(config.worker_lease_s)
    router = Router(registry, tokenizer)
    limits = Limits.for_model(model, config.max_tokens)

    def add(server) -> None:
        gateway_pb2_grpc.add_GatewayServicer_to_server(
            GatewayServicer(router, tokenizer, limits), server
        )
        gateway_pb2_grpc.add_WorkerRegistryServicer_to_server(RegistryServicer(registry), server)

    names = [
        gateway_pb2.DESCRIPTOR.services_by_name[n].full_name for n in ("Gateway", "WorkerRegistry")
    ]
    server, health, port = await start_server(config.host, config.port, add, names)
    announce_ready("gateway", address=f"{config.host}:{port}")
    await wait_for_signal()
    await health.enter_graceful_shutdown()
    await server.stop(grace=5)
    await router.close()


def main(argv: list[str] | None = None) -> None:
    setup_logging()
    asyncio.run(serve(parse(argv)))


if __name__ == "__main__":
    main()
