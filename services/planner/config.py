"""Configuration of the planner service, validated once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from services.common.errors import InvalidRequest
from services.common.etcd_client import EtcdConfig
from services.planner.autoscale import AutoscaleConfig
from services.planner.drift import DriftConfig

KUBERNETES = "kubernetes"  # --actuator: the cluster's API, not an Actuator service's address


@dataclass(frozen=True)
class Autoscale:
    """The control loop's settings (services/planner/control.py): what it plans for, through
    which actuator, how often."""

    # host:port of the Actuator service (the launcher's), or "kubernetes": the Kubernetes API
    # of the cluster the planner runs in (services/planner/k8s_actuator.py)
    actuator: str
    model_spec: str  # opt-13b, ... or a model folder
    ttft_slo_ms: float
    tpot_slo_ms: float
    tp: dict[str, int]  # each role's tensor degree in the mesh (its roles)
    config: AutoscaleConfig
    attainment: float = 0.9
    interval_s: float = 1.0  # between decisions (the mesh's clock)
    advisory: bool = False  # decide and report, never apply
    gateway: str | None = None  # the gateway, for the workers' loads (the Kubernetes actuator)

    def __post_init__(self) -> None:
        if self.ttft_slo_ms <= 0 or self.tpot_slo_ms <= 0:
            raise InvalidRequest("autoscaling needs a positive SLO: --slo TTFT_MS,TPOT_MS")
        if self.gateway and self.actuator != KUBERNETES:
            raise InvalidRequest("--gateway is for --actuator kubernetes (the launcher's knows it)")
        if self.interval_s <= 0:
            raise InvalidRequest("--decide-every-s must be positive")


@dataclass(frozen=True)
class PlannerConfig:
    """Where it listens, what it plans with, and how it watches for drift.

    workers > 0 makes it a single-host planner: plans split that many one-device workers
    between prefill and decode. Otherwise plans place instances on `cluster`.
    """

    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    profile: Path | None = None  # latency profile (default: DistServe's published A100 one)
    colocated_profile: Path | None = None
    # the folder under which a Plan request may name model folders and trace files on this host
    # (None: it may name none; presets and length distributions only)
    plan_files: Path | None = None
    cluster: str = "1x8"  # NODESxGPUS[,INTRA_GBS,INTER_GBS], when a request names none
    workers: int = 0
    max_num_seqs: int = 256  # running requests per decode or colocated instance
    num_requests: int = 1000  # simulated per instance per goodput probe
    # the Plan RPC's two reported placements, refined as `distserve plan` refines them
    # (PlanSpec.precision; None: the search's quick estimates), within refine_requests each
    precision: float | None = 0.01
    refine_requests: int = 400_000
    drift: DriftConfig = field(default_factory=DriftConfig)
    metrics_port: int = 0  # Prometheus /metrics; 0: any free port, -1: off
    health_port: int | None = None  # plaintext grpc.health.v1 alone (probes); None: off
    autoscale: Autoscale | None = None  # resize the running mesh (None: recommend only)
    # the mesh's etcd: several replicas elect one to decide and act (services/common/
    # election.py); None: this planner alone, always leading
    etcd: EtcdConfig | None = None
    election_key: str = "planner"  # replicas campaigning under the same key elect one leader
    election_ttl_s: float = 5.0  # a dead leader is replaced within this (etcd: >= 2 s)
    advertise: str | None = None  # the address standbys name as the leader's (None: host:port)

    def __post_init__(self) -> None:
        if self.workers == 1 or self.workers < 0:
            raise InvalidRequest("workers: 0 (a cluster) or at least 2 (one prefill, one decode)")
        if self.max_num_seqs < 1 or self.num_requests < 10:
            raise InvalidRequest("max_num_seqs >= 1 and num_requests >= 10")
        if self.election_ttl_s < 2:
            raise InvalidRequest("--election-ttl-s: at least 2 (etcd's shortest lease)")
        if self.advertise is not None and self.etcd is None:
            raise InvalidRequest("--advertise names this replica in an election: give --etcd too")
        if self.advertise is not None and not _host_port(self.advertise):
            raise InvalidRequest(f"--advertise takes HOST:PORT, not {self.advertise!r}")
        if not self.election_key or "/" in self.election_key:
            raise InvalidRequest("--election-key: a name without '/', e.g. planner")


def _host_port(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536
