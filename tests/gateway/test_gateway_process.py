"""The gateway process stays small: it never imports the model runtime."""

from __future__ import annotations

import subprocess
import sys


def test_the_gateway_never_imports_torch():
    code = (
        "import sys, services.gateway.__main__, services.gateway.http_api, services.edge.envoy; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
