"""The engine command vocabulary: what rank 0 sends its followers, one JSON line each."""

from __future__ import annotations

import json

import pytest
import torch

from services.common.errors import InvalidRequest
from services.common.sampling import SamplingParams
from services.engine import commands

PARAMS = SamplingParams(max_tokens=5, temperature=0.7, seed=3, stop=("x",), stop_token_ids=(7,))


@pytest.mark.parametrize(
    "command",
    [
        commands.AddRequest([1, 2, 3], PARAMS, "r1"),
        commands.AddPrefilled([4, 5], None, PARAMS, "r2"),
        commands.AddPrefilled([4, 5], 9, SamplingParams(), "r3"),
        commands.AdmitPulls(),
        commands.StartDecoding("r2", 11),
        commands.Abort("r1"),
        commands.Release("r3"),
        commands.Step(),
        commands.PrefillStep(),
        commands.GatherKv(1, 0, 4, 2),
    ],
)
def test_every_command_survives_the_wire(command):
    line = commands.encode(command)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert commands.decode(line) == command


def test_scatter_kv_sends_its_blocks_but_never_its_tensor():
    command = commands.ScatterKv([3, 4], 20, torch.ones(2, 2, 20, 1, 8))
    line = commands.encode(command)
    assert json.loads(line)["args"] == {"blocks": [3, 4], "num_tokens": 20}
    back = commands.decode(line)
    assert (back.blocks, back.num_tokens, back.tokens) == ([3, 4], 20, None)


def test_a_command_outside_the_vocabulary_is_refused():
    with pytest.raises(InvalidRequest, match="unknown engine command"):
        commands.decode(b'{"command": "exec", "args": {}}\n')
