"""The edge's command-line options, shared by `python -m services.edge` and `distserve up`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from services.common.mesh_tls import MeshTls
from services.edge.config import EdgeConfig, otlp_grpc_endpoint, read_api_keys


def add_edge_options(p: argparse.ArgumentParser, port_flag: str = "--port") -> None:
    """The edge's options, shared with `distserve up`."""
    d = EdgeConfig()
    p.add_argument(port_flag, dest="edge_port", type=int, default=d.port, help="0: any free port")
    p.add_argument(
        "--tls-cert", type=Path, help="PEM certificate chain: serve TLS (with --tls-key)"
    )
    p.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    p.add_argument("--api-key", action="append", default=[], help="require this key (repeatable)")
    p.add_argument("--api-key-file", type=Path, help="require one of these keys (one per line)")
    p.add_argument(
        "--public-metrics",
        action="store_true",
        help="with API keys: serve the gateway's /metrics without a key (Prometheus scrapes)",
    )
    p.add_argument(
        "--stats-port",
        type=int,
        help="serve Envoy's own statistics for Prometheus on this port of the listener's "
        "address (GET /metrics or /stats/prometheus; nothing else of the admin interface); "
        "needs --admin-port",
    )
    p.add_argument(
        "--admin-port",
        type=int,
        default=d.admin_port,
        help="Envoy's admin interface, on 127.0.0.1 only (default: any free port)",
    )
    p.add_argument("--max-body-bytes", type=int, default=d.max_request_bytes)
    p.add_argument(
        "--rate-limit", type=int, default=d.rate_limit_rps, help="requests/s over the edge; 0 off"
    )
    p.add_argument("--rate-limit-burst", type=int, help="bucket size (default: 2 x --rate-limit)")
    p.add_argument("--stream-idle-timeout-s", type=float, default=d.stream_idle_timeout_s)
    p.add_argument("--edge-concurrency", type=int, default=d.concurrency, help="Envoy threads")
    p.add_argument("--access-log", default=d.access_log, help="'-' stdout, '' off, or a file")


def edge_config(a: argparse.Namespace, host: str) -> EdgeConfig:
    keys = tuple(a.api_key) + (read_api_keys(a.api_key_file) if a.api_key_file else ())
    return EdgeConfig(
        host=host,
        port=a.edge_port,
        admin_port=a.admin_port,
        stats_port=a.stats_port,
        tls_cert=a.tls_cert,
        tls_key=a.tls_key,
        api_keys=keys,
        public_metrics=a.public_metrics,
        max_request_bytes=a.max_body_bytes,
        rate_limit_rps=a.rate_limit,
        rate_limit_burst=a.rate_limit_burst or 2 * a.rate_limit,
        stream_idle_timeout_s=a.stream_idle_timeout_s,
        concurrency=a.edge_concurrency,
        access_log=a.access_log,
        otlp_endpoint=otlp_grpc_endpoint(os.environ),
        upstream_tls=tls.paths if (tls := MeshTls.from_env(os.environ)) else None,
    )
