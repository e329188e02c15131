"""Placement: parallelism per phase, replica counts and the node of every GPU (DistServe §4).

* High node affinity (Algorithm 1: the network between nodes is fast enough to move KV): each
  phase's configuration (tp, pp) is searched on its own, by the per-device goodput of one
  instance simulating that phase alone; then each is replicated, `n = ceil(R / g)` for a target
  rate R, or in the proportion that fills the cluster.
* Low node affinity (Algorithm 2: KV must stay inside a node): a unit of `n_p` prefill and `n_d`
  decode instances of the same pipeline degree pp, where stage k of every instance in the unit is
  on the unit's k-th node, so KV moves over the node's links stage by stage. (tp_p, n_p, tp_d,
  n_d, pp) are enumerated jointly and each unit simulated whole; candidates are visited from the
  best upper bound (the phases' own goodputs) down, and skipped once the bound falls below the
  best unit found (a branch and bound: same answer, fewer simulations).
* The colocated baseline: the best (tp, pp) of vLLM-style instances on the same cluster, so every
  plan states its ratio over colocated.

Every configuration respects memory (weights plus the longest request's KV), tp dividing the
heads and fitting a node, pp dividing the layers, and the cluster's GPUs. The predicted goodput of
a placement is that of the whole placement, simulated with both SLOs.

Why one file (~530 lines): DistServe's two placement algorithms and the colocated baseline
search the same space with the same simulator and memory rules; where instances land on nodes
is services/planner/mapping.py, how a goodput is estimated services/planner/goodput.py.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

from services.common.errors import InvalidRequest
from services.common.latency import LatencyModel
from services.common.model_spec import ModelSpec
from services.common.slo import Slo
from services.planner.cluster import ClusterSpec, divisors, kv_capacity, parallel_problem
from services.planner.estimate import GoodputEstimate
from services.planner.goodput import capacity, goodput, refine
from services.planner.mapping import InstancePlacement, first_fit, unit_mapping
from services.planner.simulator import Instance, SimCluster
from services.planner.workload import TraceWorkload, Workload

AFFINITIES = ("auto", "high", "low")
# Pruning: a configuration's simulated goodput may exceed its analytic capacity (from mean
# lengths) by this much, and a unit's joint goodput its phases' goodputs (pooling over instances).
CAPACITY_SLACK = 1.5
POOLING_SLACK = 1.25


@dataclass(frozen=True)
class PlanSpec:
    """Everything a placement search needs. `rate` None: use the whole cluster."""

    model: ModelSpec
    cluster: ClusterSpec
    workload: Workload | TraceWorkload
    slo: Slo
    latency: LatencyModel  # the disaggregated engine's
    colocated_latency: LatencyModel  # the colocated baseline's
    alpha: float = 0.9
    rate: float | None = None
    affinity: str = "auto"
    max_num_seqs: int = 256  # running requests per decode or colocated instance
    num_requests: int = 1000  # simulated per instance in each goodput probe of the search
    seed: int = 0
    # The two placements a plan reports (the chosen one and the colocated baseline) are
    # simulated again until each 95% interval's half-width is within `precision` of its
    # goodput, or each has simulated `refine_requests` more requests. None: the search's quick
    # estimates, as they come.
    precision: float | None = 0.01
    refine_requests: int = 400_000
    # The largest pipeline degree to consider; None: any (DistServe's search). The mesh's
    # workers implement tensor parallelism only, so plans to deploy use 1.
    max_pp: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.alpha <= 1:
            raise InvalidRequest(f"attainment must be in (0, 1], got {self.alpha}", "attainment")
        if self.rate is not None and not 0 < self.rate < math.inf:
            raise InvalidRequest(f"rate must be positive and finite, got {self.rate}", "rate")
        if not (0 < self.slo.ttft_s < math.inf and 0 < self.slo.tpot_s < math.inf):
            raise InvalidRequest(
                f"the SLO's latencies must be positive and finite, got TTFT {self.slo.ttft_s} s "
                f"and TPOT {self.slo.tpot_s} s",
                param="slo",
            )
        if self.affinity not in AFFINITIES:
            raise InvalidRequest(f"affinity must be one of {AFFINITIES}", param="affinity")
        if self.max_pp is not None and self.max_pp < 1:
            raise InvalidRequest(f"max_pp must be >= 1, got {self.max_pp}", param="max_pp")
        if self.precision is not None and not 0 < self.precision < 1:
            raise InvalidRequest(
                f"precision must be in (0, 1), got {self.precision}", param="precision"
            )
        if self.refine_requests < 0:
            raise InvalidRequest(
                f"refine_requests must be >= 0, got {self.refine_requests}", "refine_requests"
            )


@dataclass(frozen=True)
class PhasePlan:
    """A phase's configuration: instances of (tp, pp), and one instance's goodput alone."""

    role: str
    tp: int
    pp: int
    replicas: int
    instance_estimate: GoodputEstimate  # one instance, this phase alone (colocated: both)

    @property
    def instance_goodput(self) -> float:
        return self.instance_estimate.rate

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.replicas

    def to_json(self) -> dict:
        return {
            "tp": self.tp,
            "pp": self.pp,
            "replicas": self.replicas,
            "instance_goodput_rps": round(self.instance_goodput, 4),
            "instance_goodput": self.instance_estimate.to_json(),
        }


@dataclass(frozen=True)
class Placement:
    """Where every instance runs, and the goodput the simulator predicts for the whole."""

    algorithm: str  # high-affinity | low-affinity | colocated | single-host
    phases: tuple[PhasePlan, ...]
    instances: tuple[InstancePlacement, ...]
    estimate: GoodputEstimate  # req/s meeting both SLOs at the attainment target

    @property
    def goodput(self) -> float:
        return self.estimate.rate

    @property
    def num_gpus(self) -> int:
        return sum(i.tp * i.pp for i in self.instances)

    @property
    def per_device(self) -> float:
        return self.goodput / self.num_gpus if self.num_gpus else 0.0

    def phase(self, role: str) -> PhasePlan | None:
        return next((p for p in self.phases if p.role == role), None)

    def to_json(self) -> dict:
        return {
            "algorithm": self.algorithm,
            "phases": {p.role: p.to_json() for p in self.phases},
            "num_gpus": self.num_gpus,
            "goodput_rps": round(self.goodput, 4),
            "goodput_per_gpu_rps": round(self.per_device, 4),
            "goodput": self.estimate.to_json(),
            "instances": [i.to_json() for i in self.instances],
        }


@dataclass(frozen=True)
class Plan:
    """The chosen placement beside the colocated baseline's best on the same cluster."""

    placement: Placement
    colocated: Placement
    spec: PlanSpec
    search_seconds: float  # the search, on quick estimates
    candidates: dict = field(default_factory=dict)  # per algorithm: its best placement
    plan_seconds: float = 0.0  # the search and the refinement of the two reported placements

    @property
    def ratio(self) -> float:
        base = self.colocated.per_device
        return self.placement.per_device / base if base > 0 else math.inf

    def to_json(self) -> dict:
        s = self.spec
        return {
            "model": s.model.name,
            "cluster": {
                "nodes": s.cluster.nodes,
                "gpus_per_node": s.cluster.gpus_per_node,
                "intra_node_gb_s": s.cluster.intra_node_bandwidth / 1e9,
                "inter_node_gb_s": s.cluster.inter_node_bandwidth / 1e9,
            },
            "workload": s.workload.name,
            "slo_ms": {"ttft": s.slo.ttft_s * 1000, "tpot": s.slo.tpot_s * 1000},
            "attainment": s.alpha,
            "rate": s.rate,
            "latency_source": s.latency.source,
            "colocated_latency_source": s.colocated_latency.source,
            "iteration_overhead_ms": {
                "latency": [
                    s.latency.iteration_overhead_ms,
                    s.latency.iteration_overhead_ms_per_token,
                ],
                "colocated_latency": [
                    s.colocated_latency.iteration_overhead_ms,
                    s.colocated_latency.iteration_overhead_ms_per_token,
                ],
            },  # [ms per iteration, ms per token], added to the fits
            "placement": self.placement.to_json(),
            "colocated": self.colocated.to_json(),
            "ratio_over_colocated": round(self.ratio, 4) if math.isfinite(self.ratio) else None,
            "candidates": {k: v.to_json() for k, v in self.candidates.items()},
            "search_seconds": round(self.search_seconds, 3),
            "plan_seconds": round(self.plan_seconds, 3),
            "precision": s.precision,
            "refine_requests": s.refine_requests,
        }


def plan(spec: PlanSpec) -> Plan:
    """The best disaggregated placement for the spec, and the colocated baseline's."""
    start = time.perf_counter()
    search = _Search(spec)
    candidates: dict[str, Placement] = {}
    if spec.affinity in ("auto", "high"):
        candidates["high-affinity"] = search.high_affinity()
    if spec.affinity in ("auto", "low"):
        low = search.low_affinity()
        if low is not None:
            candidates["low-affinity"] = low
    if not candidates:
        raise InvalidRequest(
            f"no low-affinity placement of {spec.model.name} fits: each pipeline stage's prefill "
            f"and decode segments must share one node of {spec.cluster.gpus_per_node} GPUs"
        )
    best = max(candidates.values(), key=lambda p: p.per_device)
    colocated = search.colocated()
    searched = time.perf_counter() - start
    best, colocated = search.refine(best), search.refine(colocated)
    candidates = {k: best if v.instances == best.instances else v for k, v in candidates.items()}
    return Plan(best, colocated, spec, searched, candidates, time.perf_counter() - start)


def split_workers(spec: PlanSpec, workers: int) -> Placement:
    """On a single host of `workers` one-device workers: the prefill:decode split with the most
    goodput (every split from 1:W-1 to W-1:1 simulated)."""
    if workers < 2:
        raise InvalidRequest(f"a split needs at least 2 workers, got {workers}", param="workers")
    search = _Search(spec)
    problem = parallel_problem(spec.model, 1, 1, spec.cluster, search.min_tokens)
    if problem:
        raise InvalidRequest(f"one worker cannot hold {spec.model.name}: {problem}")
    best: Placement | None = None
    for n_p in range(1, workers):
        roles = [("prefill", 1, 1)] * n_p + [("decode", 1, 1)] * (workers - n_p)
        mapped = [InstancePlacement(r, 1, 1, (((0, i),),)) for i, (r, _, _) in enumerate(roles)]
        phases = (
            PhasePlan("prefill", 1, 1, n_p, search.phase_estimate("prefill", 1, 1)),
            PhasePlan("decode", 1, 1, workers - n_p, search.phase_estimate("decode", 1, 1)),
        )
        candidate = search.finish("single-host", phases, mapped)
        if best is None or candidate.goodput > best.goodput:
            best = candidate
    return best


def sim_instance(
    spec: PlanSpec, role: str, tp: int, pp: int = 1, nodes: tuple[int, ...] = ()
) -> Instance:
    """One instance of `role` as the spec's model, cluster and latency make it."""
    lat = spec.colocated_latency if role == "colocated" else spec.latency
    return Instance(
        role=role,
        tp=tp,
        pp=pp,
        kv_capacity=kv_capacity(spec.model, tp, pp, spec.cluster),
        max_batch_tokens=lat.saturation_tokens(tp),
        max_num_seqs=max(spec.max_num_seqs, pp),
        nodes=nodes or tuple(range(pp)),
    )


def sim_cluster(spec: PlanSpec, instances) -> SimCluster:
    """The simulator's cluster of `instances` on the spec's cluster and latency models."""
    return SimCluster(
        instances=tuple(instances),
        latency=spec.latency,
        kv_bytes_per_token=spec.model.kv_bytes_per_token,
        intra_node_bandwidth=spec.cluster.intra_node_bandwidth,
        inter_node_bandwidth=spec.cluster.inter_node_bandwidth,
        colocated_latency=spec.colocated_latency,
    )


class _Search:
    """The configurations of one spec, their goodputs (memoised) and the three algorithms."""

    def __init__(self, spec: PlanSpec) -> None:
        self.spec = spec
        self.min_tokens = spec.workload.max_tokens
        m, c = spec.model, spec.cluster
        # Only tensor degrees both latency profiles cover (a profile measures what it measures).
        profiled = set(spec.latency.by_tp) & set(spec.colocated_latency.by_tp)
        self._goodputs: dict[tuple[str, int, int], GoodputEstimate] = {}
        self._lengths = spec.workload.sample(spec.num_requests, spec.seed)
        self.configs = [
            (tp, pp)
            for tp in divisors(m.num_heads, c.gpus_per_node)
            if tp in profiled
            for pp in divisors(m.num_layers, c.num_gpus // tp)
            if (spec.max_pp is None or pp <= spec.max_pp)
            and parallel_problem(m, tp, pp, c, self.min_tokens) is None
        ]
        if not self.configs:
            problems = [
                parallel_problem(m, tp, pp, c, self.min_tokens)
                for tp in (1, c.gpus_per_node)
                for pp in (1, max(1, c.num_gpus // tp))
            ]
            raise InvalidRequest(
                f"{m.name} fits no parallel configuration on {c.nodes}x{c.gpus_per_node} GPUs of "
                f"{c.gpu_memory_bytes / 2**30:.0f} GiB: e.g. {'; '.join(filter(None, problems))}"
            )

    # -- simulation ------------------------------------------------------------------------------

    def instance(self, role: str, tp: int, pp: int, nodes: tuple[int, ...] = ()) -> Instance:
        return sim_instance(self.spec, role, tp, pp, nodes)

    def simulate_goodput(self, instances: list[Instance], slo: Slo) -> GoodputEstimate:
        """The search's quick estimate."""
        s = self.spec
        return goodput(
            sim_cluster(s, instances),
            s.workload,
            slo,
            s.alpha,
            min_requests=s.num_requests * len(instances),
            seed=s.seed,
        )

    def phase_estimate(self, role: str, tp: int, pp: int) -> GoodputEstimate:
        """One instance's goodput for its phase alone (colocated: both SLOs); memoised."""
        key = (role, tp, pp)
        if key not in self._goodputs:
            slo = self.spec.slo
            if role == "prefill":
                slo = Slo(slo.ttft_s, math.inf)
            elif role == "decode":
                slo = Slo(math.inf, slo.tpot_s)
            self._goodputs[key] = self.simulate_goodput([self.instance(role, tp, pp)], slo)
        return self._goodputs[key]

    def phase_goodput(self, role: str, tp: int, pp: int) -> float:
        return self.phase_estimate(role, tp, pp).rate

    def phase_bound(self, role: str, tp: int, pp: int) -> float:
        """The phase goodput when simulated already, else a cheap optimistic bound."""
        key = (role, tp, pp)
        if key in self._goodputs:
            return self._goodputs[key].rate
        lat = self.spec.colocated_latency if role == "colocated" else self.spec.latency
        return CAPACITY_SLACK * capacity(self.instance(role, tp, pp), lat, self._lengths)

    def scored(self, role: str, exhaustive: bool = False) -> list[tuple[float, int, int]]:
        """(goodput, tp, pp) of configurations that meet the SLO at some rate. Visited from the
        best bound per GPU down; unless exhaustive, those whose bound per GPU cannot reach the
        best goodput per GPU found are skipped."""
        order = sorted(self.configs, key=lambda c: -self.phase_bound(role, *c) / (c[0] * c[1]))
        scored: list[tuple[float, int, int]] = []
        best = 0.0
        for tp, pp in order:
            if not exhaustive and self.phase_bound(role, tp, pp) / (tp * pp) <= best:
                break
            g = self.phase_goodput(role, tp, pp)
            if g > 0:
                scored.append((g, tp, pp))
                best = max(best, g / (tp * pp))
        if not scored:
            raise InvalidRequest(
                f"no {role} configuration of {self.spec.model.name} meets the SLO "
                f"(TTFT {self.spec.slo.ttft_s * 1000:g} ms, TPOT {self.spec.slo.tpot_s * 1000:g} "
                f"ms) for {self.spec.alpha:.0%} of requests even at a vanishing rate",
                param="slo",
            )
        return scored

    # -- algorithms ------------------------------------------------------------------------------

    def high_affinity(self) -> Placement:
        """Each phase's configurations scored alone; replicas chosen for the rate (fewest GPUs)
        or to fill the cluster (most goodput), over pairs of configurations, best first."""
        prefill = self.scored("prefill")
        decode = self.scored("decode")
        total = self.spec.cluster.num_gpus
        rate = self.spec.rate
        options = []
        for g_p, tp_p, pp_p in prefill:
            for g_d, tp_d, pp_d in decode:
                size_p, size_d = tp_p * pp_p, tp_d * pp_d
                if rate is not None:
                    n, m = math.ceil(rate / g_p), math.ceil(rate / g_d)
                    gpus = n * size_p + m * size_d
                    options.append((-gpus, min(n * g_p, m * g_d), (tp_p, pp_p, n, tp_d, pp_d, m)))
                    continue
                for n in range(1, (total - size_d) // size_p + 1):
                    m = (total - n * size_p) // size_d
                    gpus = n * size_p + m * size_d
                    options.append((min(n * g_p, m * g_d), -gpus, (tp_p, pp_p, n, tp_d, pp_d, m)))
        fits = [o for o in options if -o[1 if rate is None else 0] <= total]
        if not fits:
            _, _, (tp_p, pp_p, n, tp_d, pp_d, m) = max(options)
            raise InvalidRequest(
                f"rate {rate:g} req/s needs at least {n} prefill (tp={tp_p}, pp={pp_p}) + {m} "
                f"decode (tp={tp_d}, pp={pp_d}) instances = {n * tp_p * pp_p + m * tp_d * pp_d} "
                f"GPUs; the cluster has {total}",
                param="rate",
            )
        for *_, (tp_p, pp_p, n, tp_d, pp_d, m) in sorted(fits, reverse=True):
            roles = [("prefill", tp_p, pp_p)] * n + [("decode", tp_d, pp_d)] * m
            mapped = first_fit(roles, self.spec.cluster)
            if mapped is not None:
                break
        else:
            raise InvalidRequest(f"no high-affinity placement maps onto {total} GPUs' nodes")
        phases = (
            PhasePlan("prefill", tp_p, pp_p, n, self.phase_estimate("prefill", tp_p, pp_p)),
            PhasePlan("decode", tp_d, pp_d, m, self.phase_estimate("decode", tp_d, pp_d)),
        )
        return self.finish("high-affinity", phases, mapped)

    def low_affinity(self) -> Placement | None:
        c = self.spec.cluster
        feasible = set(self.configs)
        units = []
        for pp in divisors(self.spec.model.num_layers, c.nodes):
            tps = divisors(self.spec.model.num_heads, c.gpus_per_node)
            for tp_p in (t for t in tps if (t, pp) in feasible):
                for tp_d in (t for t in tps if (t, pp) in feasible):
                    for n_p in range(1, c.gpus_per_node // tp_p + 1):
                        room = c.gpus_per_node - n_p * tp_p
                        units += [(pp, tp_p, n_p, tp_d, n_d) for n_d in range(1, room // tp_d + 1)]
        if not units:
            return None

        def bound(unit: tuple[int, int, int, int, int]) -> float:
            pp, tp_p, n_p, tp_d, n_d = unit
            rate = min(
                n_p * self.phase_bound("prefill", tp_p, pp),
                n_d * self.phase_bound("decode", tp_d, pp),
            )
            return POOLING_SLACK * rate / (pp * (n_p * tp_p + n_d * tp_d))

        # Per (pp, tp_p, tp_d), only the two best-balanced replica counts (larger units first
        # on ties: they pool more): the others' bounds are lower and the joint runs are costly.
        groups: dict[tuple[int, int, int], list[tuple[float, int, tuple]]] = {}
        for u in units:
            size = u[2] * u[1] + u[4] * u[3]
            groups.setdefault((u[0], u[1], u[3]), []).append((bound(u), size, u))
        shortlist = [x for g in groups.values() for x in sorted(g, reverse=True)[:2]]
        best, best_unit = 0.0, None
        for b, _, unit in sorted(shortlist, reverse=True):
            if b <= best:
                break
            pp, tp_p, n_p, tp_d, n_d = unit
            self.phase_goodput("prefill", tp_p, pp)  # tighten the bound: simulate the phases
            self.phase_goodput("decode", tp_d, pp)
            if bound(unit) <= best:
                continue
            nodes = tuple(range(pp))
            insts = [self.instance("prefill", tp_p, pp, nodes)] * n_p + [
                self.instance("decode", tp_d, pp, nodes)
            ] * n_d
            rate = self.simulate_goodput(insts, self.spec.slo).rate
            per_gpu = rate / (pp * (n_p * tp_p + n_d * tp_d))
            if per_gpu > best:
                best, best_unit = per_gpu, (unit, per_gpu * pp * (n_p * tp_p + n_d * tp_d))
        if best_unit is None:
            return None
        (pp, tp_p, n_p, tp_d, n_d), unit_rate = best_unit
        g_p, g_d = self.phase_goodput("prefill", tp_p, pp), self.phase_goodput("decode", tp_d, pp)
        rate = self.spec.rate
        if rate is not None and rate < unit_rate:
            # less than one unit is needed: keep its shape, with only the replicas the rate needs
            n_p, n_d = min(n_p, math.ceil(rate / g_p)), min(n_d, math.ceil(rate / g_d))
        used = n_p * tp_p + n_d * tp_d
        fit = (c.nodes // pp) * (c.gpus_per_node // used)
        count = fit if rate is None else math.ceil(rate / unit_rate)
        if count > fit:
            raise InvalidRequest(
                f"rate {rate:g} req/s needs {count} low-affinity units of {pp} x {used} "
                f"GPUs; the cluster holds {fit}",
                param="rate",
            )
        mapped = unit_mapping(count, pp, [(tp_p, n_p), (tp_d, n_d)], c)
        phases = (
            PhasePlan("prefill", tp_p, pp, n_p * count, self.phase_estimate("prefill", tp_p, pp)),
            PhasePlan("decode", tp_d, pp, n_d * count, self.phase_estimate("decode", tp_d, pp)),
        )
        return self.finish("low-affinity", phases, mapped)

    def colocated(self) -> Placement:
        g, tp, pp = max(self.scored("colocated"), key=lambda x: x[0] / (x[1] * x[2]))
        estimate = self.phase_estimate("colocated", tp, pp)
        size = tp * pp
        total = self.spec.cluster.num_gpus
        n = total // size if self.spec.rate is None else math.ceil(self.spec.rate / g)
        for count in range(min(n, total // size), 0, -1):
            mapped = first_fit([("colocated", tp, pp)] * count, self.spec.cluster)
            if mapped is not None:
                break
        else:
            raise InvalidRequest(f"colocated tp={tp} pp={pp} cannot be mapped onto the cluster")
        return self.finish("colocated", (PhasePlan("colocated", tp, pp, count, estimate),), mapped)

    def finish(
        self, algorithm: str, phases: tuple[PhasePlan, ...], mapped: list[InstancePlacement]
    ) -> Placement:
        insts = [self.instance(m.role, m.tp, m.pp, m.nodes) for m in mapped]
        estimate = self.simulate_goodput(insts, self.spec.slo)
        return Placement(algorithm, phases, tuple(mapped), estimate)

    def refine(self, placement: Placement) -> Placement:
        """The placement with its goodput simulated to the spec's precision, within the spec's
        budget of simulated requests.
        Candidates are compared on the quick estimates; only the reported ones are refined, so
        the search costs what it did."""
        s = self.spec
        if s.precision is None or placement.goodput == 0:
            return placement
        insts = [self.instance(m.role, m.tp, m.pp, m.nodes) for m in placement.instances]
        estimate = refine(
            sim_cluster(s, insts),
            s.workload,
            s.slo,
            s.alpha,
            placement.estimate,
            precision=s.precision,
            budget=s.refine_requests,
            seed=s.seed,
        )
        return dataclasses.replace(placement, estimate=estimate)
