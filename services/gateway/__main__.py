"""`python -m services.gateway`: run the gateway (gRPC and OpenAI-compatible HTTP APIs), routing
to the workers it finds in the mesh's etcd."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import socket
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from services.common import clock, mesh_tls, telemetry
from services.common.discovery import EtcdDiscovery
from services.common.errors import InvalidRequest
from services.common.etcd_client import EtcdConfig, add_etcd_args, etcd_config
from services.common.gen.distserve.v1 import gateway_pb2, gateway_pb2_grpc
from services.common.generation_defaults import GenerationDefaults
from services.common.hub import refuse_at_start, resolve_model
from services.common.metrics import add_metrics_args, worker_registry
from services.common.metrics import serve as serve_metrics
from services.common.model_config import ModelConfig
from services.common.sampling import MAX_N
from services.common.server import (
    add_health_port_args,
    announce_ready,
    plaintext_health,
    run,
    setup_logging,
    start_server,
    wait_for_signal,
)
from services.common.slo import Slo
from services.common.tokenizer import Tokenizer
from services.gateway.admission import Admission, AdmissionConfig
from services.gateway.chat_template import ChatTemplate
from services.gateway.conditional import LocalPrefill
from services.gateway.http_api import HttpApi, HttpApiConfig
from services.gateway.membership import Membership
from services.gateway.metrics import GatewayMetrics
from services.gateway.planner_feed import PlannerFeed
from services.gateway.registry import Registry
from services.gateway.request import Limits
from services.gateway.router import Router
from services.gateway.routing import POLICIES, Routing
from services.gateway.servicer import GatewayServicer, RegistryServicer
from services.gateway.tool_parsers import PARSERS, tool_parser

log = logging.getLogger("distserve.gateway")


@dataclass(frozen=True)
class GatewayConfig:
    model: Path  # the model folder: tokenizer and limits (the gateway never loads weights)
    model_id: str | None = None  # the Hub id `model` was resolved from; None: a local folder
    revision: str | None = None  # with a Hub id: its branch, tag or commit
    host: str = "127.0.0.1"
    port: int = 50051
    # the mesh's etcd: its workers (discovery.py)
    etcd: EtcdConfig = field(default_factory=lambda: EtcdConfig(("http://127.0.0.1:2379",)))
    # A worker whose load feed is silent this long is not routed to (a dead one sooner: its
    # feed breaks, and etcd drops it when its lease lapses); long enough for a starved host.
    worker_lease_s: float = 6.0
    max_tokens: int | None = None  # largest max_tokens accepted; default: the model's context
    max_n: int = MAX_N  # most choices (n, best_of) a request may ask for
    http_port: int | None = 8000  # the OpenAI-compatible HTTP API; 0: any free port; None: off
    served_model_name: str | None = None  # name in the HTTP API; default: Hub id, else folder
    chat_template: Path | None = None  # a template file replacing the model folder's
    generation_config: bool = True  # apply generation_config.json's sampling defaults (auto)
    tool_call_parser: str | None = None  # reads tool calls from answers (tool_parsers.PARSERS)
    max_body_bytes: int = 8 * 2**20  # largest HTTP request body
    metrics_port: int = 0  # Prometheus /metrics; 0: any free port, -1: off
    health_port: int | None = None  # plaintext grpc.health.v1 alone (probes); None: off
    slo: Slo = field(default_factory=Slo)  # the SLOs whose attainment the metrics report
    planner: str | None = None  # host:port of each planner replica (commas): the live workload
    layerwise_handoff: bool = True  # decode pulls the KV while prefill computes it
    layerwise_min_tokens: int = 256  # ... for prompts of at least this many tokens
    profile: Path | None = None  # latency profile: derives the local-prefill threshold
    local_prefill_max_tokens: int | None = None  # explicit threshold (0: never local)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)  # 429 rules
    routing: str = "prefix"  # prefix: cached prefix and load; load; round-robin (routing.py)
    time_scale: float = 1.0  # an emulated mesh's clock (services/common/clock.py)
    time_epoch: float | None = None


def parse(argv: list[str] | None = None) -> GatewayConfig:
    p = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__)
    p.add_argument(
        "--model",
        required=True,
        help="model folder, or Hugging Face Hub id (org/name) fetched into the HF cache "
        "(tokenizer, chat template, limits: the gateway loads no weights)",
    )
    p.add_argument("--revision", help="with a Hub id: branch, tag or commit (default: main)")
    p.add_argument(
        "--chat-template",
        type=Path,
        metavar="FILE",
        help="a Jinja chat template replacing the model folder's (chat_template.jinja, else "
        "tokenizer_config.json's); a model with neither refuses chat without it",
    )
    p.add_argument(
        "--generation-config",
        choices=("auto", "vllm"),
        default="auto",
        help="auto: generation_config.json's temperature, top_p, top_k and max_new_tokens are "
        "the defaults of requests that omit them; vllm: ignore the file (the API's defaults)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=sorted(PARSERS),
        help="the model's tool-call format (hermes: Hermes/Qwen <tool_call> tags; llama3_json: "
        "Llama 3 JSON): requests with tools and tool_choice auto get tool_calls read from the "
        "answer; without it, such requests are refused (vLLM's flag; its "
        "--enable-auto-tool-choice is implied)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    add_etcd_args(
        p.add_argument_group("etcd"),
        "workers are found there (default: etcd's own default address)",
        default="http://127.0.0.1:2379",
    )
    p.add_argument(
        "--worker-lease-s",
        type=float,
        default=6.0,
        help="a worker whose load reports stop this long is not routed to",
    )
    p.add_argument("--max-tokens", type=int, help="largest max_tokens a request may ask")
    p.add_argument(
        "--max-n",
        type=_max_n,
        default=MAX_N,
        help=f"most choices (n, and best_of) a request may ask for, 1..{MAX_N}; each choice "
        "takes a decode seat and its own KV beyond the shared prompt",
    )
    p.add_argument(
        "--http-port", type=int, default=8000, help="OpenAI-compatible HTTP API; 0 any free, -1 off"
    )
    p.add_argument(
        "--served-model-name", help="model name in the HTTP API (default: Hub id, else folder)"
    )
    p.add_argument("--max-body-bytes", type=int, default=8 * 2**20, help="largest HTTP body")
    add_metrics_args(p)
    add_health_port_args(p)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="TTFT SLO (metrics)")
    p.add_argument("--slo-tpot-ms", type=float, default=100.0, help="TPOT SLO (metrics)")
    p.add_argument("--slo-window-s", type=float, default=60.0, help="SLO attainment window")
    p.add_argument(
        "--planner",
        help="planner host:port, or several replicas' comma-separated: report the live workload "
        "to each",
    )
    p.add_argument(
        "--kv-handoff",
        choices=("layerwise", "after-prefill"),
        default="layerwise",
        help="layerwise: decode pulls each layer as prefill computes it",
    )
    p.add_argument(
        "--layerwise-min-tokens",
        type=int,
        default=256,
        help="shorter prompts hand their KV off after prefill: their pull takes a few ms, and "
        "pulling beside prefill only slows their first token (0: every prompt)",
    )
    p.add_argument(
        "--profile",
        type=Path,
        help="latency profile (distserve profile): short prompts whose prefill fits the TPOT "
        "SLO's slack are prefilled on a decode instance (conditional disaggregation)",
    )
    p.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        help="prefill prompts up to this many tokens on a decode instance (overrides --profile)",
    )
    p.add_argument(
        "--max-inflight", type=int, default=1024, help="requests in the gateway at once (429 past)"
    )
    p.add_argument(
        "--admission-ttft-factor",
        type=float,
        default=1.0,
        help="refuse (429) a request predicted to miss this many times the TTFT SLO; 0: off",
    )
    p.add_argument(
        "--decode-tpot-watermark",
        type=float,
        default=1.0,
        help="a decode instance whose recent steps take this many times the TPOT SLO takes no "
        "new prompts (they wait); 0: off",
    )
    p.add_argument(
        "--decode-pull-watermark",
        type=int,
        default=16,
        help="pending KV pulls per decode instance past which new prompts wait",
    )
    p.add_argument(
        "--decode-kv-watermark",
        type=float,
        default=0.95,
        help="share of a decode instance's KV in use past which new prompts wait",
    )
    p.add_argument(
        "--routing",
        choices=POLICIES,
        default="prefix",
        help="how a worker is chosen: prefix (the prompt's prefix cached there, and its load), "
        "load (least loaded), round-robin",
    )
    clock.add_args(p)
    a = p.parse_args(argv)
    try:
        etcd = etcd_config(a)
    except InvalidRequest as e:
        p.error(str(e))
    if a.max_body_bytes < 1:
        p.error("--max-body-bytes must be >= 1")
    if a.layerwise_min_tokens < 0:
        p.error("--layerwise-min-tokens must be >= 0")
    if min(a.slo_ttft_ms, a.slo_tpot_ms, a.slo_window_s) <= 0:
        p.error("SLOs and their window must be positive")
    return GatewayConfig(
        model=Path(a.model),
        revision=a.revision,
        chat_template=a.chat_template,
        generation_config=a.generation_config == "auto",
        tool_call_parser=a.tool_call_parser,
        host=a.host,
        port=a.port,
        etcd=etcd,
        worker_lease_s=a.worker_lease_s,
        max_tokens=a.max_tokens,
        max_n=a.max_n,
        http_port=None if a.http_port < 0 else a.http_port,
        served_model_name=a.served_model_name,
        max_body_bytes=a.max_body_bytes,
        metrics_port=a.metrics_port,
        health_port=a.health_port,
        slo=Slo(a.slo_ttft_ms / 1000, a.slo_tpot_ms / 1000, a.slo_window_s),
        planner=a.planner,
        layerwise_handoff=a.kv_handoff == "layerwise",
        layerwise_min_tokens=a.layerwise_min_tokens,
        profile=a.profile,
        local_prefill_max_tokens=a.local_prefill_max_tokens,
        admission=_admission_config(p, a),
        routing=a.routing,
        time_scale=a.time_scale,
        time_epoch=a.time_epoch,
    )


def _max_n(text: str) -> int:
    n = int(text)
    if not 1 <= n <= MAX_N:
        raise argparse.ArgumentTypeError(f"must be in [1, {MAX_N}], got {n}")
    return n


def _admission_config(p: argparse.ArgumentParser, a: argparse.Namespace) -> AdmissionConfig:
    try:
        return AdmissionConfig(
            max_inflight=a.max_inflight,
            ttft_factor=a.admission_ttft_factor,
            pull_watermark=a.decode_pull_watermark,
            kv_watermark=a.decode_kv_watermark,
            tpot_watermark=a.decode_tpot_watermark,
        )
    except ValueError as e:
        p.error(str(e))


async def serve(config: GatewayConfig) -> None:
    probe = plaintext_health(config.host, config.health_port)  # NOT_SERVING until listening
    model = ModelConfig.from_dir(config.model)
    engine = "emulated" if model.emulated else "torch"
    telemetry.setup("gateway", engine=engine)
    tokenizer = Tokenizer.from_dir(config.model)
    chat = ChatTemplate.from_file(tokenizer, config.chat_template, model=str(config.model))
    parser = None if config.tool_call_parser is None else tool_parser(config.tool_call_parser)
    defaults = GenerationDefaults.from_dir(config.model) if config.generation_config else None
    defaults = defaults or GenerationDefaults()
    registry = Registry(config.worker_lease_s)
    served = config.served_model_name or config.model_id or config.model.resolve().name
    if model.emulated and "emulated" not in served:
        served += "-emulated"  # an emulated model is never mistaken for a real one
    local = _local_prefill(config, model)
    if local is not None:
        log.info("local prefill: prompts <= %d tokens (%s)", local.max_tokens, local.rule)
    routing = Routing(registry, config.routing, local)
    metrics = GatewayMetrics(worker_registry(), config.slo)
    metrics.watch(routing)
    feed = PlannerFeed(config.planner, metrics.registry) if config.planner else None
    admission = Admission(
        registry,
        config.slo.ttft_s,
        config.admission,
        on_refuse=lambda reason: metrics.refusals.labels(reason).inc(),
        tpot_slo_s=config.slo.tpot_s,
    )
    metrics.watch_admission(admission)
    layerwise_min = config.layerwise_min_tokens if config.layerwise_handoff else None
    router = Router(routing, tokenizer, served, metrics, feed, layerwise_min, admission)
    membership = Membership(registry, EtcdDiscovery(config.etcd), router.channel)
    limits = Limits.for_model(
        model,
        config.max_tokens,
        registry.max_model_len,
        default_max_tokens=defaults.max_tokens,
        max_n=config.max_n,
    )

    def add(server) -> None:
        gateway_pb2_grpc.add_GatewayServicer_to_server(
            GatewayServicer(router, tokenizer, limits, defaults, chat, parser), server
        )
        gateway_pb2_grpc.add_WorkerRegistryServicer_to_server(RegistryServicer(registry), server)

    names = [
        gateway_pb2.DESCRIPTOR.services_by_name[n].full_name for n in ("Gateway", "WorkerRegistry")
    ]
    server, health, port = await start_server(config.host, config.port, add, names, probe)
    ready = {
        "address": f"{config.host}:{port}",
        "metrics_address": serve_metrics(metrics.registry, config.host, config.metrics_port),
    }
    if probe is not None:
        ready["health_address"] = probe.address
    http = None
    if config.http_port is not None:
        api = HttpApi(
            HttpApiConfig(
                model_names=(served,),
                max_body_bytes=config.max_body_bytes,
                engine=engine,
                generation=defaults,
                serve_metrics=config.metrics_port >= 0,
                tool_call_parser=config.tool_call_parser,
            ),
            router,
            routing,
            tokenizer,
            limits,
            chat,
        )
        # handler_cancellation: a client that disconnects cancels its request downstream.
        http = web.AppRunner(api.app(), handler_cancellation=True, access_log=None)
        await http.setup()
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        sock = socket.create_server((config.host, config.http_port), family=family)  # 0: free
        tls = mesh_tls.mesh_tls()
        context = tls.server_ssl_context() if tls else None
        await web.SockSite(http, sock, ssl_context=context).start()
        ready["http_address"] = f"{config.host}:{sock.getsockname()[1]}"
    if feed is not None:
        feed.start()
    membership.start()
    announce_ready("gateway", **ready)
    await wait_for_signal()
    await health.enter_graceful_shutdown()
    if http is not None:
        await http.cleanup()
    await server.stop(grace=5)
    await membership.stop()
    if feed is not None:
        await feed.stop()
    await router.close()
    if probe is not None:
        probe.stop()
    telemetry.shutdown()


def _local_prefill(config: GatewayConfig, model: ModelConfig) -> LocalPrefill | None:
    if config.local_prefill_max_tokens is not None:
        n = config.local_prefill_max_tokens
        return LocalPrefill(n, "--local-prefill-max-tokens") if n > 0 else None
    if config.profile is None:
        return None
    return LocalPrefill.from_profile(
        config.profile, config.slo.tpot_s * 1000, max_context=model.max_position_embeddings
    )


def resolved(config: GatewayConfig) -> GatewayConfig:
    """`config` with its model a local folder: a Hub id found in the cache or fetched (here, not
    in `parse`, which only reads the command line: `distserve up` checks options with it)."""
    given = str(config.model)
    folder = resolve_model(given, config.revision)
    model_id = None if folder == Path(given).expanduser() else given
    return dataclasses.replace(config, model=folder, model_id=model_id)


def main(argv: list[str] | None = None) -> None:
    setup_logging()
    with refuse_at_start("gateway"):
        config = resolved(parse(argv))
        clock.setup(config.time_scale, config.time_epoch)
        run(serve(config))


if __name__ == "__main__":
    main()
