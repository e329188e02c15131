"""`distserve`: the command line of the mesh.

Subcommands import what they need when they run, so that `distserve --help` is instant and
commands that do not run the model never load torch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from distserve.deploy.cli import register as register_deploy
from distserve.loadgen.cli import register as register_bench
from distserve.local_mesh import add_emulation_options, emulated_mesh
from distserve.plan import register as register_planner
from distserve.trace_report import register as register_trace_report
from services.common import mesh_tls
from services.common.errors import DistServeError, InvalidRequest
from services.edge.options import add_edge_options


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="create embedded models").add_subparsers(
        dest="model_command", required=True
    )
    create = model.add_parser("create", help="write a Hugging Face-format model folder")
    create.add_argument("--preset", choices=("tiny", "small"), default="tiny")
    create.add_argument("--out", required=True, type=Path)
    create.add_argument("--seed", type=int, default=0)
    create.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    create.add_argument(
        "--architecture",
        choices=("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"),
        default="LlamaForCausalLM",
    )
    create.add_argument(
        "--emulated",
        metavar="SPEC",
        help="an emulated model's folder instead (no weights): the shape of SPEC (opt-13b, "
        "opt-66b, opt-175b or a model folder), served only by --engine emulated",
    )
    create.set_defaults(func=_model_create)

    gen = sub.add_parser("generate", help="run the engine in-process on one prompt")
    _add_engine_args(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object at the end")
    gen.add_argument("prompt")
    gen.set_defaults(func=_generate)

    chat = sub.add_parser("chat", help="interactive: one prompt per line, streamed answers")
    _add_engine_args(chat)
    chat.set_defaults(func=_chat)

    up = sub.add_parser("up", help="start the mesh (gateway and workers) on this host")
    up.add_argument("--model", type=Path, help="model folder (default: the embedded tiny model)")
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
    up.add_argument("--no-edge", action="store_true", help="no Envoy: the gateway only")
    up.add_argument("--planner", action="store_true", help="start a planner fed the live workload")
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
    up.add_argument("--slo-ttft-ms", type=float, help="TTFT SLO for the attainment metric")
    up.add_argument("--slo-tpot-ms", type=float, help="TPOT SLO for the attainment metric")
    for role in ("prefill", "decode", "colocated"):
        up.add_argument(
            f"--{role}-tp", type=int, default=1, help=f"tensor degree of each {role} instance"
        )
    add_edge_options(up.add_argument_group("edge (Envoy)"), port_flag="--edge-port")
    add_emulation_options(up)
    up.set_defaults(func=_up)

    client = sub.add_parser("client", help="send one request to the gateway and stream it")
    client.add_argument(
        "--address", default="127.0.0.1:8080", help="the edge (or a gateway's gRPC) host:port"
    )
    client.add_argument("--api-key", help="sent as 'authorization: Bearer KEY'")
    client.add_argument("--ca-cert", type=Path, help="use TLS, trusting this PEM certificate")
    client.add_argument("--max-tokens", type=int, default=32)
    client.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    client.add_argument("--top-p", type=float, default=1.0)
    client.add_argument("--top-k", type=int, default=0)
    client.add_argument("--seed", type=int)
    client.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    client.add_argument("--ignore-eos", action="store_true")
    client.add_argument("--timeout", type=float, default=120.0, help="seconds")
    client.add_argument("--json", action="store_true", help="print one JSON object at the end")
    client.add_argument("prompt")
    client.set_defaults(func=_client)

    register_trace_report(sub)
    register_planner(sub)
    register_bench(sub)
    register_deploy(sub)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except DistServeError as e:
        print(f"distserve: error: {e}", file=sys.stderr)
        return 2


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, help="model folder (default: the embedded tiny model)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")


def _model_create(args: argparse.Namespace) -> int:
    from services.engine.presets import create_emulated, create_model

    if args.emulated:
        from services.common.model_spec import model_spec

        print(create_emulated(model_spec(args.emulated), args.out))
        return 0
    out = create_model(
        args.preset, args.out, seed=args.seed, architecture=args.architecture, dtype=args.dtype
    )
    print(out)
    return 0


def _engine(args: argparse.Namespace):
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine
    from services.engine.presets import default_model

    model_dir = args.model or default_model("tiny")
    return LLMEngine(model_dir, EngineConfig(device=args.device, dtype=args.dtype))


def _params(args: argparse.Namespace):
    from services.common.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )


def _stream(engine, prompt: str, params, out) -> dict:
    """Run one request, writing text deltas to `out` as they come; returns the summary."""
    start = time.perf_counter()
    rid = engine.add_request(prompt, params)
    prompt_tokens = engine.sequence(rid).num_prompt_tokens
    token_ids: list[int] = []
    text = []
    first = None
    reason = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id != rid:
                continue
            first = first or time.perf_counter()
            token_ids += o.new_token_ids
            text.append(o.text_delta)
            if out is not None and o.text_delta:
                out.write(o.text_delta)
                out.flush()
            if o.finished:
                reason = o.finish_reason
    end = time.perf_counter()
    return {
        "token_ids": token_ids,
        "text": "".join(text),
        "finish_reason": str(reason),
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(token_ids)},
        "ttft_ms": round(((first or end) - start) * 1000, 3),
        "latency_ms": round((end - start) * 1000, 3),
    }


def _generate(args: argparse.Namespace) -> int:
    params = _params(args)
    engine = _engine(args)
    result = _stream(engine, args.prompt, params, None if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result))
    else:
        print()
    return 0


def _chat(args: argparse.Namespace) -> int:
    params = _params(args)
    engine = _engine(args)
    print(
        f"distserve: model {engine.model_dir} on {engine.device}; one prompt per line, Ctrl-D ends"
    )
    for line in sys.stdin:
        prompt = line.rstrip("\n")
        if not prompt:
            continue
        try:
            _stream(engine, prompt, params, sys.stdout)
        except DistServeError as e:
            print(f"error: {e}", end="")
        print(flush=True)
    return 0


def _up(args: argparse.Namespace) -> int:
    from distserve.local_mesh import MeshSpec, run_until_signal
    from services.edge.options import edge_config

    emulation = emulated_mesh(args)
    if args.model is None:
        from services.engine.presets import default_model

        args.model = default_model("tiny")
    gateway_args = ["--max-body-bytes", str(args.max_body_bytes)]
    if args.served_model_name:
        gateway_args += ["--served-model-name", args.served_model_name]
    if args.max_tokens:
        gateway_args += ["--max-tokens", str(args.max_tokens)]
    for flag, value in (("--slo-ttft-ms", args.slo_ttft_ms), ("--slo-tpot-ms", args.slo_tpot_ms)):
        if value is not None:
            gateway_args += [flag, str(value)]
    planner_args: list[str] = []
    if args.budget:
        planner_args = _autoscale_args(args)
    spec = MeshSpec(
        model=args.model,
        prefill=args.prefill,
        decode=args.decode,
        colocated=args.colocated,
        host=args.host,
        gateway_port=args.port,
        gateway_http_port=args.gateway_http_port,
        gateway_args=tuple(gateway_args),
        pin=args.pin,
        edge=None if args.no_edge else edge_config(args, args.host),
        planner=args.planner or bool(args.budget),
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
    return out + (["--advise"] if args.advise else [])


def _client(args: argparse.Namespace) -> int:
    import grpc

    from services.common.gen.distserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

    sampling = common_pb2.SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    if args.seed is not None:
        sampling.seed = args.seed
    request = gateway_pb2.GenerateRequest(text=args.prompt, sampling=sampling)
    start = time.perf_counter()
    first = None
    ids: list[int] = []
    text: list[str] = []
    last = None
    metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else None
    if args.ca_cert is not None:
        credentials = grpc.ssl_channel_credentials(root_certificates=args.ca_cert.read_bytes())
        channel = grpc.secure_channel(args.address, credentials)
    else:
        channel = mesh_tls.channel(args.address)
    with channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        try:
            call = stub.Generate(request, timeout=args.timeout, metadata=metadata)
            for reply in call:
                first = first or time.perf_counter()
                ids += reply.token_ids
                text.append(reply.text)
                last = reply
                if not args.json:
                    sys.stdout.write(reply.text)
                    sys.stdout.flush()
        except grpc.RpcError as e:
            print(f"distserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 2
    end = time.perf_counter()
    # An emulated mesh runs its time slower than the wall: its latencies are in its own time.
    scale = float(dict(call.initial_metadata() or ()).get("x-distserve-time-scale", 1.0))
    if args.json:
        reason = common_pb2.FinishReason.Name(last.finish_reason) if last else ""
        print(
            json.dumps(
                {
                    "request_id": last.request_id if last else "",
                    "token_ids": ids,
                    "text": "".join(text),
                    "finish_reason": reason.removeprefix("FINISH_REASON_").lower(),
                    "usage": {
                        "prompt_tokens": last.usage.prompt_tokens if last else 0,
                        "completion_tokens": last.usage.completion_tokens if last else 0,
                    },
                    "ttft_ms": round(((first or end) - start) * 1000 / scale, 3),
                    "latency_ms": round((end - start) * 1000 / scale, 3),
                }
            )
        )
    else:
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
