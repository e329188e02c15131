"""Generates the Python stubs of protos/ into services/common/gen/ (run by `make`, and by the
package build: setup.py calls `build` for the wheel, the sdist and an editable install).

protoc names imports after the proto package (`from distserve.v1 import common_pb2`); the
stubs live inside this package, so those imports are rewritten to
`from services.common.gen.distserve.v1 import common_pb2`. The .proto files are copied beside
their stubs, so an installed package carries its contracts (clients in other languages are
generated from them). Nothing here is edited by hand.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"
OUT = Path(__file__).resolve().parent / "gen"


def build(protos: Path = PROTOS, out: Path = OUT) -> list[Path]:
    """Generate the stubs of every .proto under `protos` into `out` (replaced whole, so a removed
    proto leaves no stale stub); returns the files written."""
    from grpc_tools import protoc

    files = sorted(protos.rglob("*.proto"))
    if not files:
        raise SystemExit(f"no .proto files under {protos}")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{protos}",
        f"-I{include}",
        f"--python_out={tmp}",
        f"--pyi_out={tmp}",
        f"--grpc_python_out={tmp}",
        *(str(f.relative_to(protos)) for f in files),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    pattern = re.compile(r"^from distserve\.(\S+) import", re.MULTILINE)
    ours = r"from services.common.gen.distserve.\1 import"
    for path in sorted(tmp.rglob("*.py*")):
        path.write_text(pattern.sub(ours, path.read_text()))
    for proto in files:
        shutil.copyfile(proto, tmp / proto.relative_to(protos))
    for d in [tmp, *(p for p in tmp.rglob("*") if p.is_dir())]:
        (d / "__init__.py").touch()
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return sorted(p for p in out.rglob("*") if p.is_file())


if __name__ == "__main__":
    written = build()
    print(f"generated {len(written)} files into {OUT.relative_to(ROOT)}", file=sys.stderr)
