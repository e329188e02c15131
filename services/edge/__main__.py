"""`python -m services.edge`: run Envoy in front of one or more gateways.

Generates Envoy's configuration from the options, starts Envoy, waits until it is ready and
prints the JSON ready line `distserve up` waits for; stops Envoy on SIGTERM or SIGINT.
`--print-config` prints the generated configuration instead (for a deployment that runs Envoy
itself, e.g. on Kubernetes).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from services.common.errors import DistServeError
from services.common.server import announce_ready
from services.edge.config import Upstream
from services.edge.envoy import Envoy
from services.edge.envoy_config import envoy_config
from services.edge.options import add_edge_options, edge_config


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.edge", description=__doc__)
    p.add_argument("--host", default="127.0.0.1", help="the listener's address")
    p.add_argument(
        "--gateway",
        action="append",
        required=True,
        metavar="GRPC_HOST:PORT,HTTP_HOST:PORT",
        help="a gateway's gRPC and HTTP addresses (repeatable)",
    )
    p.add_argument("--print-config", action="store_true", help="print Envoy's config and exit")
    add_edge_options(p)
    a = p.parse_args(argv)
    try:
        gateways = [Upstream(*g.split(",", 1)) for g in a.gateway if "," in g]
        if len(gateways) != len(a.gateway):
            p.error("--gateway takes GRPC_HOST:PORT,HTTP_HOST:PORT")
        config = edge_config(a, a.host)
    except DistServeError as e:
        print(f"distserve edge: error: {e}", file=sys.stderr)
        return 2
    if a.print_config:
        json.dump(envoy_config(config, gateways), sys.stdout, indent=1)
        print()
        return 0
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    envoy = Envoy(config, gateways, die_with_parent=True)
    envoy.start()
    try:
        announce_ready(
            "edge", address=envoy.address, admin_address=envoy.admin_address, tls=config.tls
        )
        while not stop.wait(timeout=0.5):
            if envoy.popen.poll() is not None:
                print(
                    f"distserve edge: envoy exited with code {envoy.popen.returncode}",
                    file=sys.stderr,
                )
                return 1
    finally:
        envoy.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
