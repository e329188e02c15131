"""The planner's control loop: every `interval_s`, what the mesh measures -> a decision
(services/planner/autoscale.py) -> the actuator (services/planner/actuator.py). A surge does
not wait for the next tick: the arrivals are tested as they are reported (at most every
`SURGE_CHECK_S`), and the first with evidence of one ticks at once.

Each tick asks the actuator's status first: while it applies a change, the decision is `wait`;
the moment a change lands starts the cool-down, and which way it went (`direction`: from the
placement the mesh had before it) says what the cool-down holds (a scale-up may continue).
Every decision is a log line (changes at INFO, holds at DEBUG), a span `planner.decide` with its
inputs, predictions and the latency model's correction (`planner.correction.prefill` /
`.decode`), and a count in
`distserve_planner_decisions_total{action}`; the latest is `latest` (what `distserve plan
--watch` prints). Advisory mode decides and reports but never applies.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
from typing import TYPE_CHECKING

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

from services.common import clock, telemetry
from services.common.errors import FailedPrecondition
from services.planner.actuator import Actuator
from services.planner.autoscale import Autoscaler
from services.planner.decision import Decision, View, direction
from services.planner.drift import Arrival, Sample
from services.planner.surge import arrival_rate

if TYPE_CHECKING:
    from services.common.gen.distserve.v1 import planner_pb2

log = logging.getLogger("distserve.planner")

SURGE_CHECK_S = 0.1  # the most often arrivals are tested for a surge between ticks (the
# mesh's seconds): a test costs ~0.1 ms per 1,000 arrivals in the window


class ControlLoop:
    def __init__(
        self,
        autoscaler: Autoscaler,
        actuator: Actuator,
        registry: CollectorRegistry,
        interval_s: float = 1.0,
        pool: str = "default",
        advisory: bool = False,
    ) -> None:
        self.autoscaler, self.actuator = autoscaler, actuator
        self.interval_s, self.pool, self.advisory = interval_s, pool, advisory
        self.samples: collections.deque[Sample] = collections.deque()  # finished requests
        self.arrivals: collections.deque[Arrival] = collections.deque()  # accepted requests
        self._since_s = clock.time_s()  # arrivals are counted from here
        self.latest: Decision | None = None
        self.latest_at_s = math.nan
        self._latest_view: View | None = None
        self._loads: dict = {}  # each role's WorkerLoad, summed (the actuator's status)
        self._changes_seen: int | None = None  # the actuator's count of changes, last tick
        self._was_changing = False
        self._last_change_s = clock.time_s()  # the start counts as a change: none is judged
        # on a window the loop did not see
        self._last_change = ""  # its direction ("": the start)
        self._placed: tuple[dict, dict] | None = None  # the placement as of the last tick at rest
        self._wake = asyncio.Event()  # set by a surge between ticks: tick now
        self._surge_checked_s = -math.inf
        self._unwoken_until_s = -math.inf  # after a surge's tick: the cadence's next is soon
        self.decisions = Counter(
            "distserve_planner_decisions",
            "The planner's decisions on the running mesh, by action (scale, hold, wait).",
            ["action"],
            registry=registry,
        )
        self.target = Gauge(
            "distserve_planner_target_instances",
            "Instances per role the planner's latest decision wants.",
            ["role"],
            registry=registry,
        )
        self.measured_rate = Gauge(
            "distserve_planner_measured_rate_rps",
            "Arrival rate over the planner's window (requests/s, the mesh's clock).",
            registry=registry,
        )

    def observe(self, sample: Sample) -> None:
        """A finished request."""
        self.samples.append(sample)
        horizon = clock.time_s() - self.autoscaler.config.window_s
        while self.samples and self.samples[0].arrival_s < horizon:
            self.samples.popleft()

    def arrived(self, arrival_s: float, prompt_tokens: int) -> None:
        """A request the gateway accepted (at `arrival_s`, the mesh's clock; its prompt's
        length, so a new phase is seen from its arrivals). If the arrivals now show a surge,
        and a decision could act on it (no change in flight, none cooling down), the loop
        ticks at once."""
        self.arrivals.append(Arrival(arrival_s, prompt_tokens))
        now = clock.time_s()
        config = self.autoscaler.config
        while self.arrivals and self.arrivals[0].arrival_s < now - config.window_s:
            self.arrivals.popleft()
        if (
            self._was_changing
            or (now - self._last_change_s < config.cooldown_s and self._last_change != "up")
            or now - self._surge_checked_s < SURGE_CHECK_S
            or now < self._unwoken_until_s
        ):
            return
        self._surge_checked_s = now
        times = (a.arrival_s for a in self.arrivals)
        measured = arrival_rate(times, now, self._since_s, config.window_s, config.surge)
        if measured is not None and measured[1] is not None:
            self._wake.set()

    async def run(self) -> None:
        """A tick every `interval_s` on a fixed cadence (a slow tick, the actuator's status on
        a loaded host, delays the next by what is left of the interval, not by a whole one),
        and one at once when `arrived` sees a surge (the cadence goes on from it)."""
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            due = max(due + clock.wall_seconds(self.interval_s), loop.time())
            try:
                await asyncio.wait_for(self._wake.wait(), due - loop.time())
                due = loop.time()  # a surge: tick now, and let the cadence take the next
                # (a surge no placement can answer does not tick at every arrival)
                self._unwoken_until_s = clock.time_s() + self.interval_s
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.tick()
            except grpc.RpcError as e:  # the actuator away (restarting, or the mesh stopping)
                log.warning("planner tick: the actuator answered %s; next tick retries", e.code())
            except Exception:  # a tick that failed otherwise: the next one retries
                log.exception("planner tick failed")

    async def tick(self) -> Decision:
        status = await asyncio.to_thread(self.actuator.status)
        now = clock.time_s()
        moved = self._changes_seen is not None and status.changes != self._changes_seen
        counts = {r: status.count(r) for r in self.autoscaler.roles}
        degrees = {r: t for r in self.autoscaler.roles if (t := status.tp(r))}
        if not status.changing and (self._was_changing or moved):
            self._last_change_s = now  # a change landed since the last tick: cool down
            before = self._placed or (counts, degrees)
            self._last_change = direction(before[0], counts, before[1], degrees)
        if not status.changing:
            self._placed = (counts, degrees)
        self._was_changing, self._changes_seen = status.changing, status.changes
        view = View(
            now_s=now,
            samples=tuple(self.samples),
            counts=counts,
            tp=degrees,
            in_flight=status.changing,
            last_change_s=self._last_change_s,
            last_change=self._last_change,
            arrivals=tuple(self.arrivals),
            arrivals_since_s=self._since_s,
        )
        self._loads = status.loads()
        span = telemetry.start("planner.decide", None, {"planner.advisory": self.advisory})
        try:
            decision = await asyncio.to_thread(self.autoscaler.decide, view)
            self._latest_view = view
            self._report(decision, span, status.last_error)
            if decision.action == "scale" and not self.advisory:
                await asyncio.to_thread(self._apply, decision)
                self._was_changing = True  # it lands when the status says it is done
        except Exception as e:
            telemetry.fail(span, e)
            raise
        finally:
            span.end()
        return decision

    def _apply(self, decision: Decision) -> None:
        self.actuator.apply(self.pool, decision.counts, decision.reason, decision.tp)

    def _report(self, decision: Decision, span, last_error: str) -> None:
        self.latest, self.latest_at_s = decision, clock.time_s()
        self.decisions.labels(decision.action).inc()
        for role, count in decision.counts.items():
            self.target.labels(role).set(count)
        self.measured_rate.set(decision.rate)
        attributes = {
            "planner.action": decision.action,
            "planner.reason": decision.reason,
            "planner.rate_rps": decision.rate,
            "planner.samples": len(self.samples),
            **{f"planner.target.{r}": n for r, n in decision.counts.items()},
            **{f"planner.target_tp.{r}": t for r, t in decision.tp.items()},
            **{f"planner.predicted.{k}": v for k, v in decision.predicted.items()},
            **{f"planner.correction.{k}": v for k, v in decision.correction.items()},
            **{
                f"planner.load.{role}.{field.name}": value
                for role, load in self._loads.items()
                for field, value in load.ListFields()
            },
        }
        if not math.isnan(decision.observed):
            attributes["planner.observed_attainment"] = decision.observed
        span.set_attributes(attributes)
        if last_error:
            log.warning("the actuator's last change failed: %s", last_error)
        level = logging.INFO if decision.action == "scale" else logging.DEBUG
        verb = "advises" if self.advisory and decision.action == "scale" else "decides"
        log.log(
            level,
            "planner %s %s %s (tp %s): %s (step times x%s of the profile)",
            verb,
            decision.action,
            decision.counts,
            decision.tp,
            decision.reason,
            ", x".join(f"{v:.2f} {k}" for k, v in decision.correction.items()),
        )

    def latest_pb(self) -> planner_pb2.Decision:
        """The latest decision as a `Decision` message (GetDecision), with what it was taken
        on (`Decision.to_pb`)."""
        d, view = self.latest, self._latest_view
        if d is None or view is None:
            raise FailedPrecondition("no decision yet: the first comes after one interval")
        config = self.autoscaler.config
        return d.to_pb(
            view.counts,
            {r: view.tp.get(r) or self.autoscaler.tp[r] for r in view.counts},
            samples=sum(1 for s in view.samples if s.arrival_s >= view.now_s - config.window_s),
            decided_unix_s=self.latest_at_s,
            advisory=self.advisory,
            budget=config.budget,
            load=self._loads,
        )
