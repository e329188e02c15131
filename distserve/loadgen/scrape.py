"""Figures read from a local mesh's Prometheus metrics: a counter summed over processes, or
split by one label. `samples` are what `Process.metrics()` (distserve.local_mesh) returns."""

from __future__ import annotations

from collections.abc import Iterable


def gateway(mesh):
    """The mesh's gateway process."""
    return next(p for p in mesh.processes if p.name == "gateway")


def total(samples: Iterable, name: str, **labels: str) -> float:
    """The sum of the samples named `name` whose labels include `labels`."""
    return sum(
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def role_total(mesh, role: str, name: str) -> float:
    """`name` summed over the mesh's workers of `role` (their names start with it)."""
    return total((s for p in mesh.workers if p.name.startswith(role) for s in p.metrics()), name)


def by_label(samples: Iterable, name: str, label: str) -> dict[str, float]:
    """The samples named `name`, by the value of their `label` ("" where it has none)."""
    return {s.labels.get(label, ""): s.value for s in samples if s.name == name}
