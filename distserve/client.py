"""`distserve client`: sends one request to a running mesh (the edge, or a gateway's gRPC port)
and streams its tokens."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from services.common import mesh_tls


def register(sub: argparse._SubParsersAction) -> None:
    """Add `client` to a subparsers object."""
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
