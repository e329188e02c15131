"""The tools of the mesh, apart from its processes: the `distserve` command and what its
subcommands run (the local mesh of `distserve up`, the load generator, the trace report, the
Kubernetes render, the planner's offline commands). Nothing in services/ imports from here."""

__version__ = "0.1.0"  # the package's version (pyproject.toml reads it) and the image's tag
