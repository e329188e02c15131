"""Envoy's bootstrap configuration, generated from the edge config and the gateways.

One listener carries HTTP/1.1 and HTTP/2 (cleartext h2c, or ALPN with TLS). Requests with
content-type application/grpc go to the gateways' gRPC ports over HTTP/2; everything else to
their HTTP API (HTTP/1.1). Both clusters are health-checked (gRPC health / GET /health) and have
outlier detection. Filters, in order: API keys (when set), the local rate limit, the body-size
limit, the router. Envoy's own error replies (401, 413, 429, 503...) are rewritten to OpenAI's
error shape for HTTP clients; gRPC clients get them as gRPC statuses. The admin interface
listens on 127.0.0.1 only; with a stats port, a second plaintext listener serves Envoy's
statistics for Prometheus from it (GET only, nothing else of the admin interface).

The result is a plain dict (JSON is valid Envoy YAML), written to a file Envoy reads.

Why one file (~600 lines): one Envoy bootstrap; its listeners, filters and clusters refer to
each other by name and are checked together by `envoy --mode validate`.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.mesh_tls import SERVER_NAME as MESH_SERVER_NAME
from services.edge.config import EdgeConfig, Upstream

GATEWAY_SERVICE = "distserve.v1.Gateway"  # the gRPC health service Envoy checks
GRPC_CLUSTER, HTTP_CLUSTER, OTLP_CLUSTER = "gateway_grpc", "gateway_http", "otlp"
ADMIN_CLUSTER = "admin"  # Envoy's own admin interface, for the stats listener
STATS_PATHS = ("/metrics", "/stats/prometheus")  # what the stats listener serves
MAX_CONNECTIONS = 10000  # downstream connections Envoy accepts at once
RBAC, RATE_LIMIT = "envoy.filters.http.rbac", "envoy.filters.http.local_ratelimit"
T = "type.googleapis.com/envoy."  # the common prefix of every typed config's @type

ACCESS_LOG_FORMAT = {
    "time": "%START_TIME%",
    "request_id": "%REQ(X-REQUEST-ID)%",
    "client": "%DOWNSTREAM_REMOTE_ADDRESS%",
    "protocol": "%PROTOCOL%",
    "method": "%REQ(:METHOD)%",
    "path": "%REQ(:PATH)%",
    "status": "%RESPONSE_CODE%",
    "grpc_status": "%GRPC_STATUS%",
    "flags": "%RESPONSE_FLAGS%",
    "details": "%RESPONSE_CODE_DETAILS%",
    "bytes_in": "%BYTES_RECEIVED%",
    "bytes_out": "%BYTES_SENT%",
    "first_byte_ms": "%RESPONSE_DURATION%",
    "duration_ms": "%DURATION%",
    "upstream": "%UPSTREAM_HOST%",
    "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
    "user_agent": "%REQ(USER-AGENT)%",
}


def _duration(seconds: float) -> str:
    return f"{seconds:g}s"


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _typed(kind: str, **fields) -> dict:
    return {"@type": T + kind, **fields}


def _local_replies(config: EdgeConfig) -> dict:
    """OpenAI-shaped JSON bodies for Envoy's own replies to HTTP requests (gRPC requests get
    them as gRPC statuses). The first mapper that matches applies."""
    rps = config.rate_limit_rps
    replies = [
        (413, f"the request body is larger than {config.max_request_bytes} bytes",
         "invalid_request_error", "request_too_large"),
        (429, f"rate limit reached ({rps} requests per second, bursts of "
         f"{config.rate_limit_burst}); retry later", "rate_limit_error", "rate_limit_exceeded"),
        (503, "%LOCAL_REPLY_BODY%", "service_unavailable_error", "service_unavailable"),
        (504, "%LOCAL_REPLY_BODY%", "timeout_error", "timeout"),
    ]  # fmt: skip
    not_grpc = {
        "header_filter": {
            "header": {
                "name": "content-type",
                "string_match": {"prefix": "application/grpc"},
                "invert_match": True,
                "treat_missing_header_as_empty": True,
            }
        }
    }
    mappers = []
    if config.api_keys:
        # A local 403 can only be RBAC's (a missing or unknown key): it becomes a 401, as
        # OpenAI answers; gRPC clients then see UNAUTHENTICATED.
        error = _error(
            "a valid API key is required: send the header 'Authorization: Bearer KEY'",
            "authentication_error",
            "invalid_api_key",
        )
        challenge = [{"header": {"key": "www-authenticate", "value": "Bearer"}}]
        mappers.append(
            {
                "filter": {"and_filter": {"filters": [_status_is(403), not_grpc]}},
                "status_code": 401,
                "headers_to_add": challenge,
                "body_format_override": error,
            }
        )
        mappers.append({"filter": _status_is(403), "status_code": 401})
    for status, message, kind, code in replies:
        mappers.append(
            {
                "filter": {"and_filter": {"filters": [_status_is(status), not_grpc]}},
                "body_format_override": _error(message, kind, code),
            }
        )
    return {"mappers": mappers}


def _error(message: str, kind: str, code: str) -> dict:
    error = {"message": message, "type": kind, "param": None, "code": code}
    return {"json_format": {"error": error}, "content_type": "application/json"}


def _status_is(status: int) -> dict:
    return {
        "status_code_filter": {
            "comparison": {
                "op": "EQ",
                "value": {"default_value": status, "runtime_key": f"edge.reply_{status}"},
            }
        }
    }


def _filters(config: EdgeConfig) -> list[dict]:
    filters = []
    if config.api_keys:
        # RBAC (a stable filter) allows a request only with a known key; its 403 becomes a 401
        # in _local_replies, as OpenAI answers a missing or wrong key.
        keys = [
            {"header": {"name": "authorization", "string_match": {"exact": f"Bearer {key}"}}}
            for key in config.api_keys
        ]
        filters.append(
            {
                "name": RBAC,
                "typed_config": _typed(
                    "extensions.filters.http.rbac.v3.RBAC",
                    rules={
                        "action": "ALLOW",
                        "policies": {
                            "api-keys": {"permissions": [{"any": True}], "principals": keys}
                        },
                    },
                ),
            }
        )
    if config.rate_limit_rps:
        filters.append(
            {
                "name": RATE_LIMIT,
                "typed_config": _typed(
                    "extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
                    stat_prefix="edge_rate_limit",
                    token_bucket={
                        "max_tokens": config.rate_limit_burst,
                        "tokens_per_fill": config.rate_limit_rps,
                        "fill_interval": "1s",
                    },
                    filter_enabled=_percent(100, "edge.rate_limit_enabled"),
                    filter_enforced=_percent(100, "edge.rate_limit_enforced"),
                    response_headers_to_add=[
                        {
                            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                            "header": {"key": "retry-after", "value": "1"},
                        }
                    ],
                    rate_limited_as_resource_exhausted=True,  # gRPC: RESOURCE_EXHAUSTED
                ),
            }
        )
    filters.append(
        {
            "name": "envoy.filters.http.buffer",
            "typed_config": _typed(
                "extensions.filters.http.buffer.v3.Buffer",
                max_request_bytes=config.max_request_bytes,
            ),
        }
    )
    filters.append(
        {
            "name": "envoy.filters.http.router",
            "typed_config": _typed("extensions.filters.http.router.v3.Router"),
        }
    )
    return filters


def _percent(value: int, key: str) -> dict:
    return {"default_value": {"numerator": value, "denominator": "HUNDRED"}, "runtime_key": key}


def _retry_policy(config: EdgeConfig, grpc: bool) -> dict:
    # Only failures before the upstream's response headers are retried: Envoy cannot retry once
    # it has forwarded a byte of the answer, and the gateway sends its headers with the first
    # token. So no request is ever answered twice. `reset`, not `reset-before-request`: a
    # gateway that died after it accepted a request but before its first token (waiting for
    # admission or prefill) has sent nothing, and that request must go to another gateway
    # (tests/test_gateway_death.py).
    retry_on = ["connect-failure", "refused-stream", "reset"]
    retry_on += ["unavailable"] if grpc else ["retriable-status-codes"]
    policy = {
        "retry_on": ",".join(retry_on),
        "num_retries": config.retries,
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": _typed(
                    "extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                ),
            }
        ],
        "host_selection_retry_max_attempts": 3,
    }
    if not grpc:
        policy["retriable_status_codes"] = [503]
    return policy


def _routes(config: EdgeConfig) -> list[dict]:
    idle = _duration(config.stream_idle_timeout_s)
    on = [RBAC] * bool(config.api_keys) + [RATE_LIMIT] * bool(config.rate_limit_rps)
    no_keys_no_limit = {name: _typed("config.route.v3.FilterConfig", disabled=True) for name in on}
    health = {
        "match": {"path": "/health"},
        "route": {"cluster": HTTP_CLUSTER, "timeout": "10s"},
    }
    if no_keys_no_limit:
        health["typed_per_filter_config"] = no_keys_no_limit
    # The gateway's Prometheus metrics are routed like any HTTP path (a key when keys are on),
    # unless public_metrics lets a scraper in without one.
    public_metrics = []
    if config.api_keys and config.public_metrics:
        no_keys = {RBAC: _typed("config.route.v3.FilterConfig", disabled=True)}
        public_metrics.append(
            {
                "name": "metrics",
                "match": {"path": "/metrics"},
                "route": {"cluster": HTTP_CLUSTER, "timeout": "10s"},
                "typed_per_filter_config": no_keys,
            }
        )
    return [
        {
            "name": "grpc",
            "match": {"prefix": "/", "grpc": {}},
            "route": {
                "cluster": GRPC_CLUSTER,
                "timeout": "0s",  # a stream lasts as long as it produces tokens
                "idle_timeout": idle,
                "max_stream_duration": {"grpc_timeout_header_max": "0s"},  # honour grpc-timeout
                "retry_policy": _retry_policy(config, grpc=True),
            },
            "request_headers_to_remove": ["authorization"],  # keys stop at the edge
        },
        {"name": "health", **health},
        *public_metrics,
        {
            "name": "http",
            "match": {"prefix": "/"},
            "route": {
                "cluster": HTTP_CLUSTER,
                "timeout": "0s",
                "idle_timeout": idle,
                "retry_policy": _retry_policy(config, grpc=False),
            },
            "request_headers_to_remove": ["authorization"],
        },
    ]


def _cluster(
    name: str, gateways: Sequence[Upstream], grpc: bool, tls: tuple[str, str, str] | None = None
) -> dict:
    endpoints = []
    for g in gateways:
        host, port = _host_port(g.grpc if grpc else g.http)
        endpoints.append(
            {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
        )
    all_ips = all(_is_ip(_host_port(g.grpc if grpc else g.http)[0]) for g in gateways)
    protocol = (
        {"http2_protocol_options": {"connection_keepalive": {"interval": "30s", "timeout": "10s"}}}
        if grpc
        else {"http_protocol_options": {}}
    )
    check = (
        {"grpc_health_check": {"service_name": GATEWAY_SERVICE}}
        if grpc
        else {"http_health_check": {"path": "/health"}}
    )
    secure = {"transport_socket": _upstream_tls(tls, grpc)} if tls else {}
    return {
        "name": name,
        **secure,
        "type": "STATIC" if all_ips else "STRICT_DNS",
        "connect_timeout": "2s",
        "lb_policy": "LEAST_REQUEST",  # long streams: balance on requests in flight
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _typed(
                "extensions.upstreams.http.v3.HttpProtocolOptions",
                explicit_http_config=protocol,
                common_http_protocol_options={"idle_timeout": "300s"},
            )
        },
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": endpoints}]},
        "health_checks": [
            {
                "timeout": "2s",
                "interval": "2s",
                "no_traffic_interval": "5s",
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                **check,
            }
        ],
        "outlier_detection": {
            "consecutive_5xx": 5,
            "consecutive_gateway_failure": 3,
            "interval": "5s",
            "base_ejection_time": "10s",
            "max_ejection_percent": 100,
        },
        "circuit_breakers": {
            "thresholds": [
                {
                    "max_connections": 10000,
                    "max_pending_requests": 10000,
                    "max_requests": 10000,
                    "max_retries": 16,
                }
            ]
        },
    }


def _tracing(config: EdgeConfig) -> dict:
    """Envoy's span of each request, exported over OTLP; it continues a client's W3C trace
    context and passes its own (`traceparent`) to the gateway, so the request is one trace."""
    return {
        "random_sampling": {"value": config.trace_sampling_percent},
        "provider": {
            "name": "envoy.tracers.opentelemetry",
            "typed_config": _typed(
                "config.trace.v3.OpenTelemetryConfig",
                grpc_service={"envoy_grpc": {"cluster_name": OTLP_CLUSTER}, "timeout": "1s"},
                service_name="envoy",
            ),
        },
    }


def _upstream_tls(paths: tuple[str, str, str], grpc: bool) -> dict:
    """Mesh TLS toward the gateway: Envoy presents the mesh certificate and checks the
    gateway's against the mesh CA and its name (services.common.mesh_tls.SERVER_NAME)."""
    cert, key, ca = paths
    context = {
        "tls_certificates": [
            {"certificate_chain": {"filename": cert}, "private_key": {"filename": key}}
        ],
        "validation_context": {
            "trusted_ca": {"filename": ca},
            "match_typed_subject_alt_names": [
                {"san_type": "DNS", "matcher": {"exact": MESH_SERVER_NAME}}
            ],
        },
    }
    if grpc:
        context["alpn_protocols"] = ["h2"]
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": _typed(
            "extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            sni=MESH_SERVER_NAME,
            common_tls_context=context,
        ),
    }


def _otlp_cluster(endpoint: str) -> dict:
    host, port = _host_port(endpoint)
    return {
        "name": OTLP_CLUSTER,
        "type": "STATIC" if _is_ip(host) else "STRICT_DNS",
        "connect_timeout": "2s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _typed(
                "extensions.upstreams.http.v3.HttpProtocolOptions",
                explicit_http_config={"http2_protocol_options": {}},
            )
        },
        "load_assignment": {
            "cluster_name": OTLP_CLUSTER,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {"socket_address": {"address": host, "port_value": port}}
                            }
                        }
                    ]
                }
            ],
        },
    }


def _is_ip(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _tls(config: EdgeConfig) -> dict:
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": _typed(
            "extensions.transport_sockets.tls.v3.DownstreamTlsContext",
            common_tls_context={
                "tls_certificates": [
                    {
                        "certificate_chain": {"filename": str(config.tls_cert)},
                        "private_key": {"filename": str(config.tls_key)},
                    }
                ],
                "alpn_protocols": ["h2", "http/1.1"],
                "tls_params": {"tls_minimum_protocol_version": "TLSv1_2"},
            },
        ),
    }


def _access_log(config: EdgeConfig) -> list[dict]:
    if not config.access_log:
        return []
    fmt = {"json_format": ACCESS_LOG_FORMAT}
    if config.access_log == "-":
        return [
            {
                "name": "envoy.access_loggers.stdout",
                "typed_config": _typed(
                    "extensions.access_loggers.stream.v3.StdoutAccessLog", log_format=fmt
                ),
            }
        ]
    return [
        {
            "name": "envoy.access_loggers.file",
            "typed_config": _typed(
                "extensions.access_loggers.file.v3.FileAccessLog",
                path=config.access_log,
                log_format=fmt,
            ),
        }
    ]


def _stats_listener(config: EdgeConfig) -> dict:
    """Envoy's statistics for Prometheus on their own plaintext port: GET of STATS_PATHS goes
    to the admin interface's /stats/prometheus; anything else (the admin's mutating endpoints,
    its config dump, another method) gets 404 and never reaches it."""
    get = [{"name": ":method", "string_match": {"exact": "GET"}}]
    routes = [
        {
            "match": {"path": path, "headers": get},
            "route": {
                "cluster": ADMIN_CLUSTER,
                "prefix_rewrite": "/stats/prometheus",
                "timeout": "10s",
            },
        }
        for path in STATS_PATHS
    ]
    manager = _typed(
        "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        stat_prefix="stats",
        codec_type="HTTP1",
        request_headers_timeout="10s",
        route_config={
            "name": "stats",
            "virtual_hosts": [{"name": "stats", "domains": ["*"], "routes": routes}],
        },
        http_filters=[
            {
                "name": "envoy.filters.http.router",
                "typed_config": _typed("extensions.filters.http.router.v3.Router"),
            }
        ],
    )
    return {
        "name": "stats",
        "address": {"socket_address": {"address": config.host, "port_value": config.stats_port}},
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": manager,
                    }
                ]
            }
        ],
    }


def _admin_cluster(config: EdgeConfig) -> dict:
    address = {"socket_address": {"address": "127.0.0.1", "port_value": config.admin_port}}
    return {
        "name": ADMIN_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": ADMIN_CLUSTER,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}],
        },
    }


def envoy_config(config: EdgeConfig, gateways: Sequence[Upstream]) -> dict:
    """The bootstrap for `envoy -c`: the edge listener in front of `gateways`."""
    if not gateways:
        raise ValueError("the edge needs at least one gateway")
    manager = _typed(
        "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        stat_prefix="edge",
        codec_type="AUTO",  # HTTP/1.1 and HTTP/2 (prior knowledge, or ALPN under TLS)
        use_remote_address=True,
        preserve_external_request_id=True,  # a client's x-request-id names its request
        stream_idle_timeout=_duration(config.stream_idle_timeout_s),
        request_timeout=_duration(config.request_timeout_s),
        request_headers_timeout="10s",
        common_http_protocol_options={"idle_timeout": "300s"},
        http2_protocol_options={"max_concurrent_streams": 1024},
        access_log=_access_log(config),
        local_reply_config=_local_replies(config),
        route_config={
            "name": "edge",
            "virtual_hosts": [{"name": "mesh", "domains": ["*"], "routes": _routes(config)}],
        },
        http_filters=_filters(config),
    )
    clusters = [
        _cluster(GRPC_CLUSTER, gateways, grpc=True, tls=config.upstream_tls),
        _cluster(HTTP_CLUSTER, gateways, grpc=False, tls=config.upstream_tls),
    ]
    if config.otlp_endpoint:
        manager["tracing"] = _tracing(config)
        clusters.append(_otlp_cluster(config.otlp_endpoint))
    chain: dict = {
        "filters": [
            {"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}
        ]
    }
    if config.tls:
        chain["transport_socket"] = _tls(config)
    listeners = [
        {
            "name": "edge",
            "address": {"socket_address": {"address": config.host, "port_value": config.port}},
            "filter_chains": [chain],
        }
    ]
    if config.stats_port is not None:
        listeners.append(_stats_listener(config))
        clusters.append(_admin_cluster(config))
    return {
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": config.admin_port}}
        },
        "static_resources": {"listeners": listeners, "clusters": clusters},
        "layered_runtime": {"layers": [{"name": "static", "static_layer": {}}]},
        "overload_manager": {
            "resource_monitors": [
                {
                    "name": "envoy.resource_monitors.global_downstream_max_connections",
                    "typed_config": _typed(
                        "extensions.resource_monitors.downstream_connections.v3."
                        "DownstreamConnectionsConfig",
                        max_active_downstream_connections=MAX_CONNECTIONS,
                    ),
                }
            ]
        },
    }
