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


MESH_WORKER_ARGS = ("--kv-cache-mb", "16", "--max-num-seqs", "8")


def start_mesh(model: Path, **kwargs):
    from services.launcher import Mesh, MeshSpec

    spec = MeshSpec(model=model, gateway_port=0, worker_args=MESH_WORKER_ARGS, **kwargs)
    mesh = Mesh(spec)
    mesh.start()
    return mesh


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
        mesh.stop()
