"""`distserve up`: starts the mesh (gateway, workers, optionally Envoy and a planner) on this
host as local processes (distserve/local_mesh.py) and keeps it until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
from pathlib import Path

from distserve.local_mesh import add_emulation_options, emulated_mesh
from distserve.role_args import add_role_args, role_args
from services.common.errors import InvalidRequest
from services.common.etcd_client import add_etcd_args, etcd_config
from services.edge.options import add_edge_options
from services.gateway.tool_parsers import PARSERS


def register(sub: argparse._SubParsersAction) -> None:
    """Add `up` to a subparsers object."""
    up = sub.add_parser("up", help="start the mesh (gateway and workers) on this host")
    up.add_argument(
        "--model",
        help="model folder, or Hugging Face Hub id (org/name) fetched once into the HF cache "
        "and served from there by every process (default: the embedded tiny model)",
    )
    up.add_argument("--revision", help="with a Hub id: branch, tag or commit (default: main)")
    up.add_argument(
        "--chat-template",
        type=Path,
        metavar="FILE",
        help="a Jinja chat template replacing the model's (a model without one refuses chat)",
    )
    up.add_argument(
        "--generation-config",
        choices=("auto", "vllm"),
        default="auto",
        help="auto: the model's generation_config.json sampling defaults apply to requests "
        "that omit them; vllm: ignore the file",
    )
    up.add_argument(
        "--tool-call-parser",
        choices=sorted(PARSERS),
        help="the model's tool-call format, for requests with tools (the gateway's flag)",
    )
    up.add_argument("--prefill", type=int, default=1, help="prefill instances")
    up.add_argument("--decode", type=int, default=1, help="decode instances")
    up.add_argument("--colocated", type=int, default=0, help="colocated instances")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=50051, help="gateway gRPC port (0: any free)")
    up.add_argument(
        "--gateway-http-port", type=int, default=0, help="gateway HTTP API port (0: any free)"
    )
    up.add_argument("--served-model-name", help="model name in the HTTP API (default: folder)")
    up.add_argument("--max-tokens", type=int, help="largest max_tokens a request may ask")
    up.add_argument("--pin", action="store_true", help="one CPU core, one thread per worker")
    up.add_argument(
        "--drain-timeout-s",
        type=float,
        default=5.0,
        help="on Ctrl-C or SIGTERM: how long workers may finish or hand off in-flight work",
    )
    add_etcd_args(
        up.add_argument_group("etcd"),
        "an existing one for the mesh's membership, given to every process (default: start "
        "one, its data in a temporary folder removed at exit; with TLS under mesh TLS)",
    )
    up.add_argument(
        "--gateways",
        type=int,
        default=1,
        help="gateway processes, each seeing every worker (through etcd), behind Envoy's "
        "least-request balancing; the first on --port, the others on free ports",
    )
    up.add_argument("--no-edge", action="store_true", help="no Envoy: the gateway only")
    up.add_argument("--planner", action="store_true", help="start a planner fed the live workload")
    up.add_argument(
        "--planners",
        type=int,
        default=1,
        help="planner processes (implies --planner): above 1 they elect one leader on the "
        "mesh's etcd, which decides and acts; the others stand by, and one takes over within "
        "the leader's lease (5 s) when it dies",
    )
    up.add_argument(
        "--budget",
        type=int,
        default=0,
        help="with --planner: devices (workers x tp) the planner may resize the mesh to; it "
        "applies its decisions (needs --slo-ttft-ms and --slo-tpot-ms, and an emulated "
        "--model-spec or a --profile of the real one)",
    )
    up.add_argument(
        "--advise", action="store_true", help="with --budget: the planner decides, never applies"
    )
    up.add_argument(
        "--tp-choices",
        default="",
        help="with --budget: TP,... tensor degrees the planner may re-shard a role to (each "
        "re-shard replaces the role's instances, new ones first); default: none",
    )
    up.add_argument("--slo-ttft-ms", type=float, help="TTFT SLO for the attainment metric")
    up.add_argument("--slo-tpot-ms", type=float, help="TPOT SLO for the attainment metric")
    for role in ("prefill", "decode", "colocated"):
        up.add_argument(
            f"--{role}-tp", type=int, default=1, help=f"tensor degree of each {role} instance"
        )
    add_edge_options(up.add_argument_group("edge (Envoy)"), port_flag="--edge-port")
    add_emulation_options(up)
    add_role_args(up)
    up.set_defaults(func=_up)


def _up(args: argparse.Namespace) -> int:
    from distserve.local_mesh import MeshSpec, run_until_signal
    from services.common.hub import resolve_model
    from services.edge.options import edge_config

    emulation = emulated_mesh(args)
    engine = ("--engine", "emulated", *emulation["emulation_args"]) if emulation else ()
    passed = role_args(args, engine)
    if args.model is None:
        from services.engine.presets import default_model

        args.model = default_model("tiny")
    # Resolved here, once: every process gets the same folder and none downloads.
    folder = resolve_model(args.model, args.revision)
    served = args.served_model_name or (
        None if folder == Path(args.model).expanduser() else str(args.model)
    )
    args.model = folder
    gateway_args = ["--max-body-bytes", str(args.max_body_bytes)]
    gateway_args += ["--generation-config", args.generation_config]
    if served:
        gateway_args += ["--served-model-name", served]
    if args.chat_template:
        gateway_args += ["--chat-template", str(args.chat_template.resolve())]
    if args.tool_call_parser:
        gateway_args += ["--tool-call-parser", args.tool_call_parser]
    if args.max_tokens:
        gateway_args += ["--max-tokens", str(args.max_tokens)]
    for flag, value in (("--slo-ttft-ms", args.slo_ttft_ms), ("--slo-tpot-ms", args.slo_tpot_ms)):
        if value is not None:
            gateway_args += [flag, str(value)]
    if args.gateways < 1:
        raise InvalidRequest("--gateways must be at least 1")
    if args.gateways > 1 and args.no_edge:
        raise InvalidRequest("--gateways N > 1 needs the edge (Envoy balances over them)")
    etcd = etcd_config(args)
    if args.planners < 1:
        raise InvalidRequest("--planners must be at least 1")
    planner_args: list[str] = []
    if args.budget:
        planner_args = _autoscale_args(args)
    elif args.tp_choices or args.advise:
        raise InvalidRequest("--tp-choices and --advise are the resizing planner's: give --budget")
    spec = MeshSpec(
        model=args.model,
        prefill=args.prefill,
        decode=args.decode,
        colocated=args.colocated,
        host=args.host,
        gateway_port=args.port,
        gateway_http_port=args.gateway_http_port,
        worker_args=passed.worker,
        prefill_args=passed.prefill,
        decode_args=passed.decode,
        colocated_args=passed.colocated,
        gateway_args=(*gateway_args, *passed.gateway),
        pin=args.pin,
        etcd=etcd,
        gateways=args.gateways,
        edge=None if args.no_edge else edge_config(args, args.host),
        planner=args.planner or args.planners > 1 or bool(args.budget),
        planners=args.planners,
        planner_args=tuple(planner_args),
        budget=args.budget,
        drain_timeout_s=args.drain_timeout_s,
        tp={"prefill": args.prefill_tp, "decode": args.decode_tp, "colocated": args.colocated_tp},
        **emulation,
    )
    return run_until_signal(spec)


def _autoscale_args(args: argparse.Namespace) -> list[str]:
    """The planner's options to resize the mesh `distserve up` starts (--budget)."""
    if args.slo_ttft_ms is None or args.slo_tpot_ms is None:
        raise InvalidRequest("--budget needs the SLO to size for: --slo-ttft-ms and --slo-tpot-ms")
    if args.model_spec:
        spec = args.model_spec
    elif args.profile:
        spec = str(args.model)
    else:
        raise InvalidRequest(
            "--budget needs the model's step times: --engine emulated --model-spec NAME, or "
            "--profile FILE (`distserve profile` of the model on this machine)"
        )
    out = ["--model-spec", spec, "--slo", f"{args.slo_ttft_ms:g},{args.slo_tpot_ms:g}"]
    if args.profile:
        out += ["--profile", str(args.profile)]
    if args.tp_choices:
        out += ["--tp-choices", args.tp_choices]
    return out + (["--advise"] if args.advise else [])
