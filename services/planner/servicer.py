"""gRPC servicer of the planner: decode the request, one replanner call, encode the reply."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from pathlib import Path

from services.common import telemetry
from services.common.election import Election
from services.common.errors import FailedPrecondition, InvalidRequest, NotFound
from services.common.gen.distserve.v1 import planner_pb2, planner_pb2_grpc
from services.common.model_spec import PRESETS
from services.planner.config import PlannerConfig
from services.planner.control import ControlLoop
from services.planner.drift import Drift, Sample
from services.planner.metrics import PlannerMetrics
from services.planner.placement import Placement, PlanSpec
from services.planner.replanner import Current, Replanner

log = logging.getLogger("distserve.planner")


class PlannerServicer(planner_pb2_grpc.PlannerServicer):
    def __init__(
        self,
        config: PlannerConfig,
        replanner: Replanner,
        metrics: PlannerMetrics,
        control: ControlLoop | None = None,
    ) -> None:
        self.config = config
        self.replanner = replanner
        self.metrics = metrics
        self.control = control  # resizes the mesh from the samples (None: recommend only)
        # with several replicas (--etcd): while this one stands by it takes the workload but
        # neither replans nor answers for decisions it does not take (None: always leading)
        self.election: Election | None = None

    @property
    def leading(self) -> bool:
        return self.election is None or self.election.leading

    async def Plan(self, request, context):
        spec = plan_spec(request, self.config)
        with _searching("planner.plan", telemetry.incoming(context)) as search:
            result, current = await self.replanner.plan(spec)
            search.adopted(current, self.metrics)
        reply = planner_pb2.PlanResponse(placement=placement_to_pb(current))
        if result is not None:
            reply.colocated.CopyFrom(placement_to_pb(Current(result.colocated, 0, "baseline")))
            reply.ratio_over_colocated = result.ratio
            reply.search_seconds = result.search_seconds
            reply.plan_json = json.dumps(result.to_json())
        return reply

    async def GetPlacement(self, request, context):
        return placement_to_pb(self.replanner.placement())

    async def GetDecision(self, request, context):
        if self.control is None:
            raise NotFound("this planner resizes no mesh: start it with --budget")
        if not self.leading:
            leader = self.election.leader or "not elected yet"
            raise FailedPrecondition(
                f"this planner replica stands by; the leader decides: ask it ({leader})"
            )
        return self.control.latest_pb()

    async def ReportWorkload(self, request_iterator, context):
        return await self._report(request_iterator, telemetry.incoming(context))

    async def _report(self, request_iterator, trace) -> planner_pb2.ReportWorkloadResponse:
        samples, reasons, replans = 0, [], []
        async for pb in request_iterator:
            samples += 1
            if pb.arrival:  # only the resizing loop uses arrivals (its rate and prompts, now)
                if pb.prompt_tokens < 1 or not math.isfinite(pb.arrival_unix_s):
                    raise InvalidRequest(
                        "an arrival sample needs a finite arrival_unix_s and prompt_tokens >= 1, "
                        f"got {pb.arrival_unix_s}, {pb.prompt_tokens}"
                    )
                if self.control is not None:
                    self.control.arrived(pb.arrival_unix_s, pb.prompt_tokens)
                continue
            sample = Sample(
                pb.arrival_unix_s, pb.prompt_tokens, pb.output_tokens, pb.ttft_ms, pb.tpot_ms
            )
            if self.control is not None:
                self.control.observe(sample)
            drift = self.replanner.observe(sample)
            self.metrics.samples.inc()
            if drift is not None and not self.leading:
                log.info("workload drift seen on a standby: the leader replans")
            elif drift is not None:
                log.info("workload drift: %s", "; ".join(drift.reasons))
                reasons.append("; ".join(drift.reasons))
                self.metrics.drifts.inc()
                replans.append(asyncio.create_task(self._replan(drift, trace)))
        await asyncio.gather(*replans)
        reply = planner_pb2.ReportWorkloadResponse(
            samples=samples, drifts=len(reasons), reasons=reasons
        )
        if self.replanner.current is not None:
            reply.placement.CopyFrom(placement_to_pb(self.replanner.current))
        return reply

    async def _replan(self, drift: Drift, trace) -> None:
        with _searching("planner.replan", trace, {"planner.drift": "; ".join(drift.reasons)}) as s:
            current = await self.replanner.replan(drift)
            if current is not None:
                s.adopted(current, self.metrics)


class _searching:
    """A placement search: its span (under the caller's trace) and, once a placement is
    adopted, the metrics and the span's attributes describing it."""

    def __init__(self, name: str, trace, attributes: dict | None = None) -> None:
        self.span = telemetry.start(name, trace, attributes)
        self.started = time.monotonic()

    def adopted(self, current: Current, metrics: PlannerMetrics) -> None:
        seconds = time.monotonic() - self.started
        metrics.adopted(current, seconds)
        p = current.placement
        self.span.set_attributes(
            {
                "planner.algorithm": p.algorithm,
                "planner.version": current.version,
                "planner.search_seconds": seconds,
                "planner.goodput_per_device_rps": p.per_device,
                "planner.instances": len(p.instances),
            }
        )

    def __enter__(self) -> _searching:
        return self

    def __exit__(self, kind, error, tb) -> None:
        if error is not None:
            telemetry.fail(self.span, error)
        self.span.end()


def _allowed_file(name: str, field: str, root: Path | None) -> None:
    """A Plan request reads a file or folder of this host only under --plan-files: anyone who
    reaches the planner's port would otherwise learn which paths exist here, and parts of what
    they hold from the parse errors."""
    what = (
        f"unknown model {name!r}: give one of {', '.join(PRESETS)}, or a model folder"
        if field == "model_spec"
        else f"workload trace {name!r}: a trace file"
    )
    if root is None:
        raise InvalidRequest(
            f"{what} is read only under the planner's --plan-files DIR, and this planner has none",
            param=field,
        )
    try:  # as it would be opened (a relative name: from the planner's folder), links followed
        inside = Path(name).resolve().is_relative_to(root.resolve())
    except (OSError, ValueError):
        inside = False
    if not inside:
        raise InvalidRequest(f"{what} is read only under --plan-files {root}", param=field)


def plan_spec(request, config: PlannerConfig) -> PlanSpec:
    """The PlanSpec of a PlanRequest, with the service's defaults for what it leaves out."""
    from services.common.latency import colocated_for_model, for_model
    from services.common.model_spec import model_spec
    from services.common.slo import Slo
    from services.planner.cluster import ClusterSpec
    from services.planner.workload import parse_workload

    if not request.model_spec:
        raise InvalidRequest("model_spec is required", param="model_spec")
    if not (0 < request.ttft_slo_ms < math.inf and 0 < request.tpot_slo_ms < math.inf):
        raise InvalidRequest("ttft_slo_ms and tpot_slo_ms must be positive and finite", "slo")
    workload = request.workload or "chat"
    if workload.startswith("trace:"):
        _allowed_file(workload.removeprefix("trace:"), "workload", config.plan_files)
    if request.model_spec.lower().removeprefix("facebook/") not in PRESETS:
        _allowed_file(request.model_spec, "model_spec", config.plan_files)
    model = model_spec(request.model_spec)
    if config.workers:
        cluster = ClusterSpec(1, config.workers)
    else:
        cluster = ClusterSpec.parse(request.cluster or config.cluster)
    return PlanSpec(
        model=model,
        cluster=cluster,
        workload=parse_workload(workload),
        slo=Slo(request.ttft_slo_ms / 1000, request.tpot_slo_ms / 1000),
        latency=for_model(model, config.profile),
        colocated_latency=colocated_for_model(model, config.colocated_profile, config.profile),
        alpha=request.attainment or 0.9,
        rate=request.rate or None,
        affinity=request.affinity or "auto",
        max_num_seqs=config.max_num_seqs,
        num_requests=config.num_requests,
        precision=config.precision,
        refine_requests=config.refine_requests,
        max_pp=1,  # what the workers implement: the placement is for this mesh
    )


def placement_to_pb(current: Current) -> planner_pb2.Placement:
    p: Placement = current.placement
    return planner_pb2.Placement(
        algorithm=p.algorithm,
        phases=[
            planner_pb2.PhasePlacement(
                role=ph.role,
                tensor_parallel=ph.tp,
                pipeline_parallel=ph.pp,
                replicas=ph.replicas,
                instance_goodput_rps=ph.instance_goodput,
            )
            for ph in p.phases
        ],
        instances=[
            planner_pb2.InstancePlacement(
                role=i.role,
                tensor_parallel=i.tp,
                pipeline_parallel=i.pp,
                stages=[
                    planner_pb2.StagePlacement(node=s[0][0], gpus=[g for _, g in s]) for s in i.gpus
                ],
            )
            for i in p.instances
        ],
        goodput_rps=p.goodput,
        goodput_per_gpu_rps=p.per_device,
        num_gpus=p.num_gpus,
        version=current.version,
        reason=current.reason,
    )
