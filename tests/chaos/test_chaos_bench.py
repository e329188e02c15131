"""The chaos bench, short: `bench/chaos/chaos.py` for 8 s of load on a 2 prefill + 2 decode mesh
(tiny model) while workers are killed, drained and restarted, one prefill instance's KV
transfers fail every 5th chunk, the client cancels a quarter of the requests and malformed HTTP
bodies arrive. No request is lost or answered with wrong tokens, every request cut off by a
decode instance's death completes through migration with its exact tokens (or, if the client
cancels it, with a prefix of them), no KV block is left
held or lapses its lease, and no malformed body gets a 5xx.

The first fault is always a SIGKILL of a decode instance with streams running, so the run moves
requests: a gateway that did not migrate would fail them (and `migrated_ok_fraction` would be
below 1); one that resumed them wrongly would fail the exact-token check.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARGS = (
    "--no-baseline",  # goodput kept needs a second, fault-free mesh: left to the full run
    # 8 s at 4 req/s (40 requests): the first fault (a decode SIGKILL) comes at 2 s, then one
    # every 2 s on average (in this seed's draws: a prefill SIGTERM at about 5 s); the run ends
    # once the last worker is back, so a shorter run means less waiting, not fewer checks.
    "--duration-s",
    "8",
    "--rate",
    "4",
    "--seed",
    "1",
    "--cancellations",
    "8",
    "--fault-interval-s",
    "2",
    "--transfer-fault-every",
    "5",
    "--fuzz-bodies",
    "30",
)


def test_short_chaos_run_loses_no_request_and_leaks_no_kv(tmp_path):
    out = tmp_path / "chaos.json"
    command = [sys.executable, str(ROOT / "bench" / "chaos" / "chaos.py"), *ARGS]
    proc = subprocess.run(
        [*command, "--out", str(out), "--logs", str(tmp_path / "logs")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    detail = ("events", "failed_requests")
    assert summary == {k: v for k, v in json.loads(out.read_text()).items() if k not in detail}

    assert summary["lost_requests"] == 0, summary["chaos"]["failures"]
    assert summary["wrong_tokens"] == 0
    assert summary["leaked_blocks"] == 0, summary["leaks"]
    assert summary["fuzz_5xx"] == 0 and summary["fuzz_no_answer"] == 0, summary["fuzz"]
    assert summary["fuzz"]["sent"] == 30
    # Faults happened: a decode instance was killed with streams running, and the requests it
    # cut off all completed, exactly, elsewhere.
    assert summary["faults"]["sigkill"] >= 1 and summary["faults"]["decode"] >= 1
    assert summary["migrated_requests"] >= 1, summary["migrations_metric"]
    assert summary["migrated_ok_fraction"] == 1.0, summary["chaos"]["failures"]
    assert summary["cancelled"] >= 1
    assert (
        summary["completed_exact"] + summary["cancelled"] + summary["failed_clear"]
        == (summary["chaos"]["requests"])
    )
