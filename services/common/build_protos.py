"""Generates the Python stubs of protos/ into services/common/gen/ (run by `make`).

protoc names imports after the proto package (`from distserve.v1 import common_pb2`); the
stubs live inside this package, so those imports are rewritten to
`from services.common.gen.distserve.v1 import common_pb2`. Nothing here is edited by hand.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"
OUT = Path(__file__).resolve().parent / "gen"


def build() -> list[Path]:
    from grpc_tools import protoc

    files = sorted(PROTOS.rglob("*.proto"))
    if not files:
        raise SystemExit(f"no .proto files under {PROTOS}")
    tmp = OUT.with_name("gen.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTOS}",
        f"-I{include}",
        f"--python_out={tmp}",
        f"--pyi_out={tmp}",
        f"--grpc_python_out={tmp}",
        *(str(f.relative_to(PROTOS)) for f in files),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    pattern = re.compile(r"^from distserve\.(\S+) import", re.MULTILINE)
    generated = []
    for path in sorted(tmp.rglob("*.py*")):
        text = pattern.sub(r"from services.common.gen.distserve.\1 import", path.read_text())
        path.write_text(text)
        generated.append(path)
    for d in [tmp, *(p for p in tmp.rglob("*") if p.is_dir())]:
        (d / "__init__.py").touch()
    shutil.rmtree(OUT, ignore_errors=True)
    tmp.rename(OUT)
    return [OUT / p.relative_to(tmp) for p in generated]


if __name__ == "__main__":
    out = build()
    print(f"generated {len(out)} files into {OUT.relative_to(ROOT)}", file=sys.stderr)
