"""How much the planner's answer moves with the seed of its simulated requests (issue 51, item 1).

`distserve plan` on issue 51's example (OPT-13B, 1x2 GPUs, prompts 512 / outputs 64, SLO TTFT
400 ms / TPOT 40 ms at 90%) with seeds 0-9: the goodput of each placement the plan reports (the
chosen one and the colocated baseline), its spread (max - min) / mean across the seeds, and the
interval and simulated requests behind it. Then the OPT-175B 4x8 search (chat, SLO 4 s / 200 ms,
`--max-pp 0`: DistServe's search), timed: the search on quick estimates, and the whole plan with
the two reported placements refined.

Baseline, in the same run: the same commands on the planner before the stable estimate (commit
`--baseline-ref`, by default the one it was built on), exported with `git archive` into a
temporary folder and run there, so the figure beside ours is the old code path's own.
Targets (issue 51): spread <= 2% for each reported placement; the 175B search <= 10 s.

Prints a table, the hardware, then one JSON line (`plan_seed_spread_pct`: the larger spread
of the two reported placements; `placement_seconds_175b_4x8`: the search, `--precision 0`;
`plan_175b_4x8_s`: the plan with refinement; wall and CPU seconds). A few minutes on 2 cores.
Run: .venv/bin/python bench/planner/seed_spread.py [--seeds 10] [--refine-requests N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from distserve.loadgen.report import cpu_model  # noqa: E402

BASELINE_REF = "2d99574"  # main before the stable estimate
EXAMPLE = (
    "--model-spec opt-13b --cluster 1x2 --workload prompt=fixed:512,output=fixed:64 --slo 400,40"
)
SEARCH_175B = "--model-spec opt-175b --cluster 4x8 --workload chat --slo 4000,200 --max-pp 0"
TARGET_SPREAD_PCT = 2.0
TARGET_SEARCH_S = 10.0

# Run inside a checkout (ours or the baseline's): only the API both share, and what ours adds.
WORKER = """
import argparse, json, sys, time
from distserve import plan as cli
from services.planner.placement import plan
parser = argparse.ArgumentParser()
cli.register(parser.add_subparsers())
argv, seeds = sys.argv[1].split(), int(sys.argv[2])
rows = []
for seed in range(seeds):
    start, cpu = time.perf_counter(), time.process_time()
    result = plan(cli.plan_spec(parser.parse_args(["plan", *argv, "--seed", str(seed)])))
    row = {"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu,
           "search_seconds": result.search_seconds}
    for side in ("placement", "colocated"):
        p = getattr(result, side)
        e = getattr(p, "estimate", None)
        row[side] = p.goodput
        row[side + "_halfwidth"] = e.rel_halfwidth if e else None
        row[side + "_requests"] = e.requests if e else None
    rows.append(row)
print(json.dumps(rows))
"""


def run(tree: Path, argv: str, seeds: int) -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-c", WORKER, argv, str(seeds)],
        cwd=tree,
        env=dict(os.environ, PYTHONPATH=str(tree)),
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout)


def spread_pct(values: list[float]) -> float:
    return 100 * (max(values) - min(values)) / (sum(values) / len(values))


def baseline_tree(ref: str, into: Path) -> Path:
    """The planner at `ref`, exported and its gRPC stubs built, to run beside ours."""
    archive = subprocess.run(
        ["git", "archive", ref, "services", "distserve", "protos"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    subprocess.run(
        [sys.executable, "-m", "services.common.build_protos"],
        cwd=into,
        env=dict(os.environ, PYTHONPATH=str(into)),
        check=True,
        capture_output=True,
    )
    return into


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--baseline-ref", default=BASELINE_REF, help="the commit to compare with")
    p.add_argument("--refine-requests", type=int, help="passed to ours (default: the plan's)")
    a = p.parse_args()
    ours = EXAMPLE + (f" --refine-requests {a.refine_requests}" if a.refine_requests else "")
    with tempfile.TemporaryDirectory() as tmp:
        old = baseline_tree(a.baseline_ref, Path(tmp))
        after, before = run(ROOT, ours, a.seeds), run(old, EXAMPLE, a.seeds)
        big_search = run(ROOT, SEARCH_175B + " --precision 0", 1)[0]
        big_after, big_before = run(ROOT, SEARCH_175B, 1)[0], run(old, SEARCH_175B, 1)[0]
    print(f"distserve plan {EXAMPLE}, seeds 0-{a.seeds - 1}: after (ours) / before")
    worst = 0.0
    for side in ("placement", "colocated"):
        values = [r[side] for r in after]
        s_after, s_before = spread_pct(values), spread_pct([r[side] for r in before])
        worst = max(worst, s_after)
        halfwidth = max(r[side + "_halfwidth"] for r in after)
        requests = min(r[side + "_requests"] for r in after)
        print(
            f"  {side:<10} {min(values):.3f}-{max(values):.3f} req/s, spread {s_after:.2f}% "
            f"(before {s_before:.2f}%); 95% half-width <= {100 * halfwidth:.2f}%, >= "
            f"{requests:,} requests per probe"
        )
    mean = lambda rows, k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    print(
        f"  per plan: {mean(after, 'seconds'):.1f} s wall, {mean(after, 'cpu_seconds'):.1f} s CPU "
        f"(before {mean(before, 'seconds'):.1f} s, {mean(before, 'cpu_seconds'):.1f} s CPU)"
    )
    print(
        f"175B 4x8: search {big_search['seconds']:.1f} s wall ({big_search['cpu_seconds']:.1f} s "
        f"CPU); with the two reported placements refined {big_after['seconds']:.1f} s wall "
        f"({big_after['cpu_seconds']:.1f} s CPU); before: {big_before['seconds']:.1f} s wall "
        f"({big_before['cpu_seconds']:.1f} s CPU)"
    )
    print(f"on {cpu_model()} ({os.cpu_count()} CPUs), load {os.getloadavg()[0]:.1f}")
    print(
        f"targets: spread <= {TARGET_SPREAD_PCT}% "
        f"({'met' if worst <= TARGET_SPREAD_PCT else 'not met'}), search <= {TARGET_SEARCH_S} s "
        f"({'met' if big_search['seconds'] <= TARGET_SEARCH_S else 'not met'}; wall time on a "
        "shared host: compare with before, measured beside it)"
    )
    print(
        json.dumps(
            {
                "plan_seed_spread_pct": round(worst, 2),
                "plan_seed_spread_pct_before": round(
                    max(spread_pct([r[s] for r in before]) for s in ("placement", "colocated")), 2
                ),
                "placement_seconds_175b_4x8": round(big_search["seconds"], 2),
                "placement_cpu_seconds_175b_4x8": round(big_search["cpu_seconds"], 2),
                "plan_175b_4x8_s": round(big_after["seconds"], 2),
                "plan_175b_4x8_cpu_s": round(big_after["cpu_seconds"], 2),
                "placement_seconds_175b_4x8_before": round(big_before["seconds"], 2),
                "placement_cpu_seconds_175b_4x8_before": round(big_before["cpu_seconds"], 2),
                "plan_cpu_s": round(mean(after, "cpu_seconds"), 2),
                "plan_cpu_s_before": round(mean(before, "cpu_seconds"), 2),
            }
        )
    )


if __name__ == "__main__":
    main()
