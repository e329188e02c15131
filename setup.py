"""The package build's one hook: the gRPC stubs of protos/ are generated during the build.

Everything else about the package is declared in pyproject.toml (setuptools reads both). The
stubs are never committed (services/common/gen is git-ignored), so without this hook a wheel or
`pip install .` would ship a package that cannot import its own contracts. One generator serves
every path: `make` and this hook both call services/common/build_protos.py.

- wheel (`build_py`): stubs into the build tree, from the protos/ beside this file; the checkout's
  own services/common/gen is never copied (pyproject excludes the package), so a stale stub
  cannot reach a wheel.
- editable install (`pip install -e .`): stubs into the source tree, where the checkout imports
  them.
- sdist: stubs into the release tree too, beside the protos/ that MANIFEST.in grafts; a wheel
  built from the sdist regenerates them from those protos.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
GEN = Path("services", "common", "gen")


def _generate(protos: Path, out: Path) -> None:
    # Loaded by path: the build environment does not have the source tree on sys.path.
    spec = importlib.util.spec_from_file_location(
        "build_protos", HERE / "services" / "common" / "build_protos.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.build(protos, out)


class BuildPyWithStubs(build_py):
    """build_py, then the stubs generated into the wheel's tree (or the source tree, editable)."""

    def run(self) -> None:
        super().run()
        out = HERE / GEN if self.editable_mode else Path(self.build_lib) / GEN
        _generate(HERE / "protos", out)


class SdistWithStubs(sdist):
    """sdist whose release tree carries the generated stubs beside the protos."""

    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        _generate(Path(base_dir) / "protos", Path(base_dir) / GEN)


setup(cmdclass={"build_py": BuildPyWithStubs, "sdist": SdistWithStubs})
