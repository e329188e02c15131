"""The steps from a mesh's instances to a placement's (services/planner/transition.py): the
new degree starts before the old drains where the budget has room, the surplus drains first,
and no order that would leave a role without an instance is given."""

from __future__ import annotations

import pytest

from services.common.errors import FailedPrecondition
from services.planner.transition import transition


def test_transition_starts_the_new_degree_before_the_old_drains_within_the_budget():
    live = [("prefill-0", "prefill", 1), ("decode-0", "decode", 1)]
    steps = transition(live, {"decode": 1}, {"decode": 2}, budget=4)
    assert [(s.action, s.role, s.tp, s.name) for s in steps] == [
        ("start", "decode", 2, ""),
        ("drain", "decode", 1, "decode-0"),
    ]
    # no budget at all: the same order
    assert transition(live, {"decode": 1}, {"decode": 2}, budget=0) == steps
    # two old instances and room for one new beside them only once one has gone: one drains
    # first (the role keeps the other), the new starts, the other drains
    live = [("decode-0", "decode", 1), ("decode-1", "decode", 1), ("prefill-0", "prefill", 1)]
    steps = transition(live, {"decode": 1}, {"decode": 2}, budget=4)
    assert [(s.action, s.name or s.tp) for s in steps] == [
        ("drain", "decode-0"),
        ("start", 2),
        ("drain", "decode-1"),
    ]
    # the surplus drains before anything starts (a role change within the budget), the first
    # listed (the least busy) first
    live = [("prefill-1", "prefill", 1), ("prefill-0", "prefill", 1), ("decode-0", "decode", 1)]
    steps = transition(live, {"prefill": 1, "decode": 2}, {"prefill": 1, "decode": 1}, 3)
    assert [(s.action, s.name or s.role) for s in steps] == [
        ("drain", "prefill-1"),
        ("start", "decode"),
    ]


def test_transition_refuses_to_leave_a_role_without_an_instance():
    live = [("prefill-0", "prefill", 1), ("decode-0", "decode", 1)]
    with pytest.raises(FailedPrecondition, match="decode at tp 2: no room in a budget of 3"):
        transition(live, {"decode": 1}, {"decode": 2}, budget=3)
