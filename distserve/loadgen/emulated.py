"""Placements on the emulated mesh (docs/engine.md), with the planner's simulator beside them.

An emulated mesh runs a placement at the scale it is for (OPT-13B on A100s, 2P1D, 4P2D, tp > 1)
on one CPU host: every process is real, each worker's forward pass is its modelled time. The
simulator and the mesh share one cost model (`services.common.latency`), one KV sizing
(`services.common.model_spec.kv_capacity`) and here one description of the instances
(`EmulatedCluster.instance`), so that a gap between the two is what the mesh does that the
simulator does not model, not a difference of inputs.

    cluster = EmulatedCluster.of("opt-13b")
    shape = Shape.of(plan.placement)                       # or Shape(prefill=(2, 1), ...)
    with Mesh(cluster.mesh_spec(shape, emulated_model(cluster.model), time_scale=4)) as mesh:
        result = run(mesh, 4, requests, vocab_size, seed=0)  # the mesh, in emulated time
    predicted = simulate(cluster.sim_cluster(shape), requests)
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from distserve.loadgen.comparison import ADMISSION_OFF
from distserve.loadgen.requests import load_requests
from distserve.loadgen.results import LoadResult
from distserve.loadgen.runner import run_load
from distserve.loadgen.targets import GrpcTarget
from services.common.latency import LatencyModel, colocated_for_model, for_model
from services.common.model_spec import GIB, PUBLISHED_GPU_MEMORY, ModelSpec, kv_capacity
from services.common.model_spec import model_spec as spec_named
from services.common.slo import Slo
from services.planner.cluster import ClusterSpec
from services.planner.placement import PlanSpec
from services.planner.simulator import Instance, SimCluster
from services.planner.workload import Requests

ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class Shape:
    """How many instances of each role and their tensor degree: (count, tp) per role."""

    prefill: tuple[int, int] = (0, 1)
    decode: tuple[int, int] = (0, 1)
    colocated: tuple[int, int] = (0, 1)

    @classmethod
    def of(cls, placement) -> Shape:
        """A planner placement's (`services.planner.placement.Placement`); pp must be 1 (the
        workers implement tensor parallelism only)."""
        counts: dict[str, list[int]] = {}
        for inst in placement.instances:
            if inst.pp != 1:
                raise ValueError(f"a {inst.role} instance of pp={inst.pp}: the mesh runs pp=1")
            n, tp = counts.get(inst.role, [0, inst.tp])
            if tp != inst.tp:
                raise ValueError(f"{inst.role} instances of tp {tp} and {inst.tp}")
            counts[inst.role] = [n + 1, tp]
        return cls(**{role: tuple(v) for role, v in counts.items()})

    @property
    def devices(self) -> int:
        return sum(n * tp for n, tp in (self.prefill, self.decode, self.colocated))

    def __str__(self) -> str:
        parts = []
        for role, (n, tp) in zip(ROLES, (self.prefill, self.decode, self.colocated), strict=True):
            if n:
                parts.append(f"{n}{role[0].upper()}" + (f"(tp{tp})" if tp > 1 else ""))
        return "".join(parts)


@dataclass(frozen=True)
class EmulatedCluster:
    """What the emulated mesh and the simulator share: the model, its latency fits (the
    disaggregated engine's and the colocated baseline's, as the planner times them), the
    device's memory, the KV link, and the engines' limits."""

    model: ModelSpec
    latency: LatencyModel
    colocated_latency: LatencyModel
    profile: Path | None = None  # the workers' --profile (None: the published A100 one)
    gpu_memory_bytes: int = PUBLISHED_GPU_MEMORY
    link_gbs: float = 300.0
    max_num_seqs: int = 256  # running requests per instance (the planner's default)
    block_size: int = 16
    # Prompts of at least this many tokens hand their KV off beside their prefill (the
    # gateway's --layerwise-min-tokens; the simulator gets the same rule). None: after prefill.
    layerwise_min_tokens: int | None = 256
    gateway_args: tuple[str, ...] = field(default=ADMISSION_OFF)

    @classmethod
    def of(cls, model: str, profile: Path | None = None, **kwargs) -> EmulatedCluster:
        spec = spec_named(model)
        # The emulated workers' steps are the fit; their engine loop around it is real, so the
        # simulator beside them leaves out the published fit's per-iteration overhead.
        return cls(
            spec,
            for_model(spec, profile).without_iteration_overhead(),
            colocated_for_model(spec, None, profile).without_iteration_overhead(),
            profile=profile,
            **kwargs,
        )

    def plan_spec(self, gpus: int, workload, slo: Slo, **kwargs) -> PlanSpec:
        """What the planner is given for this cluster: one node of `gpus` devices, the model
        and its latency fits (`kwargs`: PlanSpec's other fields, e.g. alpha, max_pp)."""
        return PlanSpec(
            model=self.model,
            cluster=ClusterSpec(1, gpus),
            workload=workload,
            slo=slo,
            latency=self.latency,
            colocated_latency=self.colocated_latency,
            **kwargs,
        )

    def max_batch_tokens(self, role: str, tp: int) -> int:
        """L_m: the profile's saturation point, as the planner sets it."""
        lat = self.colocated_latency if role == "colocated" else self.latency
        return lat.saturation_tokens(tp)

    def instance(self, role: str, tp: int) -> Instance:
        """One instance as the simulator sees it: the worker's limits, its KV pool in tokens
        (whole blocks, as the engine holds it)."""
        tokens = kv_capacity(self.model, tp, 1, self.gpu_memory_bytes)
        return Instance(
            role=role,
            tp=tp,
            kv_capacity=tokens // self.block_size * self.block_size,
            max_batch_tokens=self.max_batch_tokens(role, tp),
            # the prefill worker's batcher caps prompts per batch at its max_num_seqs too
            max_batch_size=self.max_num_seqs if role == "prefill" else 0,
            max_num_seqs=self.max_num_seqs,
        )

    def sim_cluster(self, shape: Shape) -> SimCluster:
        """The simulator's cluster for a shape: every instance on one node, KV over the link."""
        instances = []
        for role, (n, tp) in zip(
            ROLES, (shape.prefill, shape.decode, shape.colocated), strict=True
        ):
            if n:
                instances += [self.instance(role, tp)] * n
        return SimCluster(
            instances=tuple(instances),
            latency=self.latency,
            kv_bytes_per_token=self.model.kv_bytes_per_token,
            intra_node_bandwidth=self.link_gbs * 1e9,
            colocated_latency=self.colocated_latency,
            layerwise_min_tokens=self.layerwise_min_tokens,
        )

    def mesh_spec(self, shape: Shape, model_dir: Path, time_scale: float, **kwargs):
        """The launcher's spec of the emulated mesh of a shape (`model_dir`: the emulated
        folder of `model`, `presets.emulated_model`)."""
        from distserve.local_mesh import MeshSpec

        emulation = ["--gpu-memory-gib", repr(self.gpu_memory_bytes / GIB)]
        emulation += ["--link-gbs", repr(self.link_gbs)]
        if self.profile is not None:
            emulation += ["--profile", str(self.profile)]
        common = ("--max-num-seqs", str(self.max_num_seqs), "--block-size", str(self.block_size))
        # each worker's L_m is its profile's saturation point at its tp (the engine's default,
        # as `max_batch_tokens` below gives the simulator)
        handoff = (
            ("--kv-handoff", "after-prefill")
            if self.layerwise_min_tokens is None
            else ("--layerwise-min-tokens", str(self.layerwise_min_tokens))
        )
        return MeshSpec(
            model=model_dir,
            prefill=shape.prefill[0],
            decode=shape.decode[0],
            colocated=shape.colocated[0],
            gateway_port=0,
            worker_args=common,
            gateway_args=(*self.gateway_args, *handoff),
            tp={
                "prefill": shape.prefill[1],
                "decode": shape.decode[1],
                "colocated": shape.colocated[1],
            },
            engine="emulated",
            emulation_args=tuple(emulation),
            time_scale=time_scale,
            **kwargs,
        )


def run(
    mesh,
    time_scale: float,
    requests: Requests,
    vocab_size: int,
    seed: int | tuple[int, ...],
    until: int | None = None,
) -> LoadResult:
    """`requests` (arrivals in emulated seconds) through an emulated mesh's gateway, open loop;
    every time in the result is emulated. `until`: the run ends once the first `until`
    requests have (`run_load`)."""
    target = GrpcTarget(mesh.gateway_address, time_scale=time_scale)
    load = load_requests(requests, vocab_size, seed)
    return asyncio.run(run_load(target, load, timeout_s=600, until=until))


def judged(result: LoadResult, slo: Slo) -> float:
    """Attainment of the middle half of the requests, as the planner's goodput judges it: the
    first quarter fills the cluster, the last keeps it loaded while the judged ones finish."""
    n = len(result)
    return float(np.mean(result.met(slo)[n // 4 : n - n // 4]))
