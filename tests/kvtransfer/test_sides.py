"""The data plane's client side (the puller, in a decode process) imports nothing from its server
side (leases, the chunk source and its servers, in a prefill process): what both need (frames,
checksums, the refusal codes, UCX set-up) lives in modules of their own."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "services.kvtransfer"
CLIENT = ("puller",)  # and whatever of the package it imports, transitively
SERVER = ("source", "chunk_server", "leases", "servicer", "faults")


def imports_of(root: str, module: str) -> list[tuple[int, str]]:
    """(line, module) of each services.kvtransfer module `module` imports, anywhere in it."""
    path = os.path.join(root, *PACKAGE.split("."), f"{module}.py")
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == PACKAGE:
            names = [f"{PACKAGE}.{alias.name}" for alias in node.names]  # from the package
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        else:
            continue
        out += [
            (node.lineno, name.removeprefix(f"{PACKAGE}.").split(".")[0])
            for name in names
            if name.startswith(f"{PACKAGE}.")
        ]
    return out


def forbidden_imports(root: str, client: tuple[str, ...], server: tuple[str, ...]) -> list[str]:
    """Each import of a server-side module by a client-side one, named with how it is reached."""
    found = []
    via = {name: name for name in client}  # module -> the chain of imports that reaches it
    todo = list(client)
    while todo:
        module = todo.pop()
        for line, target in imports_of(root, module):
            if target in server:
                found.append(
                    f"services/kvtransfer/{module}.py:{line} imports {PACKAGE}.{target} "
                    f"(client side: {via[module]})"
                )
            elif target not in via:
                via[target] = f"{via[module]} -> {target}"
                todo.append(target)
    return found


def test_the_puller_side_imports_nothing_of_the_server_side():
    assert forbidden_imports(ROOT, CLIENT, SERVER) == []


def test_a_forbidden_import_is_named(tmp_path):
    """The check itself: a client module that reaches the server side through another is named,
    line and chain."""
    package = tmp_path / "services" / "kvtransfer"
    package.mkdir(parents=True)
    (package / "puller.py").write_text("from services.kvtransfer import wire\n")
    late = "import os\n\n\ndef f():\n    from services.kvtransfer.source import X\n"
    (package / "wire.py").write_text(late)  # an import inside a function counts too
    (package / "source.py").write_text("")
    assert forbidden_imports(str(tmp_path), CLIENT, SERVER) == [
        "services/kvtransfer/wire.py:5 imports services.kvtransfer.source "
        "(client side: puller -> wire)"
    ]
