"""`distserve bench goodput`: goodput of the disaggregated mesh (1 prefill + 1 decode, or
`--prefill N --decode M`) against the colocated baseline (2 colocated instances, or `--colocated
K`) on this host, measured with the load generator; goodput per core divides by the workers.
What runs, and what it writes into `--out`: `distserve.loadgen.comparison`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from distserve.command import run
from distserve.loadgen.comparison import MODES, BenchSpec, describe, run_bench
from distserve.local_mesh import add_emulation_options, emulated_mesh
from distserve.plots import require_matplotlib
from services.common.errors import DistServeError


def register(sub: argparse._SubParsersAction) -> None:
    """Add `bench` with its `goodput` subcommand to a subparsers object."""
    bench = sub.add_parser("bench", help="benchmarks against the running mesh").add_subparsers(
        dest="bench_command", required=True
    )
    p = bench.add_parser(
        "goodput", help="goodput of disaggregated vs colocated serving on this host"
    )
    p.add_argument("--mode", choices=(*MODES, "both"), default="both")
    p.add_argument(
        "--workload",
        default="chat",
        help="chat | code | summarization (CPU-scaled presets) | trace:FILE | "
        "prompt=DIST,output=DIST",
    )
    p.add_argument("--arrivals", default="poisson", help="poisson | gamma:CV (CV > 1: bursty)")
    p.add_argument("--slo", help="TTFT_MS,TPOT_MS (default: 5x / 3x the unloaded median request)")
    p.add_argument("--requests", type=int, default=24, help="requests per probe (default 24)")
    p.add_argument("--max-probes", type=int, default=6, help="rates probed per mode (default 6)")
    p.add_argument("--rates", help="LO,HI: the first bracket in req/s (default: from unloaded)")
    p.add_argument("--attainment", type=float, default=0.9, help="alpha (default 0.9)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    p.add_argument("--edge", action="store_true", help="through Envoy (default: the gateway)")
    p.add_argument("--model", type=Path, help="model folder (default: the embedded small model)")
    p.add_argument("--out", type=Path, default=Path("bench-goodput"), help="output folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--prefill",
        type=int,
        default=1,
        help="prefill workers of the disaggregated mesh (default 1; every worker is pinned to "
        "one core, round-robin over this host's cores)",
    )
    p.add_argument("--decode", type=int, default=1, help="its decode workers (default 1)")
    p.add_argument(
        "--colocated", type=int, default=2, help="workers of the colocated mesh (default 2)"
    )
    add_emulation_options(p)
    p.set_defaults(func=goodput_command)


def goodput_command(args: argparse.Namespace) -> int:
    try:
        require_matplotlib("distserve bench (attainment.png, latency_cdf.png)")
        emulation = emulated_mesh(args)
    except DistServeError as e:
        print(f"distserve: error: {e}", file=sys.stderr)
        return 2
    emulated = None
    if emulation:  # the mesh's instances as the planner's simulator sees them
        from distserve.loadgen.emulated import EmulatedCluster
        from services.common.model_spec import GIB

        emulated = EmulatedCluster.of(
            args.model_spec,
            args.profile,
            gpu_memory_bytes=int(args.gpu_memory_gib * GIB),
            link_gbs=args.link_gbs,
        )
    if args.model is None:
        from services.engine.presets import default_model

        args.model = default_model("small")
    rates = None
    if args.rates:
        try:
            lo, hi = (float(x) for x in args.rates.split(","))
        except ValueError:
            print(f"distserve: error: --rates {args.rates!r}: expected LO,HI", file=sys.stderr)
            return 2
        rates = (lo, hi)
    if min(args.prefill, args.decode, args.colocated) < 1:
        print("distserve: error: --prefill, --decode and --colocated must be >= 1", file=sys.stderr)
        return 2
    spec = BenchSpec(
        model=args.model,
        workload=args.workload,
        modes=MODES if args.mode == "both" else (args.mode,),
        arrivals=args.arrivals,
        slo=args.slo,
        requests=args.requests,
        max_probes=args.max_probes,
        rates=rates,
        alpha=args.attainment,
        seed=args.seed,
        protocol=args.protocol,
        edge=args.edge,
        prefill=args.prefill,
        decode=args.decode,
        colocated=args.colocated,
        out=args.out,
        progress=not args.no_progress,
        emulated=emulated,
        time_scale=args.time_scale,
    )
    try:
        report = run_bench(spec)
    except DistServeError as e:
        print(f"distserve: error: {e}", file=sys.stderr)
        return 2
    print(describe(report))
    print(f"wrote {spec.out}/goodput.json, attainment.png, latency_cdf.png")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run((register,), argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
