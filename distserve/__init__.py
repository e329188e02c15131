"""The tools of the mesh, apart from its processes: the `distserve` command and what its
subcommands run (the local mesh of `distserve up`, the load generator, the trace report, the
Kubernetes render, the planner's offline commands). Nothing in services/ imports from here."""

import importlib.metadata

# Declared once, in pyproject.toml; the installed package's metadata holds it. The image tag that
# `deploy render` defaults to.
__version__ = importlib.metadata.version("distserve-mesh")
