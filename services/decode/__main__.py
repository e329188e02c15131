"""`python -m services.decode`: run one decode (or colocated) instance."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from services.common import clock, telemetry
from services.common.errors import InvalidRequest
from services.common.etcd_client import add_etcd_args, etcd_config
from services.common.gen.distserve.v1 import decode_pb2, decode_pb2_grpc
from services.common.hub import refuse_at_start, with_local_model
from services.common.metrics import StatsCollector, add_metrics_args, worker_registry
from services.common.metrics import serve as serve_metrics
from services.common.server import (
    add_health_port_args,
    plaintext_health,
    run,
    setup_logging,
    start_server,
)
from services.decode.config import ROLES, DecodeConfig
from services.decode.servicer import DecodeServicer, role_pb, worker_load, worker_stats
from services.decode.worker import DecodeWorker
from services.engine.config import (
    EngineConfig,
    add_engine_args,
    configure_process,
    process_ranks,
)
from services.kvtransfer.puller import PullPolicy
from services.kvtransfer.ucx_setup import add_ucx_args, configure_ucx, shutdown_ucx
from services.worker.announcer import (
    LOAD_FEED_SERVICE,
    LoadFeed,
    add_drain_args,
    serve_as_worker,
)

log = logging.getLogger("distserve.decode")


def parse(argv: list[str] | None = None) -> tuple[DecodeConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m services.decode", description=__doc__)
    p.add_argument(
        "--model",
        help="model folder or Hugging Face Hub id (default: the embedded tiny model)",
    )
    p.add_argument("--revision", help="with a Hub id: branch, tag or commit (default: main)")
    add_etcd_args(p.add_argument_group("etcd"), "join the mesh there (none: standalone)")
    p.add_argument("--role", choices=ROLES, default="decode")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--worker-id", default="")
    policy = PullPolicy()
    p.add_argument(
        "--chunk-kb", type=int, default=policy.chunk_bytes // 1024, help="largest KV chunk"
    )
    p.add_argument(
        "--pull-window", type=int, default=policy.window, help="KV chunks in flight per pull"
    )
    p.add_argument(
        "--chunk-timeout-s", type=float, default=policy.chunk_timeout_s, help="one try at a chunk"
    )
    p.add_argument("--chunk-attempts", type=int, default=policy.attempts, help="tries per chunk")
    p.add_argument(
        "--kv-lanes",
        type=int,
        default=policy.lanes,
        help="UCX connections per KV source, each copying on a core of its own (0: two where "
        "this process may use two cores or more, else one)",
    )
    p.add_argument("--kv-transport", choices=("auto", "ucx", "grpc"), default="auto")
    add_metrics_args(p)
    add_health_port_args(p)
    add_drain_args(p)
    add_ucx_args(p)
    add_engine_args(p)
    clock.add_args(p)
    args = p.parse_args(argv)
    try:
        etcd = etcd_config(args)
    except InvalidRequest as e:
        p.error(str(e))
    if args.model is None:
        from services.engine.presets import default_model

        args.model = default_model("tiny")
    config = DecodeConfig(
        model=Path(args.model),
        etcd=etcd,
        role=args.role,
        host=args.host,
        port=args.port,
        worker_id=args.worker_id,
        pull=PullPolicy(
            chunk_bytes=args.chunk_kb * 1024,
            window=args.pull_window,
            chunk_timeout_s=args.chunk_timeout_s,
            attempts=args.chunk_attempts,
            lanes=args.kv_lanes,
        ),
        kv_transport=args.kv_transport,
        metrics_port=args.metrics_port,
        health_port=args.health_port,
        drain_timeout_s=args.drain_timeout_s,
        # an emulated colocated instance steps by the colocated baseline's fit, as the planner
        engine=EngineConfig.from_args(args, "vllm" if args.role == "colocated" else "distserve"),
        tensor_parallel_size=process_ranks(args),
        threads=args.threads,
    )
    return config, args


async def serve(config: DecodeConfig) -> None:
    probe = plaintext_health(config.host, config.health_port)  # NOT_SERVING while loading
    registry = worker_registry()
    worker = DecodeWorker(config, registry)
    registry.register(StatsCollector(lambda: worker_stats(worker)))
    metrics_address = serve_metrics(registry, config.host, config.metrics_port)
    feed = LoadFeed(lambda: worker_load(worker), worker.loop.prefix_log)

    def add(server) -> None:
        decode_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(worker), server)
        feed.add_to(server)

    names = [decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name, LOAD_FEED_SERVICE]
    server, health, port = await start_server(config.host, config.port, add, names, probe)
    address = f"{config.host}:{port}"
    await worker.start()

    async def stop() -> None:
        await worker.stop()
        shutdown_ucx()
        telemetry.shutdown()
        if probe is not None:
            probe.stop()

    await serve_as_worker(
        server=server,
        health=health,
        etcd=config.etcd,
        feed=feed,
        worker_id=config.worker_id,
        role=role_pb(worker),
        service=config.role,
        address=address,
        model=config.model.name,
        tensor_parallel_size=config.tensor_parallel_size,
        drain=worker.drain,
        drain_timeout_s=config.drain_timeout_s,
        stop=stop,
        metrics_address=metrics_address,
        **({"health_address": probe.address} if probe is not None else {}),
    )


def main(argv: list[str] | None = None) -> None:
    setup_logging()
    with refuse_at_start("decode"):
        config, args = parse(argv)
        config = with_local_model(config, args.revision)
        configure_process(args)
        configure_ucx(args)
        clock.setup_from_args(args)
        telemetry.setup(config.role, config.worker_id, engine=args.engine)
        run(serve(config))


if __name__ == "__main__":
    main()
