"""Shared fixtures: embedded models written once per test session into a temporary folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engine.presets import create_model


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory: pytest.TempPathFactory):
    """make(name, preset="tiny", **create_model kwargs) -> folder, created once per name."""
    made: dict[str, Path] = {}

    def make(name: str, preset: str = "tiny", **kwargs: object) -> Path:
        if name not in made:
            made[name] = create_model(preset, tmp_path_factory.mktemp(name), **kwargs)
        return made[name]

    return make


@pytest.fixture(scope="session")
def tiny_model(model_factory) -> Path:
    return model_factory("tiny")


MESH_WORKER_ARGS = ("--kv-cache-gib", "0.015625", "--max-num-seqs", "8")


def start_mesh(model: Path, **kwargs):
    from distserve.local_mesh import Mesh, MeshSpec

    kwargs.setdefault("worker_args", MESH_WORKER_ARGS)
    spec = MeshSpec(model=model, gateway_port=0, **kwargs)
    mesh = Mesh(spec)
    mesh.start()
    return mesh


def stop_now(mesh) -> None:
    """Stop a mesh whose test is over: SIGKILL its workers, then stop the rest (Envoy, the
    gateway, a planner) as `Mesh.stop` does. A graceful stop of a worker (drain, deregister,
    the server's grace period, the interpreter's exit) costs 2-3 s of a 2-core machine per
    mesh, and nothing is checked after a test's end; the tests of graceful stops and drains
    (test_resilience.py, `distserve up` in test_mesh.py) signal the workers themselves."""
    for p in mesh.workers:
        if p.popen.poll() is None:
            p.popen.kill()
    for p in mesh.workers:
        p.popen.wait()
    mesh.stop()


@pytest.fixture(scope="session")
def shared_mesh(tiny_model):
    """1 prefill + 1 decode (MESH_WORKER_ARGS) behind an Envoy with the default edge config,
    started once for the whole session (a mesh takes seconds to start). Only for tests that
    leave it as they found it: no worker killed, stopped or reconfigured, every request ended
    and its KV freed. A test that disturbs a mesh starts its own (`mesh_factory`)."""
    from services.edge.config import EdgeConfig

    mesh = start_mesh(tiny_model, prefill=1, decode=1, edge=EdgeConfig(port=0))
    yield mesh
    stop_now(mesh)


@pytest.fixture
def mesh_factory(tiny_model):
    """start(prefill=, decode=, colocated=, **MeshSpec fields) -> a running Mesh, stopped when
    the test ends (so meshes never pile up and slow the tests after them)."""
    meshes = []

    def start(**kwargs):
        mesh = start_mesh(tiny_model, **kwargs)
        meshes.append(mesh)
        return mesh

    yield start
    for mesh in meshes:
        stop_now(mesh)
