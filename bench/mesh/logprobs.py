"""The cost of logprobs (top 5 alternatives per token) on TTFT and streamed tokens/s through a
1P1D mesh, beside the same requests without them (feature_cost.py says how). Prints a table
and one JSON line with `logprobs_tok_s_ratio` and `logprobs_ttft_added_ms`.
Run: `python bench/mesh/logprobs.py`."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from feature_cost import run

TOP = 5


def check(reply) -> None:
    """Each token came with its logprob and TOP alternatives."""
    assert len(reply.logprobs) == len(reply.token_ids)
    assert all(len(lp.top_token_ids) == TOP for lp in reply.logprobs)


if __name__ == "__main__":
    run(
        "mesh_logprobs",
        f"logprobs (top {TOP})",
        {"logprobs": TOP},
        check,
        ("logprobs_tok_s_ratio", "logprobs_ttft_added_ms"),
    )
