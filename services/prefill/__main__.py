"""`python -m services.prefill`: run one prefill instance."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from services.common import clock, telemetry
from services.common.errors import InvalidRequest
from services.common.etcd_client import add_etcd_args, etcd_config
from services.common.gen.distserve.v1 import (
    common_pb2,
    kvtransfer_pb2,
    kvtransfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
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
from services.engine.config import (
    EngineConfig,
    add_engine_args,
    configure_process,
    process_ranks,
)
from services.kvtransfer.servicer import KvTransferServicer
from services.kvtransfer.ucx_setup import add_ucx_args, configure_ucx, shutdown_ucx
from services.prefill.config import PrefillConfig
from services.prefill.servicer import PrefillServicer, worker_load, worker_stats
from services.prefill.worker import PrefillWorker
from services.worker.announcer import (
    LOAD_FEED_SERVICE,
    LoadFeed,
    add_drain_args,
    serve_as_worker,
)

log = logging.getLogger("distserve.prefill")


def parse(argv: list[str] | None = None) -> tuple[PrefillConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m services.prefill", description=__doc__)
    p.add_argument(
        "--model",
        help="model folder or Hugging Face Hub id (default: the embedded tiny model)",
    )
    p.add_argument("--revision", help="with a Hub id: branch, tag or commit (default: main)")
    add_etcd_args(p.add_argument_group("etcd"), "join the mesh there (none: standalone)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument(
        "--ucx-port",
        type=int,
        default=0,
        help="the KV data plane's UCX port (0: any); with tp > 1, rank r listens on this + r",
    )
    p.add_argument("--worker-id")
    p.add_argument("--lease-s", type=float, default=30.0, help="how long held KV waits for a pull")
    p.add_argument("--kv-faults", default="", help="inject data-plane faults (tests only)")
    p.add_argument("--no-ucx", action="store_true", help="serve KV over gRPC only")
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
    extra = {"worker_id": args.worker_id} if args.worker_id else {}
    config = PrefillConfig(
        model=Path(args.model),
        etcd=etcd,
        host=args.host,
        port=args.port,
        ucx_port=args.ucx_port,
        lease_s=args.lease_s,
        max_lease_s=max(300.0, args.lease_s),
        kv_faults=args.kv_faults,
        ucx=not args.no_ucx,
        metrics_port=args.metrics_port,
        health_port=args.health_port,
        drain_timeout_s=args.drain_timeout_s,
        engine=EngineConfig.from_args(args),
        tensor_parallel_size=process_ranks(args),
        threads=args.threads,
        **extra,
    )
    return config, args


async def serve(config: PrefillConfig) -> None:
    probe = plaintext_health(config.host, config.health_port)  # NOT_SERVING while loading
    registry = worker_registry()
    worker = PrefillWorker(config, registry)
    registry.register(StatsCollector(lambda: worker_stats(worker)))
    metrics_address = serve_metrics(registry, config.host, config.metrics_port)
    feed = LoadFeed(lambda: worker_load(worker), worker.loop.prefix_log)

    def add(server) -> None:
        prefill_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(worker), server)
        feed.add_to(server)
        kvtransfer_pb2_grpc.add_KvTransferServicer_to_server(
            KvTransferServicer(worker.leases, worker.free, worker.source), server
        )

    names = [
        prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name,
        kvtransfer_pb2.DESCRIPTOR.services_by_name["KvTransfer"].full_name,
        LOAD_FEED_SERVICE,
    ]
    server, health, port = await start_server(config.host, config.port, add, names, probe)
    address = f"{config.host}:{port}"
    await worker.start(address)

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
        role=common_pb2.WORKER_ROLE_PREFILL,
        service="prefill",
        address=address,
        model=config.model.name,
        tensor_parallel_size=config.tensor_parallel_size,
        drain=worker.drain,
        drain_timeout_s=config.drain_timeout_s,
        stop=stop,
        ucx_port=worker.chunks.port if worker.chunks is not None else 0,
        metrics_address=metrics_address,
        **({"health_address": probe.address} if probe is not None else {}),
    )


def main(argv: list[str] | None = None) -> None:
    setup_logging()
    with refuse_at_start("prefill"):
        config, args = parse(argv)
        config = with_local_model(config, args.revision)
        configure_process(args)
        configure_ucx(args)
        clock.setup_from_args(args)
        telemetry.setup("prefill", config.worker_id, engine=args.engine)
        run(serve(config))


if __name__ == "__main__":
    main()
