"""`distserve plan` and `distserve profile`: the planner's command line.

`register(subparsers)` adds both subcommands to the `distserve` parser; `main(argv)` runs them
on their own (`python -m distserve.plan plan ...`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from distserve.command import run
from services.common.errors import InvalidRequest


def register(sub: argparse._SubParsersAction) -> None:
    """Add `plan` and `profile` to a subparsers object, each with its `func`."""
    p = sub.add_parser(
        "plan", help="search the placement with the best goodput per GPU for a workload and SLO"
    )
    p.add_argument(
        "--model-spec", help="opt-13b, opt-66b, opt-175b, or a model folder with a config.json"
    )
    p.add_argument(
        "--profile",
        type=Path,
        help="latency profile: `distserve profile` output or DistServe's published JSON "
        "(default: the published A100 profile, scaled for models it lacks)",
    )
    p.add_argument(
        "--colocated-profile",
        type=Path,
        help="latency of the colocated baseline, used as named (default: the vLLM fit published "
        "beside a DistServe profile, as the paper measures its baseline on vLLM; else --profile)",
    )
    p.add_argument("--cluster", help="NODESxGPUS[,INTRA_GBS,INTER_GBS], e.g. 4x8,300,3.1")
    p.add_argument(
        "--gpu-memory-gib", type=float, default=80.0, help="memory of one GPU (default 80)"
    )
    p.add_argument(
        "--workload",
        default="chat",
        help="chat | code | summarization [:cv=X] | trace:FILE | prompt=DIST,output=DIST[,cv=X]",
    )
    p.add_argument("--slo", help="TTFT_MS,TPOT_MS, e.g. 400,100")
    p.add_argument("--attainment", type=float, default=0.9, help="fraction meeting both SLOs")
    p.add_argument("--rate", type=float, help="target requests/s (default: fill the cluster)")
    p.add_argument("--affinity", choices=("auto", "high", "low"), default="auto")
    p.add_argument("--max-num-seqs", type=int, default=256, help="running requests per instance")
    p.add_argument(
        "--num-requests",
        type=int,
        default=1000,
        help="simulated per instance in each goodput probe of the search (default 1000)",
    )
    p.add_argument(
        "--precision",
        type=float,
        default=0.01,
        help="the chosen placement's and the colocated baseline's goodputs are simulated again "
        "until each 95%% interval's half-width is within this fraction of it (default 0.01: "
        "within about 2%% from seed to seed; 0: the search's quick estimates as they come)",
    )
    p.add_argument(
        "--refine-requests",
        type=int,
        default=400_000,
        help="at most about this many more simulated requests for each of the two (default "
        "400000, a few seconds); the interval printed says how far they got",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-pp",
        type=int,
        default=1,
        help="largest pipeline degree (default 1: the workers implement tensor parallelism "
        "only; 0: any, DistServe's search, as a what-if)",
    )
    p.add_argument("--out", type=Path, default=Path("plan.json"), help="where to write the JSON")
    p.add_argument(
        "--watch",
        metavar="ADDRESS",
        help="instead of a search: print the running planner's view and decision (host:port of "
        "a planner resizing a mesh, `distserve up --budget`), every --every-s seconds",
    )
    p.add_argument("--every-s", type=float, default=2.0, help="with --watch (0: once)")
    p.set_defaults(func=plan_command)

    q = sub.add_parser("profile", help="measure the engine here and fit the latency model")
    q.add_argument("--model", type=Path, help="model folder (default: the embedded tiny model)")
    q.add_argument("--out", type=Path, help="profile file (default: profile-MODEL.json)")
    q.add_argument("--quick", action="store_true", help="a small grid (seconds on the tiny model)")
    q.add_argument("--no-progress", action="store_true", help="no progress bar")
    q.set_defaults(func=profile_command)


def plan_spec(args: argparse.Namespace):
    """The PlanSpec the arguments describe (validated)."""
    from services.common.latency import colocated_for_model, for_model
    from services.common.model_spec import GIB, model_spec
    from services.common.slo import Slo
    from services.planner.cluster import ClusterSpec
    from services.planner.placement import PlanSpec
    from services.planner.workload import parse_workload

    model = model_spec(args.model_spec)
    cluster = ClusterSpec.parse(args.cluster)
    if args.gpu_memory_gib != 80.0:
        cluster = ClusterSpec(
            cluster.nodes,
            cluster.gpus_per_node,
            int(args.gpu_memory_gib * GIB),
            cluster.intra_node_bandwidth,
            cluster.inter_node_bandwidth,
        )
    latency = for_model(model, args.profile)
    colocated = colocated_for_model(model, args.colocated_profile, args.profile)
    return PlanSpec(
        model=model,
        cluster=cluster,
        workload=parse_workload(args.workload),
        slo=Slo.parse(args.slo),
        latency=latency,
        colocated_latency=colocated,
        alpha=args.attainment,
        rate=args.rate,
        affinity=args.affinity,
        max_num_seqs=args.max_num_seqs,
        num_requests=args.num_requests,
        seed=args.seed,
        precision=args.precision or None,
        refine_requests=args.refine_requests,
        max_pp=args.max_pp or None,
    )


def plan_command(args: argparse.Namespace) -> int:
    from services.planner.placement import plan

    if args.watch:
        return watch(args.watch, args.every_s)
    missing = [f for f in ("model_spec", "cluster", "slo") if not getattr(args, f)]
    if missing:
        flags = ", ".join("--" + f.replace("_", "-") for f in missing)
        raise InvalidRequest(f"a plan needs {flags} (or --watch ADDRESS)")
    result = plan(plan_spec(args))
    print(describe_plan(result))
    args.out.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def watch(address: str, every_s: float) -> int:
    """Print the planner's latest decision at `address`, every `every_s` seconds (0: once)."""
    import time

    import grpc

    from services.common import mesh_tls
    from services.common.gen.distserve.v1 import planner_pb2, planner_pb2_grpc

    with mesh_tls.channel(address) as channel:
        stub = planner_pb2_grpc.PlannerStub(channel)
        while True:
            try:
                d = stub.GetDecision(planner_pb2.GetDecisionRequest(), timeout=10)
                print(describe_decision(d), flush=True)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise InvalidRequest(f"planner at {address}: {e.details()}") from None
                print(f"planner at {address}: {e.details()}", flush=True)
            if every_s <= 0:
                return 0
            time.sleep(every_s)


def describe_decision(d) -> str:
    """One decision as a person reads it."""
    import time

    def counts(c, tp) -> str:  # "decode=2(tp2) prefill=1"
        tp_of = lambda r: f"(tp{tp[r]})" if tp.get(r, 1) > 1 else ""  # noqa: E731
        return " ".join(f"{r}={c[r]}{tp_of(r)}" for r in sorted(c)) or "-"

    observed = "-" if d.observed_attainment < 0 else f"{d.observed_attainment:.1%}"
    predicted = ", ".join(f"{k} {v:.1%}" for k, v in sorted(d.predicted_attainment.items()))
    stamp = time.strftime("%H:%M:%S", time.localtime(d.decided_unix_s))
    mode = " (advisory)" if d.advisory else ""
    loads = "".join(f"; {role}: {describe_load(d.load[role])}" for role in sorted(d.load))
    now, then = counts(d.current, d.current_tp), counts(d.target, d.target_tp)
    return (
        f"{stamp} {d.action}{mode}: {now} -> {then} "
        f"(budget {d.budget}); {d.samples} requests at {d.rate_rps:.3g} req/s, attainment "
        f"observed {observed}, predicted {predicted or '-'}; {d.reason}{loads}"
    )


def describe_load(load) -> str:
    """A role's `WorkerLoad` as a person reads it."""
    used = 1 - load.free_kv_blocks / load.total_kv_blocks if load.total_kv_blocks else 0.0
    step = f", step {load.decode_step_ms:.3g} ms" if load.decode_step_ms else ""
    return (
        f"{load.waiting_seqs} waiting ({load.queued_prompt_tokens:,} prompt tokens), "
        f"{load.running_seqs} running, KV {used:.0%} used{step}"
    )


def describe_plan(result) -> str:
    """The placement as a person reads it: per phase TP, PP, replicas, nodes; goodputs."""
    p, c = result.placement, result.colocated
    lines = [
        f"{result.spec.model.name} on {result.spec.cluster.nodes}x"
        f"{result.spec.cluster.gpus_per_node} GPUs, workload {result.spec.workload.name}, "
        f"SLO TTFT {result.spec.slo.ttft_s * 1000:g} ms / TPOT {result.spec.slo.tpot_s * 1000:g} "
        f"ms at {result.spec.alpha:.0%}",
        f"placement ({p.algorithm}):",
    ]
    for phase in p.phases:
        lines.append(
            f"  {phase.role:<8} tp={phase.tp} pp={phase.pp} x{phase.replicas}"
            f"  (one instance alone: {phase.instance_estimate.describe()})"
        )
    for i, inst in enumerate(p.instances):
        stages = ", ".join(f"n{s[0][0]}:{','.join(str(g) for _, g in s)}" for s in inst.gpus)
        lines.append(f"    {inst.role}[{i}] stages {stages}")
    lines += [
        f"goodput {p.estimate.describe()} on {p.num_gpus} GPUs = {p.per_device:.3g} req/s per GPU",
        f"colocated baseline: tp={c.phases[0].tp} pp={c.phases[0].pp} x{c.phases[0].replicas}, "
        f"{c.estimate.describe()} on {c.num_gpus} GPUs = {c.per_device:.3g} req/s per GPU",
        "goodputs: [95% interval] (simulated requests per probe); "
        + _precision(result.spec, p.estimate, c.estimate),
        f"ratio over colocated: {result.ratio:.2f}x  (search {result.search_seconds:.1f} s, "
        f"plan {result.plan_seconds:.1f} s)",
        f"latency: {result.spec.latency.source}{_overhead(result.spec.latency)}",
        f"colocated baseline's latency: {result.spec.colocated_latency.source}"
        + _overhead(result.spec.colocated_latency),
    ]
    return "\n".join(lines)


def _overhead(latency) -> str:
    """The per-iteration overhead the simulator adds to a profile's fits, when it adds one."""
    if not latency.iteration_ms(1):
        return ""
    return (
        f"; + {latency.iteration_overhead_ms:g} ms + {latency.iteration_overhead_ms_per_token:g} "
        "ms per token each iteration (the engine's overhead beyond the fit)"
    )


def _precision(spec, *reported) -> str:
    """How far the two reported goodputs were refined, as the plan's reader needs it."""
    if spec.precision is None:
        return "all are the search's quick estimates (--precision 0)"
    short = [e for e in reported if e.rel_halfwidth > spec.precision]
    head = (
        f"the placement and the baseline re-simulated until within +-{spec.precision:.2%} "
        f"(or {spec.refine_requests:,} more requests each)"
    )
    if not short:
        return head + "; the phases' are the search's quick estimates"
    widest = max(e.rel_halfwidth for e in short)
    return head + f": the budget ended first, at +-{widest:.2%} (raise --refine-requests)"


def profile_command(args: argparse.Namespace) -> int:
    from services.planner.profiler import FULL, QUICK, describe, profile

    if args.model is None:
        from services.engine.presets import default_model

        args.model = default_model("tiny")
    out = args.out or Path(f"profile-{args.model.name}.json")
    result = profile(args.model, QUICK if args.quick else FULL, progress=not args.no_progress)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(describe(result))
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run((register,), argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
