"""What the edge (Envoy in front of the gateways) does: one frozen config, validated once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from services.common.errors import InvalidRequest


@dataclass(frozen=True)
class Upstream:
    """One gateway as Envoy sees it: its gRPC and its HTTP (OpenAI API) host:port."""

    grpc: str
    http: str


@dataclass(frozen=True)
class EdgeConfig:
    """Envoy's listener and policies. Defaults: plain HTTP/1.1 + HTTP/2 on 127.0.0.1:8080, no
    API keys, 8 MiB bodies, 100 requests/s (bursts of 200), streams cut after 300 s idle."""

    host: str = "127.0.0.1"
    port: int = 8080  # 0 picks a free port
    admin_port: int = 0  # the admin interface, always on 127.0.0.1; 0 picks a free port
    # Envoy's own statistics for Prometheus: a plaintext listener on host:stats_port that
    # serves GET /metrics (and /stats/prometheus) from the admin interface and nothing else of
    # it; None: off (the statistics stay on the admin interface).
    stats_port: int | None = None
    tls_cert: Path | None = None  # PEM certificate chain; with tls_key, TLS is on
    tls_key: Path | None = None
    api_keys: tuple[str, ...] = ()  # when set, every request but /health needs one
    public_metrics: bool = False  # with api_keys: GET /metrics needs no key either
    max_request_bytes: int = 8 * 2**20  # larger bodies get 413
    rate_limit_rps: int = 100  # requests per second over the whole edge; 0 is off
    rate_limit_burst: int = 200  # the token bucket's size
    stream_idle_timeout_s: float = 300.0  # a stream that sends nothing this long is cut
    request_timeout_s: float = 60.0  # time to receive a whole request (not its answer)
    retries: int = 2  # retries of a request that failed before its first response byte
    concurrency: int = 1  # Envoy worker threads
    access_log: str = "-"  # "-" is stdout, "" is off, else a file path
    log_level: str = "warn"  # Envoy's own log (stderr)
    # Tracing: Envoy's own span of each request, exported over OTLP/gRPC to this host:port
    # (a collector); "" is off (Envoy still passes a client's traceparent through).
    otlp_endpoint: str = ""
    trace_sampling_percent: float = 100.0  # of requests that arrive without a sampling decision
    # Mesh TLS toward the gateway (services.common.mesh_tls): PEM paths (cert, key, CA); None:
    # plaintext upstream.
    upstream_tls: tuple[str, str, str] | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise InvalidRequest("TLS needs both a certificate and a key")
        for path in (self.tls_cert, self.tls_key):
            if path is not None and not Path(path).is_file():
                raise InvalidRequest(f"TLS file {path} does not exist")
        for key in self.api_keys:
            if not key or not key.isprintable() or any(c.isspace() for c in key):
                raise InvalidRequest("API keys must be non-empty printable strings without spaces")
        if len(set(self.api_keys)) != len(self.api_keys):
            raise InvalidRequest("API keys must be distinct")
        if self.max_request_bytes < 1:
            raise InvalidRequest("max_request_bytes must be >= 1")
        if self.rate_limit_rps < 0 or (self.rate_limit_rps and self.rate_limit_burst < 1):
            raise InvalidRequest("the rate limit needs rps >= 0 and a burst >= 1")
        if self.stream_idle_timeout_s <= 0 or self.request_timeout_s <= 0:
            raise InvalidRequest("timeouts must be > 0 seconds")
        if self.retries < 0 or self.concurrency < 1:
            raise InvalidRequest("retries must be >= 0 and concurrency >= 1")
        if self.otlp_endpoint and not self.otlp_endpoint.rpartition(":")[2].isdigit():
            raise InvalidRequest(f"the OTLP endpoint {self.otlp_endpoint!r} is not host:port")
        if self.stats_port is not None:
            if self.admin_port == 0:
                raise InvalidRequest(
                    "--stats-port forwards to Envoy's admin interface (127.0.0.1), which then "
                    "needs a fixed port: give --admin-port"
                )
            if self.stats_port != 0 and self.stats_port in (self.port, self.admin_port):
                raise InvalidRequest("--stats-port must differ from the edge's and the admin port")
        if not 0 <= self.trace_sampling_percent <= 100:
            raise InvalidRequest("trace sampling is a percentage, 0 to 100")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


def otlp_grpc_endpoint(env: Mapping[str, str]) -> str:
    """host:port of the OTLP/gRPC collector the standard variables name, or "" when tracing is
    off or exports over HTTP (Envoy's exporter here speaks gRPC)."""
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return ""
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", env.get("OTEL_EXPORTER_OTLP_PROTOCOL"))
    if protocol and protocol != "grpc":
        return ""
    url = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not url:
        return ""
    return urlsplit(url if "://" in url else f"http://{url}").netloc


def read_api_keys(path: Path) -> tuple[str, ...]:
    """API keys from a file: one per line; blank lines and lines starting with # are skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise InvalidRequest(f"cannot read the API key file {path}: {e}") from e
    return tuple(s for line in lines if (s := line.strip()) and not s.startswith("#"))
