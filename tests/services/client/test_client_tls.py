"""The SDK and CLI over TLS, against an in-process gRPC server with TLS of its own (no Caddy: only the client side)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from genserve.services.client import AsyncClient, Client, ClientTls
from genserve.services.client.cli import main
from genserve.services.client.errors import Unavailable
from genserve.v1 import text_pb2_grpc
from tests.services.client.conftest import FakeText
from tests.services.common.tls_certs import Pki, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _tls_server(pki: Pki, *, client_auth: bool) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    text_pb2_grpc.add_TextGenerationServicer_to_server(FakeText([]), server)
    credentials = grpc.ssl_server_credentials(
        [(pki.server.key.read_bytes(), pki.server.cert.read_bytes())],
        root_certificates=pki.ca.read_bytes() if client_auth else None, require_client_auth=client_auth,
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def tls_server(pki: Pki) -> Iterator[str]:
    server, address = _tls_server(pki, client_auth=False)
    yield address
    server.stop(grace=None)


@pytest.fixture
def mtls_server(pki: Pki) -> Iterator[str]:
    server, address = _tls_server(pki, client_auth=True)
    yield address
    server.stop(grace=None)


def test_sdk_trusting_the_ca_is_served(tls_server: str, pki: Pki) -> None:
    with Client(tls_server, timeout=10, tls=ClientTls(ca=str(pki.ca))) as client:
        assert client.generate("abc").text == "cba"


def test_async_sdk_trusting_the_ca_is_served(tls_server: str, pki: Pki) -> None:
    async def call() -> str:
        async with AsyncClient(tls_server, timeout=10, tls=ClientTls(ca=str(pki.ca))) as client:
            return (await client.generate("abc")).text

    assert asyncio.run(call()) == "cba"


def test_sdk_trusting_another_ca_or_in_plaintext_fails(tls_server: str, pki: Pki) -> None:
    for tls in (ClientTls(ca=str(pki.other_ca)), None):
        with Client(tls_server, timeout=10, tls=tls) as client, pytest.raises(Unavailable):
            client.generate("abc")


def test_sdk_client_certificate_for_mutual_tls(mtls_server: str, pki: Pki) -> None:
    own = ClientTls(ca=str(pki.ca), cert=str(pki.client.cert), key=str(pki.client.key))
    with Client(mtls_server, timeout=10, tls=own) as client:
        assert client.generate("abc").text == "cba"
    foreign = ClientTls(ca=str(pki.ca), cert=str(pki.other_client.cert), key=str(pki.other_client.key))
    for tls in (ClientTls(ca=str(pki.ca)), foreign):
        with Client(mtls_server, timeout=10, tls=tls) as client, pytest.raises(Unavailable):
            client.generate("abc")


def test_client_tls_needs_cert_and_key_together(pki: Pki) -> None:
    with pytest.raises(ValueError, match="both cert and key"):
        ClientTls(ca=str(pki.ca), cert=str(pki.client.cert))


def test_client_tls_from_env_reads_the_client_variables_only(pki: Pki) -> None:
    assert ClientTls.from_env({"GENSERVE_TLS_CERT": "server.pem", "GENSERVE_TLS_KEY": "server.key"}) is None
    env = {"GENSERVE_TLS_CA": "ca.pem", "GENSERVE_TLS_CLIENT_CERT": "c.pem", "GENSERVE_TLS_CLIENT_KEY": "c.key"}
    assert ClientTls.from_env(env) == ClientTls("ca.pem", "c.pem", "c.key")


def test_cli_tls_flags_before_or_after_the_subcommand(mtls_server: str, pki: Pki, capsys) -> None:
    flags = ["--tls-ca", str(pki.ca), "--tls-cert", str(pki.client.cert), "--tls-key", str(pki.client.key)]
    assert main(["--address", mtls_server, *flags, "text", "abc"]) == 0
    assert main(["--address", mtls_server, "text", "xyz", *flags]) == 0
    assert capsys.readouterr().out.split() == ["cba", "zyx"]


def test_cli_tls_defaults_come_from_the_environment(mtls_server: str, pki: Pki, monkeypatch, capsys) -> None:
    monkeypatch.setenv("GENSERVE_TLS_CA", str(pki.ca))
    monkeypatch.setenv("GENSERVE_TLS_CLIENT_CERT", str(pki.client.cert))
    monkeypatch.setenv("GENSERVE_TLS_CLIENT_KEY", str(pki.client.key))
    assert main(["--address", mtls_server, "text", "abc"]) == 0
    assert capsys.readouterr().out.strip() == "cba"


def test_cli_says_what_went_wrong_with_tls(tls_server: str, mtls_server: str, pki: Pki, capsys) -> None:
    assert main(["--address", tls_server, "--tls-ca", str(pki.other_ca), "text", "abc"]) == 1
    assert f"the TLS handshake with {tls_server} failed" in capsys.readouterr().err
    for address, flags in ((tls_server, []), (mtls_server, ["--tls-ca", str(pki.ca)])):
        assert main(["--address", address, *flags, "text", "abc"]) == 1
        assert f"{address} closed the connection: a TLS server called without --tls-ca" in capsys.readouterr().err


def test_cli_missing_ca_file_exits_2(tls_server: str, tmp_path: Path, capsys) -> None:
    missing = tmp_path / "nope.pem"
    assert main(["--address", tls_server, "--tls-ca", str(missing), "text", "abc"]) == 2
    assert str(missing) in capsys.readouterr().err
