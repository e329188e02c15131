"""A discrete-event simulator of a serving cluster: per-request TTFT and TPOT from a latency model.

Disaggregated clusters (prefill and decode instances) and colocated ones (vLLM-style instances
doing both) of any size. What it models, and what it leaves out:

* Prefill instances: one FCFS queue each; the router sends a request to the instance with the
  fewest prompt tokens queued or in prefill. A batch takes prompts from the head while their
  tokens fit `L_m` (`max_batch_tokens`; a longer prompt runs alone) and at most
  `max_batch_size` of them (1 turns batching off). With pipeline degree pp the batch passes pp
  stages of `prefill / pp + hop`; a new batch enters stage 0 as soon as stage 0 is free. The
  first token comes out of the last stage.
* Decode instances: continuous batching, one token per running request per iteration. The router
  sends a prefilled request (colocated: a new one) to the instance with the fewest requests routed
  there and not finished, then the most KV not reserved by those it runs, as the gateway does. A
  request is admitted FCFS when its whole context (prompt + output) fits the free KV capacity and
  a seat is free (no preemption: the engine also reserves a request's growth when admitting it);
  then its KV is transferred (bytes / link bandwidth, transfers into an instance one after
  another) and it joins at the next iteration boundary, `handoff_s` after its KV is in place. With
  the mesh's layer-wise handoff (`layerwise_min_tokens`), a prompt that long waits for its
  seat and memory from the moment its prefill batch starts, and its transfer runs beside the
  prefill (it ends no earlier than the prefill), and serving it adds `layerwise_prefill_s` to
  the prefill batch. An instance of pipeline degree pp runs pp micro-batches ("lanes", each with
  1/pp of the capacity and seats), each iterating at the whole-model latency: the stages are then
  all busy, as in a balanced pipeline.
* Colocated instances (the baseline): vLLM's policy per lane: at each iteration boundary, if the
  waiting head fits in memory, run a prefill batch (up to L_m tokens) and stall decoding,
  else one decode iteration for every running request.
* Every iteration (prefill batch, decode step, colocated either) pays the engine's overhead
  beyond the model, `LatencyModel.iteration_overhead_ms` plus `..._per_token` times its prompt
  tokens or context (a prefill batch in its first stage only, as DistServe's simulator does).
* Not modelled: prefill-side memory (held KV waiting for a decode slot), network contention
  between instances, preemption, failures.

Speed: an event is an iteration boundary where something changes, not a token. Between two
such boundaries a lane's batch is fixed, so n iterations take, in closed form,
`n * (a + c*B + b*S) + b*B*n*(n-1)/2` (B: batch size; S: total context, growing by B per
iteration).

A cluster with no decode instance simulates the prefill phase alone (TPOT 0); one with no prefill
instance the decode phase alone (requests arrive with their KV in place, TTFT 0).

Why one file (~600 lines): one discrete-event simulation; its prefill batcher, decode batches,
handoff and routing advance on one clock and one event queue.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass
from heapq import heappop, heappush

import numpy as np

from services.common.errors import InvalidRequest
from services.common.latency import LatencyModel, TpLatency
from services.common.slo import Slo
from services.planner.workload import Requests

ROLES = ("prefill", "decode", "colocated")
_ARRIVAL, _STAGE0_FREE, _BATCH_DONE, _JOIN, _WAKE = range(5)


@dataclass(frozen=True)
class Instance:
    """One model replica in a simulated cluster."""

    role: str  # one of ROLES
    tp: int = 1
    pp: int = 1
    kv_capacity: int = 2**40  # tokens of KV it holds (decode and colocated)
    max_batch_tokens: int = 2048  # L_m (prefill and colocated)
    max_batch_size: int = 0  # prompts per prefill batch; 0: no limit, 1: batching off
    max_num_seqs: int = 256  # running requests (decode and colocated)
    nodes: tuple[int, ...] = (0,)  # the node of each pipeline stage

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InvalidRequest(f"instance role {self.role!r}: choose one of {ROLES}")
        if self.tp < 1 or self.pp < 1 or self.max_batch_tokens < 1 or self.max_num_seqs < self.pp:
            raise InvalidRequest("instance: tp, pp, max_batch_tokens >= 1, max_num_seqs >= pp")


@dataclass(frozen=True)
class SimCluster:
    """Instances and what they run on. `colocated_latency` times colocated instances (DistServe
    publishes a separate fit for vLLM); by default `latency` does."""

    instances: tuple[Instance, ...]
    latency: LatencyModel
    kv_bytes_per_token: int = 0
    intra_node_bandwidth: float = 300e9  # bytes/s
    inter_node_bandwidth: float = 25e9 / 8
    colocated_latency: LatencyModel | None = None
    # Prompts of at least this many tokens go to a decode instance when their prefill batch
    # starts (the mesh's layer-wise handoff); None: after prefill, as in DistServe.
    layerwise_min_tokens: int | None = None
    handoff_s: float = 0.0  # from the KV in place to joining the decode batch
    # prefill time added per prompt whose KV is served beside its prefill (the instance's share
    # of the work of serving the pull while it computes)
    layerwise_prefill_s: float = 0.0

    def transfer_bandwidth(self, p: Instance, d: Instance) -> float:
        """KV moves stage by stage: in parallel over each node's links when stage k of both
        instances is on the same node (or both are wholly on one node), else over the network."""
        if p.nodes == d.nodes:
            return self.intra_node_bandwidth * len(set(p.nodes))
        if len(set(p.nodes) | set(d.nodes)) == 1:
            return self.intra_node_bandwidth
        return self.inter_node_bandwidth


@dataclass(frozen=True)
class SimResult:
    """Per request (in arrival order): TTFT and TPOT in seconds."""

    ttft: np.ndarray
    tpot: np.ndarray

    def attainment(self, slo: Slo, first: int = 0) -> float:
        """Fraction of requests (from the `first`) meeting both SLOs."""
        ok = slo.met(self.ttft[first:], self.tpot[first:])
        return float(np.mean(ok))

    def __len__(self) -> int:
        return len(self.ttft)


def simulate(cluster: SimCluster, requests: Requests, until: int | None = None) -> SimResult:
    """Run the requests through the cluster and return the first `until` (default: all).

    The run stops once those have finished, while later arrivals still load the cluster: with a
    tail of extra requests, the measured ones never see the cluster drain.
    """
    return _Sim(cluster, requests, len(requests) if until is None else until).run()


def simulate_1p1d(
    latency: LatencyModel,
    requests: Requests,
    *,
    kv_bytes_per_token: int,
    kv_capacity: int,
    max_batch_tokens: int,
    max_num_seqs: int,
    bandwidth: float,
    layerwise_min_tokens: int | None = None,
    handoff_s: float = 0.0,
    layerwise_prefill_s: float = 0.0,
) -> SimResult:
    """One prefill and one decode instance on one host (tp = pp = 1), KV over `bandwidth` bytes/s:
    the shape of `distserve up --prefill 1 --decode 1`, for checking the simulator against it."""
    cluster = SimCluster(
        instances=(
            # The prefill worker's batcher caps prompts per batch at its max_num_seqs too.
            Instance("prefill", max_batch_tokens=max_batch_tokens, max_batch_size=max_num_seqs),
            Instance("decode", kv_capacity=kv_capacity, max_num_seqs=max_num_seqs),
        ),
        latency=latency,
        kv_bytes_per_token=kv_bytes_per_token,
        intra_node_bandwidth=bandwidth,
        layerwise_min_tokens=layerwise_min_tokens,
        handoff_s=handoff_s,
        layerwise_prefill_s=layerwise_prefill_s,
    )
    return simulate(cluster, requests)


# -- machinery ---------------------------------------------------------------------------------


class _Prefill:
    """A prefill instance: FCFS queue and its pipeline stages."""

    __slots__ = (
        "busy",
        "coeffs",
        "index",
        "iteration",
        "max_size",
        "max_tokens",
        "overhead",
        "pp",
        "queue",
        "queued_tokens",
        "stage_free",
    )

    def __init__(
        self, index: int, inst: Instance, lat: TpLatency, overhead_s: float, iteration: tuple
    ) -> None:
        self.index = index
        self.pp = inst.pp
        p = lat.prefill
        self.coeffs = (p.a / 1000 / inst.pp, p.b / 1000 / inst.pp, p.c / 1000 / inst.pp)
        self.overhead = overhead_s
        self.iteration = iteration  # (s, s per prompt token): paid once, in the first stage
        self.max_tokens = inst.max_batch_tokens
        self.max_size = inst.max_batch_size or 2**62
        self.queue: deque[int] = deque()
        self.queued_tokens = 0
        self.stage_free = [0.0] * inst.pp
        self.busy = False


class _Lane:
    """A continuous batch: one decode micro-batch, or one colocated engine."""

    __slots__ = (
        "batch",
        "busy",
        "coeffs",
        "colocated",
        "context",
        "free",
        "index",
        "inflight",
        "joiners",
        "k",
        "link_free",
        "max_tokens",
        "n_sched",
        "open",
        "overhead",
        "pending",
        "prefill_coeffs",
        "running",
        "seats",
        "size",
        "threshold",
        "tk",
        "version",
    )

    def __init__(
        self, index: int, inst: Instance, lat: TpLatency, overhead_s: float, iteration: tuple
    ) -> None:
        self.index = index
        self.colocated = inst.role == "colocated"
        s, g = lat.decode_small, lat.decode_large
        o, ot = iteration  # the engine's per-iteration overhead: (s, s per token)
        # seconds: (a, b per context token, c per sequence) for small and large batches
        self.coeffs = tuple((x.a / 1000 + o, x.b / 1000 + ot, x.c / 1000) for x in (s, g))
        self.threshold = lat.threshold
        p = lat.prefill
        self.prefill_coeffs = (p.a / 1000 + o, p.b / 1000 + ot, p.c / 1000)
        self.overhead = overhead_s * inst.pp  # a colocated prefill passes every stage
        self.max_tokens = inst.max_batch_tokens
        self.free = inst.kv_capacity // inst.pp
        self.seats = inst.max_num_seqs // inst.pp
        self.size = 0  # running requests (B)
        self.context = 0  # their total context in the next iteration (S)
        self.k = 0  # iterations done at the last synchronised boundary
        self.tk = 0.0  # time of that boundary
        self.n_sched = 0  # iterations until the scheduled wake-up
        self.busy = False
        self.batch: list[int] | None = None  # the prefill batch in progress (colocated)
        self.version = 0  # invalidates superseded wake-ups
        self.running: list[tuple[int, int]] = []  # heap of (finishing iteration, request)
        self.joiners: list[int] = []  # requests whose KV arrived, waiting for a boundary
        self.pending: deque[int] = deque()  # decode: waiting for memory; colocated: for prefill
        self.inflight = 0  # decode: admitted, KV in transfer
        self.open = 0  # requests routed here and not finished (the router's measure)
        self.link_free = 0.0  # decode: when the inbound link is next free

    def span(self, n: int) -> float:
        """Seconds for the next n iterations of the current batch."""
        size = self.size
        a, b, c = self.coeffs[size >= self.threshold]
        return n * (a + c * size + b * self.context) + b * size * n * (n - 1) / 2

    def iterations_within(self, dt: float) -> int:
        """The smallest n >= 1 whose n iterations end at or after dt from the last boundary."""
        size = self.size
        a, b, c = self.coeffs[size >= self.threshold]
        d0 = a + c * size + b * self.context
        h = b * size / 2
        if h > 0:
            n = math.ceil((-(d0 - h) + math.sqrt((d0 - h) ** 2 + 4 * h * dt)) / (2 * h))
        else:
            n = math.ceil(dt / d0) if d0 > 0 else 1
        n = max(1, n)
        while n > 1 and self.span(n - 1) >= dt:
            n -= 1
        while self.span(n) < dt:
            n += 1
        return n


class _Sim:
    def __init__(self, cluster: SimCluster, requests: Requests, until: int) -> None:
        roles = {i.role for i in cluster.instances}
        if not roles or ("colocated" in roles and len(roles) > 1):
            raise InvalidRequest("a cluster is all colocated, or prefill and/or decode instances")
        self.arrival = requests.arrival_s.tolist()
        self.prompt = requests.prompt.tolist()
        self.output = requests.output.tolist()
        n = len(self.arrival)
        self.first = [0.0] * n
        self.finish = [0.0] * n
        self.source = [0] * n  # the prefill instance of each request
        self.ready = [0.0] * n  # when its prefill ends (known when its batch starts)
        least = cluster.layerwise_min_tokens
        self.layerwise_min = (
            2**62 if least is None else least
        )  # set again below without decode lanes
        self.handoff = cluster.handoff_s
        self.until = until
        self.remaining = until  # of the first `until` requests, those not finished
        self.events: list[tuple] = []
        self.counter = itertools.count()  # breaks ties between events of equal time
        ov = cluster.latency.stage_overhead_ms / 1000

        def iteration(model: LatencyModel) -> tuple[float, float]:
            return model.iteration_overhead_ms / 1000, model.iteration_overhead_ms_per_token / 1000

        self.prefills: list[_Prefill] = []
        self.lanes: list[_Lane] = []
        prefill_insts, lane_insts = [], []
        for inst in cluster.instances:
            if inst.role == "prefill":
                lat = cluster.latency.at(inst.tp)
                self.prefills.append(
                    _Prefill(len(self.prefills), inst, lat, ov, iteration(cluster.latency))
                )
                prefill_insts.append(inst)
                continue
            model = cluster.latency
            if inst.role == "colocated" and cluster.colocated_latency is not None:
                model = cluster.colocated_latency
            for _ in range(inst.pp):
                self.lanes.append(
                    _Lane(len(self.lanes), inst, model.at(inst.tp), ov, iteration(model))
                )
                lane_insts.append(inst)
        self.colocated = "colocated" in roles
        self.layerwise_cost = cluster.layerwise_prefill_s
        if not self.lanes:  # nothing is handed off
            self.layerwise_min, self.layerwise_cost = 2**62, 0.0
        self.decode_only = not self.prefills and not self.colocated
        # seconds per prompt token of KV, per (prefill instance, decode lane)
        kvb = cluster.kv_bytes_per_token
        self.transfer = [
            [kvb / cluster.transfer_bandwidth(p, d) for d in lane_insts] for p in prefill_insts
        ]
        if self.lanes:
            too_big = requests.prompt + requests.output > max(lane.free for lane in self.lanes)
            if too_big.any():
                i = int(np.argmax(too_big))
                raise InvalidRequest(
                    f"request {i} ({self.prompt[i]} + {self.output[i]} tokens) fits no "
                    f"instance's KV capacity; {int(too_big.sum())} such requests"
                )

    def run(self) -> SimResult:
        arrivals = self.arrival
        n = len(arrivals)
        events = self.events
        i = 0
        pop = heappop
        while self.remaining and (i < n or events):
            if i < n and (not events or arrivals[i] <= events[0][0]):
                self.on_arrival(i, arrivals[i])
                i += 1
                continue
            t, _, kind, a, b = pop(events)
            if kind == _WAKE:
                if b == a.version:
                    self.on_wake(a, t)
            elif kind == _JOIN:
                self.on_join(a, b, t)
            elif kind == _BATCH_DONE:
                self.on_batch_done(a, b, t)
            else:
                a.busy = False
                if a.queue:
                    self.start_batch(a, t)
        m = self.until
        first = np.array(self.first[:m])
        finish = np.array(self.finish[:m])
        out = np.array(self.output[:m])
        ttft = first - np.array(arrivals[:m])
        tpot = np.where(out > 1, (finish - first) / np.maximum(out - 1, 1), 0.0)
        return SimResult(ttft, tpot)

    # -- prefill instances ---------------------------------------------------------------------

    def on_arrival(self, i: int, t: float) -> None:
        if self.colocated or self.decode_only:
            if self.decode_only:
                self.first[i] = t
            lane = min(self.lanes, key=_least_loaded)
            lane.open += 1
            lane.pending.append(i)
            self.kick(lane, t)
            return
        p = min(self.prefills, key=_queued) if len(self.prefills) > 1 else self.prefills[0]
        p.queue.append(i)
        p.queued_tokens += self.prompt[i]
        if not p.busy:
            self.start_batch(p, t)

    def start_batch(self, p: _Prefill, t: float) -> None:
        queue, prompt = p.queue, self.prompt
        batch = [queue.popleft()]
        tokens = prompt[batch[0]]
        squares = tokens * tokens
        while queue and len(batch) < p.max_size and tokens + prompt[queue[0]] <= p.max_tokens:
            j = queue.popleft()
            batch.append(j)
            tokens += prompt[j]
            squares += prompt[j] * prompt[j]
        a, b, c = p.coeffs
        stage = a + b * tokens + c * squares + p.overhead
        # handed to a decode instance now, KV pulled beside the prefill (the layer-wise handoff)
        layerwise = [i for i in batch if prompt[i] >= self.layerwise_min and self.output[i] > 1]
        stage += len(layerwise) * self.layerwise_cost / p.pp
        free = p.stage_free
        end = max(t, free[0]) + stage + p.iteration[0] + p.iteration[1] * tokens
        free[0] = end
        for s in range(1, p.pp):
            end = max(end, free[s]) + stage
            free[s] = end
        p.busy = True
        for i in batch:
            self.ready[i] = end
        for i in layerwise:
            self.route(p, i, t)
        if p.pp > 1:
            heappush(self.events, (free[0], next(self.counter), _STAGE0_FREE, p, None))
            heappush(self.events, (end, next(self.counter), _BATCH_DONE, p, batch))
        else:
            heappush(self.events, (end, next(self.counter), _BATCH_DONE, p, batch))

    def on_batch_done(self, p: _Prefill, batch: list[int], t: float) -> None:
        first, output, finish = self.first, self.output, self.finish
        lanes = self.lanes
        for i in batch:
            p.queued_tokens -= self.prompt[i]
            first[i] = t
            if output[i] == 1 or not lanes:
                finish[i] = t
                if i < self.until:
                    self.remaining -= 1
            elif self.prompt[i] < self.layerwise_min:
                self.route(p, i, t)
        if p.pp == 1:
            p.busy = False
            if p.queue:
                self.start_batch(p, t)

    # -- decode lanes --------------------------------------------------------------------------

    def route(self, p: _Prefill, i: int, t: float) -> None:
        """Hand request i, prefilled on p, to the least-loaded decode lane."""
        lanes = self.lanes
        lane = min(lanes, key=_least_loaded) if len(lanes) > 1 else lanes[0]
        lane.open += 1
        lane.pending.append(i)
        self.source[i] = p.index
        self.admit(lane, t)

    def admit(self, lane: _Lane, t: float) -> None:
        """Give waiting requests memory, FCFS, and start their KV transfers."""
        pending, prompt, output, source = lane.pending, self.prompt, self.output, self.source
        while pending:
            i = pending[0]
            need = prompt[i] + output[i]
            if need > lane.free or lane.size + lane.inflight + len(lane.joiners) >= lane.seats:
                return
            pending.popleft()
            lane.free -= need
            lane.inflight += 1
            start = lane.link_free if lane.link_free > t else t
            lane.link_free = start + prompt[i] * self.transfer[source[i]][lane.index]
            ready = self.ready[i]
            join = (lane.link_free if lane.link_free > ready else ready) + self.handoff
            heappush(self.events, (join, next(self.counter), _JOIN, lane, i))

    def on_join(self, lane: _Lane, i: int, t: float) -> None:
        lane.inflight -= 1
        lane.joiners.append(i)
        if not lane.busy:
            lane.tk = t
            self.on_wake(lane, t, synced=True)
        elif len(lane.joiners) == 1 and lane.batch is None:
            self.wake_at_next_boundary(lane, t)

    def wake_at_next_boundary(self, lane: _Lane, t: float) -> None:
        n = lane.iterations_within(t - lane.tk)
        if n < lane.n_sched:
            lane.version += 1
            lane.n_sched = n
            heappush(
                self.events, (lane.tk + lane.span(n), next(self.counter), _WAKE, lane, lane.version)
            )

    def kick(self, lane: _Lane, t: float) -> None:
        """A request queued at a colocated or decode-only lane: start it now if the lane is
        idle, or at the next boundary if it fits."""
        if not lane.busy:
            lane.tk = t
            self.on_wake(lane, t, synced=True)
        elif lane.batch is None and len(lane.pending) == 1:
            i = lane.pending[0]
            if self.prompt[i] + self.output[i] <= lane.free and lane.size < lane.seats:
                self.wake_at_next_boundary(lane, t)

    def on_wake(self, lane: _Lane, t: float, synced: bool = False) -> None:
        if not synced:
            if lane.batch is not None:
                self.end_prefill(lane, t)
            else:
                n = lane.n_sched
                lane.context += n * lane.size
                lane.k += n
            lane.tk = t
        k = lane.k
        running = lane.running
        prompt, output, finish = self.prompt, self.output, self.finish
        while running and running[0][0] <= k:
            _, i = heappop(running)
            finish[i] = t
            if i < self.until:
                self.remaining -= 1
            need = prompt[i] + output[i]
            lane.free += need
            lane.open -= 1
            lane.size -= 1
            lane.context -= need
        for i in lane.joiners:
            lane.size += 1
            lane.context += prompt[i] + 1
            heappush(running, (k + output[i] - 1, i))
        lane.joiners.clear()
        if lane.pending:
            if self.colocated:
                if self.start_prefill(lane, t):
                    return
            elif self.decode_only:
                self.admit_in_place(lane)
            else:
                self.admit(lane, t)
        if lane.size:
            lane.n_sched = running[0][0] - k
            lane.version += 1
            lane.busy = True
            heappush(
                self.events,
                (t + lane.span(lane.n_sched), next(self.counter), _WAKE, lane, lane.version),
            )
        else:
            lane.busy = False

    def admit_in_place(self, lane: _Lane) -> None:
        """Decode phase alone: waiting requests join, FCFS, while memory and seats allow."""
        pending, prompt, output = lane.pending, self.prompt, self.output
        while pending:
            i = pending[0]
            need = prompt[i] + output[i]
            if need > lane.free or lane.size >= lane.seats:
                return
            pending.popleft()
            lane.free -= need
            lane.size += 1
            lane.context += prompt[i] + 1
            heappush(lane.running, (lane.k + output[i] - 1, i))

    def start_prefill(self, lane: _Lane, t: float) -> bool:
        """Colocated: prefill the waiting prompts that fit (memory, seats, L_m) as one batch,
        stalling decode until it ends. False when the head does not fit."""
        pending, prompt, output = lane.pending, self.prompt, self.output
        batch: list[int] = []
        tokens = squares = 0
        while pending:
            i = pending[0]
            need = prompt[i] + output[i]
            if need > lane.free or lane.size + len(batch) >= lane.seats:
                break
            if batch and tokens + prompt[i] > lane.max_tokens:
                break
            pending.popleft()
            lane.free -= need
            batch.append(i)
            tokens += prompt[i]
            squares += prompt[i] * prompt[i]
        if not batch:
            return False
        a, b, c = lane.prefill_coeffs
        lane.batch = batch
        lane.busy = True
        lane.version += 1
        heappush(
            self.events,
            (
                t + a + b * tokens + c * squares + lane.overhead,
                next(self.counter),
                _WAKE,
                lane,
                lane.version,
            ),
        )
        return True

    def end_prefill(self, lane: _Lane, t: float) -> None:
        first, output, prompt, finish = self.first, self.output, self.prompt, self.finish
        for i in lane.batch:
            first[i] = t
            if output[i] == 1:
                finish[i] = t
                if i < self.until:
                    self.remaining -= 1
                lane.free += prompt[i] + 1
                lane.open -= 1
            else:
                lane.joiners.append(i)
        lane.batch = None


def _least_loaded(lane: _Lane) -> tuple[int, int, int]:
    """The gateway's rule (`Routing.pick_decode`): the fewest requests routed there and not
    finished, then the most KV not reserved by those it runs (prompt + output), then the
    first."""
    return lane.open, -lane.free, lane.index


def _queued(p: _Prefill) -> int:
    return p.queued_tokens
