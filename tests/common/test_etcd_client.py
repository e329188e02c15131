"""The mesh's etcd client options (services/common/etcd_client.py): what cannot take effect is
refused by name; over TLS (a real etcd started by the test, requiring client certificates of the
mesh's CA) a client holding one joins, and one without is refused with an error that says so."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from distserve.etcd import Etcd
from services.common.discovery import EtcdDiscovery, Member, Snapshot
from services.common.errors import InvalidRequest
from services.common.etcd_client import EtcdConfig
from services.common.mesh_tls import MeshTls
from services.worker.announcer import Announcer
from tests.certs import mesh_pki

CA, CERT, KEY = Path("/ca.pem"), Path("/cert.pem"), Path("/key.pem")


@pytest.mark.parametrize(
    "urls, tls, named",
    [
        ("https://a:2379", {}, "--etcd-ca"),
        ("https://a:2379", {"ca": CA, "cert": CERT}, "--etcd-key"),
        ("https://a:2379", {"ca": CA, "key": KEY}, "--etcd-cert"),
        ("http://a:2379", {"ca": CA}, "--etcd-ca"),
        ("http://a:2379", {"server_name": "x"}, "--etcd-server-name"),
        ("http://a:2379,https://b:2379", {"ca": CA}, "--etcd"),
        ("grpc://a:2379", {}, "--etcd"),
        ("http://a:2379/v3", {}, "--etcd"),
        ("http://a:port", {}, "--etcd"),
        (" , ", {}, "--etcd"),
        ("http://a:2379", {"prefix": "distserve/"}, "--etcd-prefix"),
        ("http://a:2379", {"prefix": "/a b/"}, "--etcd-prefix"),
        ("http://a:2379", {"prefix": "/a//b/"}, "--etcd-prefix"),
        ("http://a:2379", {"prefix": "/"}, "--etcd-prefix"),
    ],
)
def test_etcd_options_that_cannot_take_effect_are_refused_by_name(urls, tls, named):
    with pytest.raises(InvalidRequest, match=named):
        EtcdConfig.parse(urls, **tls)


def test_several_members_and_their_tls_round_trip_through_the_command_line():
    config = EtcdConfig.parse(" https://a:2379, https://b:2380 ", CA, CERT, KEY, "x", "/m/1/")
    assert config.endpoints == ("https://a:2379", "https://b:2380")
    argv = config.args()
    assert argv[:2] == ["--etcd", "https://a:2379,https://b:2380"]
    assert dict(zip(argv[2::2], argv[3::2], strict=True)) == {
        "--etcd-ca": "/ca.pem",
        "--etcd-cert": "/cert.pem",
        "--etcd-key": "/key.pem",
        "--etcd-server-name": "x",
        "--etcd-prefix": "/m/1/",
    }
    assert "--etcd-prefix" not in EtcdConfig.parse("http://a:2379").args()  # the default


def test_the_gateway_and_workers_refuse_an_etcd_option_they_cannot_honour(capsys):
    from services.gateway.__main__ import parse as gateway
    from services.prefill.__main__ import parse as prefill

    for parse, argv in (
        (gateway, ["--model", "/m", "--etcd", "https://a:2379"]),
        (prefill, ["--etcd-cert", "/c.pem", "--etcd-key", "/k.pem"]),
        (prefill, ["--etcd-prefix", "/m/"]),
    ):
        with pytest.raises(SystemExit):
            parse(argv)
        err = capsys.readouterr().err
        assert "--etcd-ca" in err or "--etcd, which is not given" in err, err


def test_two_meshes_with_their_own_prefixes_share_one_etcd_apart(tls_etcd):
    """Each mesh's membership and its planners' election under its own --etcd-prefix: a watcher
    of one sees only its own workers, and each mesh elects its own leader under one name."""
    from services.common.election import Election

    a = dataclasses.replace(tls_etcd.config, prefix="/distserve/a/")
    b = dataclasses.replace(tls_etcd.config, prefix="/distserve/b/")

    async def main() -> tuple[set[str], set[str], list[bool]]:
        workers = [EtcdDiscovery(a, ttl_s=2), EtcdDiscovery(b, ttl_s=2)]
        watchers = [EtcdDiscovery(a), EtcdDiscovery(b)]
        elections = [Election(a, "planner", "pa", ttl_s=2), Election(b, "planner", "pb", ttl_s=2)]
        runs = [asyncio.create_task(e.run()) for e in elections]
        try:
            await workers[0].register(Member("wa", "decode", "127.0.0.1:1"))
            await workers[1].register(Member("wb", "prefill", "127.0.0.1:2"))
            seen = []
            for w in watchers:
                first = await anext(w.watch())
                assert isinstance(first, Snapshot)
                seen.append(set(first.members))
            await asyncio.wait_for(
                asyncio.gather(*(e.wait(leading=True) for e in elections)), timeout=10
            )
            return seen[0], seen[1], [e.leading for e in elections]
        finally:
            for t in runs:
                t.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
            for e in elections:
                await e.close()
            for d in (*workers, *watchers):
                if d in workers:
                    await d.deregister()
                await d.close()

    seen_a, seen_b, leading = asyncio.run(main())
    assert (seen_a, seen_b) == ({"wa"}, {"wb"})
    assert leading == [True, True]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    return {"mesh": mesh_pki(root, "mesh"), "intruder": mesh_pki(root, "intruder")}


@pytest.fixture(scope="module")
def tls_etcd(pki):
    cert, key, ca = (str(p) for p in pki["mesh"])
    tls = MeshTls(b"", b"", b"", (cert, key, ca))  # etcd reads the files
    with Etcd(tls=tls) as etcd:
        yield etcd


def test_a_client_with_a_mesh_certificate_joins_a_tls_etcd(tls_etcd):
    assert tls_etcd.url.startswith("https://")
    config = tls_etcd.config  # the mesh's CA, certificate and key; SERVER_NAME checked

    async def main() -> dict:
        worker, watcher = EtcdDiscovery(config, ttl_s=2), EtcdDiscovery(config)
        try:
            await worker.register(Member("w", "decode", "127.0.0.1:1"))
            await worker.renew()
            first = await anext(watcher.watch())
            assert isinstance(first, Snapshot)
            return first.members
        finally:
            await worker.deregister()
            await worker.close()
            await watcher.close()

    assert set(asyncio.run(main())) == {"w"}


@pytest.mark.parametrize("who", [None, "intruder"])
def test_a_client_without_a_certificate_of_the_mesh_ca_is_refused_clearly(tls_etcd, pki, who):
    mesh = tls_etcd.config
    cert, key = (pki[who][0], pki[who][1]) if who else (None, None)
    config = EtcdConfig(mesh.endpoints, mesh.ca, cert, key, mesh.server_name)

    async def join() -> None:
        await Announcer(config, Member("w", "decode", "127.0.0.1:1")).start(timeout_s=1.0)

    with pytest.raises(RuntimeError) as refused:
        asyncio.run(join())
    message = str(refused.value)
    assert tls_etcd.url in message and "UNAVAILABLE" in message, message
    if who is None:
        assert "presents no certificate" in message and "--etcd-cert" in message, message
