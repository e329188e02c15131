"""What Prometheus needs to find the mesh's metrics.

The gateway, the planner and every worker serve Prometheus' text format on `/metrics` at
METRICS_PORT (services/common/metrics.py), always in plaintext (mesh TLS covers gRPC, not this
port); so does Envoy, its own statistics forwarded from its admin interface (which stays on the
pod's 127.0.0.1: services/edge/envoy_config.py's stats listener). Their pods carry the
`prometheus.io/scrape|port|path` annotations that annotation-based scrape configs read, and
`--service-monitor` adds a ServiceMonitor (monitoring.coreos.com/v1, the Prometheus operator's;
the cluster needs its CRD) selecting their Services' `metrics` port.
"""

from __future__ import annotations

from distserve.deploy.objects import METRICS_LABEL, METRICS_PORT, PART_OF, meta


def scrape_annotations() -> dict[str, str]:
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(METRICS_PORT),
        "prometheus.io/path": "/metrics",
    }


def service_monitor(namespace: str, interval_s: int = 15) -> dict:
    """One ServiceMonitor over the mesh's Services with a `metrics` port (METRICS_LABEL; not
    the edge's public Service), in the mesh's namespace; each target is labelled with its pod
    and component."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": meta("distserve", "monitoring", namespace),
        "spec": {
            "selector": {
                "matchLabels": {"app.kubernetes.io/part-of": PART_OF, METRICS_LABEL: "true"}
            },
            "namespaceSelector": {"matchNames": [namespace]},
            "endpoints": [
                {
                    "port": "metrics",
                    "path": "/metrics",
                    "scheme": "http",
                    "interval": f"{interval_s}s",
                }
            ],
            "targetLabels": ["app.kubernetes.io/component"],
        },
    }
