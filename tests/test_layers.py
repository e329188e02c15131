"""The layers of services/, as a rule: each package imports only the packages below it.

    common                       imports no other package
    engine, kvtransfer           common only: the model runtime and the KV transfer library
                                 never import each other
    worker                       common, engine, kvtransfer: the glue the worker processes share
    prefill, decode              the worker layer and what it glues
    gateway, planner, edge       processes: none imports another process or the worker layer

The tools (the `distserve` package: CLI, local mesh, load generator, deploy, trace report) sit
apart, above every layer: they may import any of services/, and nothing in services/ imports
them. Every import counts, also one inside a function or under TYPE_CHECKING.
"""

from __future__ import annotations

import ast
from pathlib import Path

SERVICES = Path(__file__).resolve().parents[1] / "services"
TOOLS = "distserve"  # the tools' package, beside services/

MAY_IMPORT: dict[str, set[str]] = {
    "common": set(),
    "engine": {"common"},
    "kvtransfer": {"common"},
    "worker": {"common", "engine", "kvtransfer"},
    "prefill": {"common", "engine", "kvtransfer", "worker"},
    "decode": {"common", "engine", "kvtransfer", "worker"},
    "gateway": {"common"},
    "planner": {"common", "engine"},  # the profiler measures a real engine
    "edge": {"common"},
}


def imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module imported, the services package it is in) of every import of a services
    package in a module, relative imports resolved."""
    package = path.relative_to(SERVICES.parent).with_suffix("").parts[:-1]
    found: list[tuple[int, str, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            module = ".".join([*base, *([node.module] if node.module else [])])
            # `from services import engine` imports the package services.engine
            modules = (
                [f"{module}.{a.name}" for a in node.names] if module == "services" else [module]
            )
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] == "services" and len(parts) > 1:
                found.append((node.lineno, module, parts[1]))
    return found


def tool_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module imported) of every import of the tools' package in a module."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            modules = [node.module or ""]
        else:
            continue  # a relative import stays inside services/
        found += [(node.lineno, m) for m in modules if m.split(".")[0] == TOOLS]
    return found


def tool_violations() -> list[str]:
    """One line per import of a tool by anything in services/."""
    violations = []
    for path in sorted(SERVICES.rglob("*.py")):
        if "gen" in path.relative_to(SERVICES).parts:
            continue  # generated stubs (their own `distserve.v1` is rewritten away)
        for line, module in tool_imports(path):
            rel = path.relative_to(SERVICES.parent)
            violations.append(f"{rel}:{line} imports {module}; services/ imports no tool")
    return violations


def layer_violations() -> list[str]:
    """One line per import that breaks the layering: where it is, what it imports, the rule."""
    violations = []
    for package, allowed in MAY_IMPORT.items():
        for path in sorted((SERVICES / package).rglob("*.py")):
            if "gen" in path.relative_to(SERVICES).parts:
                continue  # generated stubs
            for line, module, target in imports(path):
                if target in MAY_IMPORT and target != package and target not in allowed:
                    rel = path.relative_to(SERVICES.parent)
                    may = ", ".join(f"services.{p}" for p in sorted(allowed)) or "no other package"
                    violations.append(f"{rel}:{line} imports {module}; {package} may import {may}")
    return violations


def test_every_package_imports_only_the_layers_below_it():
    violations = layer_violations()
    assert not violations, "layering broken:\n" + "\n".join(violations)


def test_no_service_imports_a_tool():
    violations = tool_violations()
    assert not violations, "a process imports a tool:\n" + "\n".join(violations)


def test_every_layered_package_exists():
    assert all((SERVICES / package).is_dir() for package in MAY_IMPORT)
