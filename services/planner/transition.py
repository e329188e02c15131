"""How a running mesh goes from its instances to a placement's, one step at a time
(`transition`): the surplus drains first, then what is missing starts, an instance of another
tensor degree draining to make room where the budget is full, never leaving a role that has an
instance without one. The autoscaler asks it whether a placement is reachable at all
(services/planner/autoscale.py); the local actuator follows its steps
(distserve/local_actuator.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from services.common.errors import FailedPrecondition


@dataclass(frozen=True)
class Step:
    """One step of a change: `drain` the instance `name`, or `start` one of `role` at `tp`."""

    action: str  # "drain" or "start"
    role: str
    tp: int
    name: str = ""  # the instance drained


def transition(
    instances: list[tuple[str, str, int]],
    counts: Mapping[str, int],
    tp: Mapping[str, int],
    budget: int,
) -> list[Step]:
    """The steps from `instances` ((name, role, tp), the first drained first where there is a
    choice) to `counts` instances per role at degree `tp[role]` (roles not in `counts` keep
    theirs), never over `budget` devices (0: none) and never leaving a role that has an
    instance without one: the surplus drains first; then each missing instance starts,
    once an instance of another degree has drained to make room for it where the budget is
    full (one whose role keeps another instance meanwhile). FailedPrecondition when the budget
    leaves no such order (a role of one instance re-sharded with no room beside it)."""
    live = {name: (role, degree) for name, role, degree in instances}
    order = [name for name, _, _ in instances]
    steps: list[Step] = []

    def drain(name: str) -> None:
        role, degree = live.pop(name)
        steps.append(Step("drain", role, degree, name))

    def of(role: str, degree: int | None = None) -> list[str]:
        """`role`'s live instances (of `degree`, if given), in order."""
        return [
            n
            for n in order
            if n in live and live[n][0] == role and (degree is None or live[n][1] == degree)
        ]

    for role, count in counts.items():
        same = of(role, tp[role])
        for name in same[: max(0, len(same) - count)]:
            drain(name)
    old = [n for n in order if n in live and live[n][0] in counts and live[n][1] != tp[live[n][0]]]
    started = 0
    for role, count in counts.items():
        while len(of(role, tp[role])) < count:
            used = sum(degree for _, degree in live.values())
            if budget and used + tp[role] > budget:
                spare = [n for n in old if n in live and len(of(live[n][0])) > 1]
                spare.sort(key=lambda n: live[n][0] != role)  # this role's own first
                if not spare:
                    raise FailedPrecondition(
                        f"{role} at tp {tp[role]}: no room in a budget of {budget} devices "
                        f"beside the {used} in use, and every instance that could make room is "
                        "its role's last (a role is never left without one): raise the budget "
                        "or re-shard by hand"
                    )
                drain(spare[0])
                continue
            started += 1
            live[f"+{role}-{started}"] = (role, tp[role])
            order.append(f"+{role}-{started}")
            steps.append(Step("start", role, tp[role]))
    for name in old:
        if name in live:
            drain(name)
    return steps
