"""The tools of the mesh, apart from its processes: the `distserve` command and what its
subcommands run (the local mesh of `distserve up`, the load generator, the trace report, the
Kubernetes render, the planner's offline commands). Nothing in services/ imports from here."""

# The package's version, declared here alone: pyproject.toml reads it (setuptools' `attr`, without
# importing the package), `distserve --version` prints it, and it tags the container images
# (`make image`) and the image `deploy render` defaults to. Readable with no install (the image
# build reads it with the system's python).
__version__ = "0.1.0"
