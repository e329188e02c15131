"""The load generator against a real 1P1D mesh (tiny model): exact lengths, the open-loop
schedule, errors as values, and the same token counts over gRPC and HTTP."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from distserve.loadgen import GrpcTarget, HttpTarget, LoadRequest, load_requests, run_load
from services.common.model_config import ModelConfig
from services.common.slo import Slo
from services.planner.workload import LengthDist, Requests, Workload

WORKLOAD = Workload(
    "lg", LengthDist("uniform", low=4, high=200), LengthDist("uniform", low=1, high=24)
)


@pytest.fixture(scope="module")
def mesh(shared_mesh):
    """The session's 1P1D mesh (the load runs here end, and free their KV)."""
    return shared_mesh


@pytest.fixture(scope="module")
def vocab(tiny_model) -> int:
    return ModelConfig.from_dir(tiny_model).vocab_size


def test_a_run_until_n_ends_once_the_first_n_have_and_stops_the_rest(mesh, vocab):
    """The planner's goodput judges the middle half of its requests: a run can end once those
    have ended, the later ones sent only to keep the load on meanwhile."""
    reqs = Requests(
        np.array([0.0, 0.01, 0.02, 0.03, 5.0, 5.01]),
        np.array([8] * 6),
        np.array([4, 4, 4, 900, 200, 200]),
    )
    result = asyncio.run(
        asyncio.wait_for(
            run_load(GrpcTarget(mesh.gateway_address), load_requests(reqs, vocab), until=3), 20
        )
    )
    assert result.ok[:3].all() and (result.output_tokens[:3] == 4).all()
    assert result.error[3:] == ("CANCELLED", "NOT_SENT", "NOT_SENT")  # in flight; due later
    assert result.duration_s < 4


def test_prompts_have_exact_lengths_and_are_seeded(vocab):
    reqs = WORKLOAD.sample(20, seed=3)
    a, b = load_requests(reqs, vocab, seed=5), load_requests(reqs, vocab, seed=5)
    assert a == b
    assert [len(r.prompt_ids) for r in a] == reqs.prompt.tolist()
    assert all(4 <= t < vocab for r in a for t in r.prompt_ids)
    assert [r.max_tokens for r in a] == reqs.output.tolist()


def test_every_request_completes_with_its_exact_output_length_on_schedule(mesh, vocab):
    reqs = WORKLOAD.sample(40, seed=1).at_rate(20.0)
    result = asyncio.run(run_load(GrpcTarget(mesh.gateway_address), load_requests(reqs, vocab)))
    assert result.ok.all(), result.error_message
    assert (result.output_tokens == reqs.output).all()
    # Open loop: each request left at its arrival time, whatever the others were doing. Not a
    # timing bound (a shared 2-core machine can delay any one send): sends never precede their
    # arrival, keep the schedule's order, lateness does not accumulate (a closed loop would add
    # each reply's latency to the next send), and requests overlapped in flight.
    lag = result.send_lag_s
    assert lag.min() >= 0, lag
    assert (np.diff(result.sent_s) >= 0).all()
    assert np.median(lag) < np.median(np.diff(result.arrival_s)), lag
    finished = result.sent_s + result.latency_s
    assert (result.sent_s[1:] < np.maximum.accumulate(finished)[:-1]).any()
    assert (result.ttft_s > 0).all() and (result.latency_s >= result.ttft_s).all()
    assert [len(g) for g in result.token_gaps_s] == (reqs.output - 1).tolist()
    summary = result.summary(Slo(10.0, 10.0))
    assert summary["attainment"] == 1.0 and summary["exact_lengths"] == 40
    assert np.isclose(result.attainment(Slo(0.0, 0.0)), 0.0)


def test_a_prompt_longer_than_the_context_is_an_error_not_a_crash(mesh, vocab):
    good = load_requests(Requests(np.array([0.0, 0.01]), np.array([8, 8]), np.array([4, 4])), vocab)
    too_long = LoadRequest(0.005, tuple([5] * 2000), 4)
    reqs = [good[0], too_long, good[1]]
    for target in (
        GrpcTarget(mesh.gateway_address),
        HttpTarget(f"http://{mesh.gateway_http_address}"),
    ):
        result = asyncio.run(run_load(target, reqs))
        assert result.ok.tolist() == [True, False, True]
        assert result.error[1] in ("INVALID_ARGUMENT", "HTTP 400")
        assert "max_model_len" in result.error_message[1]
        assert np.isnan(result.ttft_s[1])
        assert result.summary()["errors"] == {result.error[1]: 1}


def test_http_and_grpc_give_the_same_token_counts(mesh, vocab):
    reqs = load_requests(WORKLOAD.sample(12, seed=2).at_rate(30.0), vocab, seed=2)
    grpc_result = asyncio.run(run_load(GrpcTarget(mesh.gateway_address), reqs))
    http_result = asyncio.run(run_load(HttpTarget(f"http://{mesh.gateway_http_address}"), reqs))
    assert grpc_result.ok.all() and http_result.ok.all()
    assert (grpc_result.output_tokens == http_result.output_tokens).all()
    assert (http_result.output_tokens == [r.max_tokens for r in reqs]).all()
