"""How much the planner's answer moves with the seed of its simulated requests (issue 51, item 1).

For three examples (issue 51's OPT-13B 1x2 fixed 512/64 at SLO 400/40 ms; OPT-13B 1x4 code at
250/100 ms; OPT-66B 2x8 code at 400/100 ms), `distserve plan` with seeds 0-9: each reported
candidate's goodput (every algorithm's placement and the colocated baseline), and its spread
(max - min) / mean across the seeds. Then the OPT-175B 4x8 search (chat, SLO 4 s / 200 ms,
`--max-pp 0`: DistServe's search) timed once.

Baseline, in the same run: the same commands on the planner before the stable estimate (commit
`--baseline-ref`, by default the one it was built on), exported with `git archive` into a
temporary folder and run there, so the figure beside ours is the old code path's own.
Target: spread <= 2% for every candidate; the 175B search <= 10 s.

Prints a table, the hardware, then one JSON line (`goodput_seed_spread_pct`: the largest spread
over the candidates of every example; `search_175b_4x8_s`). Several minutes on 2 cores.
Run: .venv/bin/python bench/planner/seed_spread.py [--seeds 10] [--examples issue,code,66b]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASELINE_REF = "4657272"  # main before the stable estimate
EXAMPLES = {
    "issue": "--model-spec opt-13b --cluster 1x2 --workload prompt=fixed:512,output=fixed:64 "
    "--slo 400,40",
    "code": "--model-spec opt-13b --cluster 1x4 --workload code --slo 250,100",
    "66b": "--model-spec opt-66b --cluster 2x8 --workload code --slo 400,100",
}
SEARCH_175B = "--model-spec opt-175b --cluster 4x8 --workload chat --slo 4000,200 --max-pp 0"
TARGET_SPREAD_PCT = 2.0
TARGET_SEARCH_S = 10.0

# Run inside a checkout (ours or the baseline's): only the API both share.
WORKER = """
import argparse, json, sys, time
from distserve import plan as cli
from services.planner.placement import plan
parser = argparse.ArgumentParser()
cli.register(parser.add_subparsers())
argv, seeds = sys.argv[1].split(), int(sys.argv[2])
rows = []
for seed in range(seeds):
    start = time.perf_counter()
    result = plan(cli.plan_spec(parser.parse_args(["plan", *argv, "--seed", str(seed)])))
    row = {k: v.goodput for k, v in result.candidates.items()}
    row["colocated"] = result.colocated.goodput
    row["seconds"] = time.perf_counter() - start
    rows.append(row)
print(json.dumps(rows))
"""


def run(tree: Path, argv: str, seeds: int) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run(
        [sys.executable, "-c", WORKER, argv, str(seeds)],
        cwd=tree,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout)


def spreads(rows: list[dict]) -> dict[str, float]:
    """Per candidate: (max - min) / mean over the seeds, in percent."""
    out = {}
    for key in rows[0]:
        if key != "seconds":
            values = [r[key] for r in rows]
            out[key] = 100 * (max(values) - min(values)) / (sum(values) / len(values))
    return out


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--examples", default=",".join(EXAMPLES), help="of " + ", ".join(EXAMPLES))
    p.add_argument("--baseline-ref", default=BASELINE_REF, help="the commit to compare with")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp)
        archive = subprocess.run(
            ["git", "archive", a.baseline_ref, "services", "distserve"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        subprocess.run(
            [sys.executable, "-m", "services.common.build_protos"],
            cwd=old,
            env=dict(os.environ, PYTHONPATH=str(old)),
            check=True,
            capture_output=True,
        )
        worst = 0.0
        print(f"seed spread over {a.seeds} seeds: after (ours) / before ({a.baseline_ref})")
        for name in a.examples.split(","):
            after, before = run(ROOT, EXAMPLES[name], a.seeds), run(old, EXAMPLES[name], a.seeds)
            s_after, s_before = spreads(after), spreads(before)
            mean_s = lambda rows: sum(r["seconds"] for r in rows) / len(rows)  # noqa: E731
            print(f"  {name}: distserve plan {EXAMPLES[name]}")
            for key in s_after:
                mean = sum(r[key] for r in after) / len(after)
                print(
                    f"    {key:<14} {mean:8.3f} req/s  spread {s_after[key]:5.2f}% "
                    f"(before {s_before[key]:5.2f}%)"
                )
            print(f"    plan time {mean_s(after):.1f} s (before {mean_s(before):.1f} s)")
            worst = max(worst, *s_after.values())
        search_after = run(ROOT, SEARCH_175B, 1)[0]["seconds"]
        search_before = run(old, SEARCH_175B, 1)[0]["seconds"]
    print(f"175B 4x8 search: {search_after:.1f} s (before {search_before:.1f} s)")
    print(f"on {cpu_model()} ({os.cpu_count()} CPUs), {platform.platform()}")
    print(
        f"targets: spread <= {TARGET_SPREAD_PCT}% ({'met' if worst <= 2 else 'not met'}), "
        f"search <= {TARGET_SEARCH_S} s ({'met' if search_after <= 10 else 'not met'})"
    )
    print(
        json.dumps(
            {
                "goodput_seed_spread_pct": round(worst, 2),
                "search_175b_4x8_s": round(search_after, 2),
                "search_175b_4x8_s_before": round(search_before, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
