"""The generated Envoy configuration: checked by the real Envoy binary, and its edge config."""

from __future__ import annotations

import json
import socket
import subprocess
import urllib.error
import urllib.request

import pytest

from services.common.errors import InvalidRequest
from services.edge.config import EdgeConfig, Upstream, read_api_keys
from services.edge.envoy import Envoy, envoy_binary
from services.edge.envoy_config import envoy_config
from tests.certs import self_signed

GATEWAYS = [Upstream("127.0.0.1:50051", "127.0.0.1:8000"), Upstream("gw-2:50051", "gw-2:8000")]


def validate(config: dict, tmp_path) -> subprocess.CompletedProcess:
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(config))
    return subprocess.run(
        [str(envoy_binary()), "--mode", "validate", "--disable-hot-restart", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("everything", [False, True], ids=["defaults", "tls-keys-limits"])
def test_the_generated_config_is_valid_for_envoy(tmp_path, everything):
    edge = EdgeConfig()
    if everything:
        cert, key = self_signed(tmp_path)
        edge = EdgeConfig(
            host="0.0.0.0",
            port=8443,
            tls_cert=cert,
            tls_key=key,
            api_keys=("k1", "k2"),
            rate_limit_rps=5,
            rate_limit_burst=9,
            access_log=str(tmp_path / "access.log"),
            admin_port=9901,
            stats_port=9100,
        )
    config = envoy_config(edge, GATEWAYS)
    checked = validate(config, tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert config["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    assert clusters["gateway_grpc"]["type"] == "STRICT_DNS"  # a gateway named by host name
    options = clusters["gateway_grpc"]["typed_extension_protocol_options"]
    assert "http2_protocol_options" in json.dumps(options)
    assert "grpc_health_check" in clusters["gateway_grpc"]["health_checks"][0]
    assert clusters["gateway_http"]["health_checks"][0]["http_health_check"]["path"] == "/health"


def test_edge_config_refuses_what_cannot_work(tmp_path):
    with pytest.raises(InvalidRequest, match="both a certificate and a key"):
        EdgeConfig(tls_cert=tmp_path / "cert.pem")
    with pytest.raises(InvalidRequest, match="does not exist"):
        EdgeConfig(tls_cert=tmp_path / "cert.pem", tls_key=tmp_path / "key.pem")
    with pytest.raises(InvalidRequest, match="without spaces"):
        EdgeConfig(api_keys=("two words",))
    with pytest.raises(InvalidRequest, match="distinct"):
        EdgeConfig(api_keys=("k", "k"))
    with pytest.raises(InvalidRequest, match="rate limit"):
        EdgeConfig(rate_limit_rps=5, rate_limit_burst=0)
    with pytest.raises(InvalidRequest, match="needs a fixed port: give --admin-port"):
        EdgeConfig(stats_port=9100)
    with pytest.raises(InvalidRequest, match="must differ"):
        EdgeConfig(stats_port=9901, admin_port=9901)


def test_api_keys_are_read_one_per_line(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# team keys\nsk-a\n\n  sk-b  \n")
    assert read_api_keys(path) == ("sk-a", "sk-b")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, method: str = "GET") -> tuple[int, str]:
    data = b"" if method == "POST" else None
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, data, method=method), timeout=5
        ) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


def test_the_stats_port_serves_envoys_statistics_and_nothing_else_of_its_admin():
    """Prometheus reads Envoy's own statistics on the stats port; the admin interface's other
    endpoints (config dump with its secrets, /quitquitquit, runtime changes) are not reachable
    there, whatever the method."""
    admin, stats = _free_port(), _free_port()
    edge = EdgeConfig(port=0, admin_port=admin, stats_port=stats, access_log="", rate_limit_rps=0)
    with Envoy(edge, [Upstream("127.0.0.1:1", "127.0.0.1:2")]) as envoy:
        assert envoy.admin_address == f"127.0.0.1:{admin}"
        for path in ("/metrics", "/stats/prometheus"):
            status, text = _get(f"http://127.0.0.1:{stats}{path}")
            assert status == 200
            # Prometheus' text format, with the edge listener's own counters.
            assert "# TYPE envoy_http_downstream_rq_total counter" in text
            assert 'envoy_http_downstream_rq_total{envoy_http_conn_manager_prefix="edge"}' in text
        for path, method in [
            ("/quitquitquit", "POST"),
            ("/config_dump", "GET"),
            ("/runtime_modify?a=b", "POST"),
            ("/logging?level=trace", "POST"),
            ("/metrics", "POST"),
            ("/stats/prometheus", "POST"),
            ("/stats", "GET"),
            ("/metrics/../quitquitquit", "POST"),
        ]:
            assert _get(f"http://127.0.0.1:{stats}{path}", method)[0] == 404, (path, method)
        assert envoy.popen.poll() is None  # still running: /quitquitquit never reached it
        assert _get(f"http://{envoy.admin_address}/ready")[1].strip() == "LIVE"
