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
