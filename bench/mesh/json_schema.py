"""The cost of a JSON-schema constraint (structured output, llguidance) on TTFT and streamed
tokens/s through a 1P1D mesh, beside the same requests without it (feature_cost.py says how).
The schema is an array of at least 256 small integers, so every constrained answer runs the
same `--new-tokens` as the free ones (none completes before). Prints a table and one JSON line
with `json_schema_tok_s_ratio` and `json_schema_ttft_added_ms`.
Run: `python bench/mesh/json_schema.py`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from feature_cost import run

from services.common.gen.distserve.v1 import common_pb2

SCHEMA = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 99},
    "minItems": 256,
}


def check(reply) -> None:
    """Nothing to check per response: the answers are cut by max_tokens, and the grammar holds
    them to the schema (tests/test_structured_mesh.py checks that whole answers parse)."""


if __name__ == "__main__":
    run(
        "mesh_json_schema",
        "a JSON-schema constraint",
        {"structured_output": common_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA))},
        check,
        ("json_schema_tok_s_ratio", "json_schema_ttft_added_ms"),
    )
