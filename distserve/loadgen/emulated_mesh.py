"""One placement running as an emulated mesh, and the rate the simulator gives a target.

`EmulatedMesh` starts a `Shape` of an `EmulatedCluster` (distserve.loadgen.emulated) as a real
mesh of emulated workers, runs `Requests` through it in emulated time and keeps the mesh's own
CPU per request beside its mean step (the check that the time scale is large enough). `rate_for`
is the rate at which the planner's simulator predicts a target attainment on the same
instances: benchmarks probe the mesh there, so that a gap is the mesh's, not the inputs'.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np

from distserve.loadgen.emulated import EmulatedCluster, Shape, run
from distserve.loadgen.procfs import cpu_seconds
from distserve.loadgen.results import LoadResult
from distserve.loadgen.scrape import total
from distserve.local_mesh import Mesh
from services.common.slo import Slo
from services.engine.presets import emulated_model
from services.planner.simulator import simulate
from services.planner.workload import Requests


def rate_for(
    cluster: EmulatedCluster, shape: Shape, base: Requests, slo: Slo, target: float
) -> float:
    """The rate at which the simulator predicts `target` attainment over all of `base`."""
    sim = cluster.sim_cluster(shape)
    lo, hi = 0.05, 1000.0
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        if simulate(sim, base.at_rate(mid)).attainment(slo) >= target:
            lo = mid
        else:
            hi = mid
    return round(lo, 3)


def mesh_cpu_seconds(mesh: Mesh) -> float:
    """CPU time (user + system) the mesh's processes have used so far (a process that is gone
    counts nothing)."""
    out = 0.0
    for p in mesh.processes:
        with contextlib.suppress(OSError):
            out += cpu_seconds(p.popen.pid)
    return out


class EmulatedMesh:
    """One shape's running emulated mesh, and its CPU bookkeeping."""

    def __init__(
        self, cluster: EmulatedCluster, shape: Shape, time_scale: float, **mesh_spec
    ) -> None:
        """`mesh_spec`: more `MeshSpec` fields (a planner, a budget, ...)."""
        self.cluster, self.shape, self.time_scale = cluster, shape, time_scale
        spec = cluster.mesh_spec(
            shape, emulated_model(cluster.model), time_scale, ready_timeout_s=600, **mesh_spec
        )
        self.mesh = Mesh(spec)
        self.vocab = cluster.model.vocab_size
        self.requests = 0
        self.cpu_s = 0.0
        self.emulated_s = 0.0
        self.runs = 0

    def __enter__(self) -> EmulatedMesh:
        self.mesh.start()
        return self

    def __exit__(self, *exc) -> None:
        self.mesh.stop()

    def run(self, requests: Requests, seed: int = 0, until: int | None = None) -> LoadResult:
        """`requests` through the mesh, with prompts of this run's own (a prompt sent again
        would find its KV in the prefix caches, which the simulator does not model)."""
        cpu = mesh_cpu_seconds(self.mesh)
        self.runs += 1
        result = run(self.mesh, self.time_scale, requests, self.vocab, (seed, self.runs), until)
        self.cpu_s += mesh_cpu_seconds(self.mesh) - cpu
        self.requests += int(np.isfinite(result.sent_s).sum())  # those sent
        return result

    def cpu_per_request_ms(self) -> float:
        """The mesh's CPU (all its processes) per request, in emulated ms."""
        return self.cpu_s / max(1, self.requests) / self.time_scale * 1000

    def mean_step_ms(self) -> float:
        """The mean emulated step (decode, or a colocated instance's any) over the workers."""
        samples = [
            s for p in self.mesh.workers if not p.name.startswith("prefill") for s in p.metrics()
        ]
        count = total(samples, "distserve_engine_step_seconds_count")
        return (
            total(samples, "distserve_engine_step_seconds_sum") / count * 1000
            if count
            else float("nan")
        )
