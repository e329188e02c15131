"""`python -m services.planner`: serve the planner (Plan, GetPlacement, ReportWorkload)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from pathlib import Path

from services.common import clock, telemetry
from services.common.election import Election
from services.common.errors import InvalidRequest
from services.common.etcd_client import add_etcd_args, etcd_config
from services.common.gen.distserve.v1 import planner_pb2, planner_pb2_grpc
from services.common.metrics import add_metrics_args, worker_registry
from services.common.metrics import serve as serve_metrics
from services.common.server import (
    add_health_port_args,
    announce_ready,
    plaintext_health,
    run,
    setup_logging,
    start_server,
    wait_for_signal,
)
from services.planner.actuator import Actuator, RemoteActuator
from services.planner.autoscale import AutoscaleConfig, Autoscaler
from services.planner.config import KUBERNETES, Autoscale, PlannerConfig
from services.planner.control import ControlLoop
from services.planner.drift import DriftConfig
from services.planner.metrics import PlannerMetrics
from services.planner.replanner import Replanner
from services.planner.servicer import PlannerServicer

log = logging.getLogger("distserve.planner")


def parse(argv: list[str] | None = None) -> PlannerConfig:
    p = argparse.ArgumentParser(prog="python -m services.planner", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--profile", type=Path, help="latency profile (default: published A100)")
    p.add_argument("--colocated-profile", type=Path)
    p.add_argument(
        "--plan-files",
        type=Path,
        metavar="DIR",
        help="a Plan request may name model folders (model_spec) and traces (workload "
        "trace:FILE) under this folder on this host; default: none (presets only)",
    )
    p.add_argument("--cluster", default="1x8", help="NODESxGPUS[,INTRA_GBS,INTER_GBS]")
    p.add_argument("--workers", type=int, default=0, help="single host: split this many workers")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument(
        "--precision",
        type=float,
        default=0.01,
        help="refine the reported placements' goodputs to this 95%% half-width (0: do not)",
    )
    p.add_argument("--refine-requests", type=int, default=400_000, help="each, at most")
    p.add_argument("--drift-window", type=int, default=200, help="samples per window")
    p.add_argument("--drift-rate", type=float, default=0.3, help="relative rate shift")
    p.add_argument("--drift-length", type=float, default=0.25, help="relative length shift")
    p.add_argument("--drift-confirm", type=int, default=2, help="drifting windows in a row")
    e = p.add_argument_group(
        "election", "several replicas: one decides and acts, the others stand by (etcd)"
    )
    add_etcd_args(e, "elect a leader there (none: this planner alone, always leading)")
    e.add_argument("--election-key", default="planner", help="replicas of one planner share it")
    e.add_argument(
        "--advertise",
        metavar="HOST:PORT",
        help="the address the other replicas name as this one's when it leads (default: --host "
        "and the port it listens on; on Kubernetes the pod's own DNS name)",
    )
    e.add_argument(
        "--election-ttl-s",
        type=float,
        default=5.0,
        help="the leader's lease: a dead leader is replaced within this (at least 2)",
    )
    g = p.add_argument_group(
        "autoscaling", "resize the running mesh within a budget (services/planner/control.py)"
    )
    g.add_argument("--budget", type=int, default=0, help="devices the mesh may use (0: off)")
    g.add_argument(
        "--actuator",
        help="host:port of the Actuator service (the launcher's), or `kubernetes`: scale and "
        "drain the worker Deployments of the planner's own namespace through the cluster's API",
    )
    g.add_argument(
        "--gateway", help="with --actuator kubernetes: the gateway (host:port), for worker loads"
    )
    g.add_argument("--model-spec", help="the model served: opt-13b, ... or a model folder")
    g.add_argument("--slo", help="TTFT_MS,TPOT_MS the mesh is sized for")
    g.add_argument("--attainment", type=float, default=0.9)
    g.add_argument("--tp", default="prefill=1,decode=1", help="ROLE=TP,...: the mesh's roles")
    g.add_argument("--decide-every-s", type=float, default=1.0)
    g.add_argument("--window-s", type=float, default=60.0, help="the workload measured")
    g.add_argument("--cooldown-s", type=float, default=30.0, help="after a change lands")
    g.add_argument(
        "--down-stabilization-s",
        type=float,
        default=120.0,
        help="a smaller placement must be safe at every decision this long before it is taken",
    )
    g.add_argument(
        "--tp-choices",
        default="",
        help="TP,...: tensor degrees a role may be re-sharded to (default: none, each role "
        "keeps its --tp)",
    )
    g.add_argument("--advise", action="store_true", help="decide and report, never apply")
    add_metrics_args(p)
    add_health_port_args(p)
    clock.add_args(p)
    a = p.parse_args(argv)
    clock.setup_from_args(a)  # spans on the mesh's clock (an emulated mesh's is slower)
    autoscale = None
    if a.budget:
        if not (a.actuator and a.model_spec and a.slo):
            raise InvalidRequest("--budget needs --actuator, --model-spec and --slo")
        ttft, tpot = (float(x) for x in a.slo.split(","))
        autoscale = Autoscale(
            actuator=a.actuator,
            model_spec=a.model_spec,
            ttft_slo_ms=ttft,
            tpot_slo_ms=tpot,
            tp={r: int(n) for r, n in (kv.split("=") for kv in a.tp.split(","))},
            config=AutoscaleConfig(
                budget=a.budget,
                window_s=a.window_s,
                cooldown_s=a.cooldown_s,
                down_stabilization_s=a.down_stabilization_s,
                tp_choices=_degrees(a.tp_choices),
            ),
            attainment=a.attainment,
            interval_s=a.decide_every_s,
            advisory=a.advise,
            gateway=a.gateway,
        )
    return PlannerConfig(
        host=a.host,
        port=a.port,
        profile=a.profile,
        colocated_profile=a.colocated_profile,
        plan_files=a.plan_files,
        cluster=a.cluster,
        workers=a.workers,
        max_num_seqs=a.max_num_seqs,
        num_requests=a.num_requests,
        precision=a.precision or None,
        refine_requests=a.refine_requests,
        drift=DriftConfig(a.drift_window, a.drift_rate, a.drift_length, a.drift_confirm),
        metrics_port=a.metrics_port,
        health_port=a.health_port,
        autoscale=autoscale,
        etcd=etcd_config(a),
        election_key=a.election_key,
        election_ttl_s=a.election_ttl_s,
        advertise=a.advertise,
    )


def control_loop(config: PlannerConfig, registry) -> ControlLoop:
    """The loop that resizes the mesh (config.autoscale)."""
    from services.common.latency import colocated_for_model, for_model
    from services.common.model_spec import model_spec
    from services.common.slo import Slo
    from services.planner.cluster import ClusterSpec
    from services.planner.placement import PlanSpec
    from services.planner.workload import PRESETS

    auto = config.autoscale
    model = model_spec(auto.model_spec)
    spec = PlanSpec(
        model=model,
        cluster=ClusterSpec(1, auto.config.budget),
        workload=PRESETS["chat"],  # unused: the loop plans for the measured workload
        slo=Slo(auto.ttft_slo_ms / 1000, auto.tpot_slo_ms / 1000),
        latency=for_model(model, config.profile),
        colocated_latency=colocated_for_model(model, config.colocated_profile, config.profile),
        alpha=auto.attainment,
        max_num_seqs=config.max_num_seqs,
    )
    return ControlLoop(
        Autoscaler(spec, auto.tp, auto.config),
        actuator(auto),
        registry,
        interval_s=auto.interval_s,
        advisory=auto.advisory,
    )


def actuator(auto: Autoscale) -> Actuator:
    """What applies the loop's decisions: the launcher's Actuator service, or the Kubernetes
    API of the cluster the planner runs in."""
    if auto.actuator != KUBERNETES:
        return RemoteActuator(auto.actuator)
    from services.planner.k8s_actuator import KubernetesActuator

    return KubernetesActuator.from_cluster(gateway=auto.gateway)


async def serve(config: PlannerConfig) -> None:
    probe = plaintext_health(config.host, config.health_port)  # NOT_SERVING until listening
    metrics = PlannerMetrics(worker_registry())
    control = control_loop(config, metrics.registry) if config.autoscale else None
    replanner = Replanner(config.drift, config.workers)
    servicer = PlannerServicer(config, replanner, metrics, control)

    def add(server) -> None:
        planner_pb2_grpc.add_PlannerServicer_to_server(servicer, server)

    names = [planner_pb2.DESCRIPTOR.services_by_name["Planner"].full_name]
    server, health, port = await start_server(config.host, config.port, add, names, probe)
    announce_ready(
        "planner",
        address=f"{config.host}:{port}",
        metrics_address=serve_metrics(metrics.registry, config.host, config.metrics_port),
        **({"health_address": probe.address} if probe is not None else {}),
    )
    if config.etcd:
        address = config.advertise or f"{config.host}:{port}"
        election = Election(config.etcd, config.election_key, address, config.election_ttl_s)
        servicer.election = election  # known once the server listens: its value is the address
        tasks = [asyncio.create_task(election.run())]
        tasks.append(asyncio.create_task(act_while_leading(election, control, metrics)))
    else:
        tasks = [asyncio.create_task(control.run())] if control is not None else []
    sig = await wait_for_signal()
    log.info("signal %d: stopping", sig)
    for task in reversed(tasks):  # the loop first, then the election (it resigns)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await health.enter_graceful_shutdown()
    await server.stop(grace=5)
    if probe is not None:
        probe.stop()


async def act_while_leading(
    election: Election, control: ControlLoop | None, metrics: PlannerMetrics
) -> None:
    """Run the control loop (what acts on the mesh) only while `election` says this replica
    leads; a standby keeps taking the workload (its window is warm when it takes over) but
    decides nothing. Ends (cancelled) with the loop stopped."""
    metrics.leader.set(0)
    acting = None
    try:
        while True:
            await election.wait(leading=True)
            metrics.leader.set(1)
            log.info("leading: this planner decides and acts")
            acting = asyncio.create_task(control.run()) if control is not None else None
            await election.wait(leading=False)
            metrics.leader.set(0)
            if acting is not None:
                acting.cancel()
            log.warning("standing by: the leader is %s", election.leader or "not known yet")
    finally:
        if acting is not None:
            acting.cancel()


def _degrees(text: str) -> tuple[int, ...]:
    """`--tp-choices`: "1,2,4" -> (1, 2, 4)."""
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise InvalidRequest(f"--tp-choices: tensor degrees as 1,2,4, got {text!r}") from None


def main(argv: list[str] | None = None) -> None:
    setup_logging()
    config = parse(argv)
    telemetry.setup("planner")
    try:
        run(serve(config))
    finally:
        telemetry.shutdown()


if __name__ == "__main__":
    main()
