"""The engine command vocabulary: what rank 0 sends its followers, one JSON line each."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidRequest
from services.common.kv_handle import KvHandle, RankSource
from services.common.sampling import SamplingParams
from services.engine import commands

PARAMS = SamplingParams(max_tokens=5, temperature=0.7, seed=3, stop=("x",), stop_token_ids=(7,))


@pytest.mark.parametrize(
    "command",
    [
        commands.AddRequest([1, 2, 3], PARAMS, "r1"),
        commands.AddPrefilled([4, 5], None, PARAMS, "r2"),
        commands.AddPrefilled([4, 5], 9, SamplingParams(), "r3"),
        commands.AddPrefilled([4, 5], None, SamplingParams(n=3), "r4", choices=((0, 9), (2, 8))),
        commands.AdmitPulls(),
        commands.StartDecoding("r2", 11),
        commands.Abort("r1"),
        commands.Release("r3"),
        commands.Step(),
        commands.PrefillStep(),
        commands.PullKv("r2", "aGFuZGxl", [3, 4, 9]),
    ],
)
def test_every_command_survives_the_wire(command):
    line = commands.encode(command)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert commands.decode(line) == command


def test_pull_kv_carries_the_handle_whole():
    handle = KvHandle(
        handle_id="h",
        source_instance="prefill-0",
        control_address="127.0.0.1:1",
        ucx_host="127.0.0.1",
        ucx_port=2,
        num_tokens=20,
        block_size=16,
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        dtype="float32",
        runs=((3, 2),),
        block_bytes=1024,
        lease_expiry_unix_ms=5,
        access_token="secret",
        rank_sources=(
            RankSource(0, "127.0.0.1", 2, range(0, 1)),
            RankSource(1, "127.0.0.1", 3, range(1, 2)),
        ),
    )
    back = commands.decode(commands.encode(commands.PullKv("r", handle.encode(), [7, 8], 2)))
    pulled = []

    class Kv:
        def pull(self, request_id, h, blocks, skip):
            pulled.append((request_id, KvHandle.decode(h), blocks, skip))

    back.apply(None, Kv())
    assert pulled == [("r", handle, [7, 8], 2)]


def test_a_command_outside_the_vocabulary_is_refused():
    with pytest.raises(InvalidRequest, match="unknown engine command"):
        commands.decode(b'{"command": "exec", "args": {}}\n')
