"""`python -m services.planner`: serve the planner (Plan, GetPlacement, ReportWorkload)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from services.common import clock, telemetry
from services.common.gen.distserve.v1 import planner_pb2, planner_pb2_grpc
from services.common.metrics import add_metrics_args, worker_registry
from services.common.metrics import serve as serve_metrics
from services.common.server import (
    announce_ready,
    run,
    setup_logging,
    start_server,
    wait_for_signal,
)
from services.planner.config import PlannerConfig
from services.planner.drift import DriftConfig
from services.planner.metrics import PlannerMetrics
from services.planner.replanner import Replanner
from services.planner.servicer import PlannerServicer

log = logging.getLogger("distserve.planner")


def parse(argv: list[str] | None = None) -> PlannerConfig:
    p = argparse.ArgumentParser(prog="python -m services.planner", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--profile", type=Path, help="latency profile (default: published A100)")
    p.add_argument("--colocated-profile", type=Path)
    p.add_argument("--cluster", default="1x8", help="NODESxGPUS[,INTRA_GBS,INTER_GBS]")
    p.add_argument("--workers", type=int, default=0, help="single host: split this many workers")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--drift-window", type=int, default=200, help="samples per window")
    p.add_argument("--drift-rate", type=float, default=0.3, help="relative rate shift")
    p.add_argument("--drift-length", type=float, default=0.25, help="relative length shift")
    p.add_argument("--drift-confirm", type=int, default=2, help="drifting windows in a row")
    add_metrics_args(p)
    clock.add_args(p)
    a = p.parse_args(argv)
    clock.setup_from_args(a)  # spans on the mesh's clock (an emulated mesh's is slower)
    return PlannerConfig(
        host=a.host,
        port=a.port,
        profile=a.profile,
        colocated_profile=a.colocated_profile,
        cluster=a.cluster,
        workers=a.workers,
        max_num_seqs=a.max_num_seqs,
        num_requests=a.num_requests,
        drift=DriftConfig(a.drift_window, a.drift_rate, a.drift_length, a.drift_confirm),
        metrics_port=a.metrics_port,
    )


async def serve(config: PlannerConfig) -> None:
    metrics = PlannerMetrics(worker_registry())
    servicer = PlannerServicer(config, Replanner(config.drift, config.workers), metrics)

    def add(server) -> None:
        planner_pb2_grpc.add_PlannerServicer_to_server(servicer, server)

    names = [planner_pb2.DESCRIPTOR.services_by_name["Planner"].full_name]
    server, health, port = await start_server(config.host, config.port, add, names)
    announce_ready(
        "planner",
        address=f"{config.host}:{port}",
        metrics_address=serve_metrics(metrics.registry, config.host, config.metrics_port),
    )
    sig = await wait_for_signal()
    log.info("signal %d: stopping", sig)
    await health.enter_graceful_shutdown()
    await server.stop(grace=5)


def main(argv: list[str] | None = None) -> None:
    setup_logging()
    config = parse(argv)
    telemetry.setup("planner")
    try:
        run(serve(config))
    finally:
        telemetry.shutdown()


if __name__ == "__main__":
    main()
