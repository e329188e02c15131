"""The generated Envoy configuration: checked by the real Envoy binary, and its edge config."""

from __future__ import annotations

import json
import subprocess

import pytest

from services.common.errors import InvalidRequest
from services.edge.config import EdgeConfig, Upstream, read_api_keys
from services.edge.envoy import envoy_binary
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


def test_api_keys_are_read_one_per_line(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# team keys\nsk-a\n\n  sk-b  \n")
    assert read_api_keys(path) == ("sk-a", "sk-b")
