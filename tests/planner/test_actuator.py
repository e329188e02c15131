"""The actuator's interface (services/planner/actuator.py): every implementation the planner
can drive has the `Actuator` protocol's methods with its signatures, and what an actuator
reports survives its message both ways (`to_pb`/`from_pb`), as it crosses the `Actuator`
service; a decision becomes the `Decision` message GetDecision answers."""

from __future__ import annotations

import inspect
import math

import pytest

from distserve.local_actuator import LocalActuator
from services.common.gen.distserve.v1 import common_pb2, planner_pb2
from services.planner.actuator import Actuator, ActuatorStatus, Instance, RemoteActuator
from services.planner.decision import Decision


@pytest.mark.parametrize("implementation", [LocalActuator, RemoteActuator])
def test_every_actuator_has_the_protocols_methods_and_signatures(implementation):
    for name in ("scale", "apply", "drain", "status"):
        wanted = inspect.signature(getattr(Actuator, name))
        assert inspect.signature(getattr(implementation, name)) == wanted, name


def test_an_actuator_status_survives_its_message_both_ways():
    load = common_pb2.WorkerLoad(running_seqs=3, total_kv_blocks=128, decode_step_ms=21.5)
    status = ActuatorStatus(
        (
            Instance("decode-0", "decode", "serving", load, tp=2),
            Instance("prefill-0", "prefill", "draining", load),
            Instance("prefill-1", "prefill", "starting"),  # no load reported yet
        ),
        changing=True,
        last_error="FailedPrecondition: decode-0 did not stop",
        changes=7,
    )
    wire = status.to_pb().SerializeToString()
    back = ActuatorStatus.from_pb(planner_pb2.ActuatorStatus.FromString(wire))
    assert back == status
    assert back.instances[2].load is None and back.tp("decode") == 2
    # a degree of 0 on the wire (an older actuator that sets none) reads as 1
    assert Instance.from_pb(planner_pb2.ActuatorInstance(name="d", role="decode")).tp == 1


def test_a_decision_becomes_its_message_with_what_it_was_taken_on():
    load = common_pb2.WorkerLoad(waiting_seqs=4)
    d = Decision(
        "scale",
        "SLO at risk",
        {"prefill": 2, "decode": 1},
        {"prefill": 1, "decode": 2},
        rate=3.8,
        predicted={"current": 0.5, "target": 0.95},
    )
    pb = d.to_pb(
        {"prefill": 1, "decode": 1},
        {"prefill": 1, "decode": 1},
        samples=42,
        decided_unix_s=1000.0,
        advisory=True,
        budget=8,
        load={"decode": load},
    )
    assert (pb.action, pb.reason, dict(pb.target), dict(pb.target_tp)) == (
        "scale",
        "SLO at risk",
        d.counts,
        d.tp,
    )
    assert dict(pb.current) == {"prefill": 1, "decode": 1} and pb.samples == 42
    assert pb.observed_attainment == -1.0 and math.isnan(d.observed)  # none observed
    assert dict(pb.predicted_attainment) == d.predicted and pb.rate_rps == 3.8
    assert (pb.decided_unix_s, pb.advisory, pb.budget) == (1000.0, True, 8)
    assert pb.load["decode"] == load
