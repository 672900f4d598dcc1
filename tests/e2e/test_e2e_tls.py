"""TLS on the real stack: `python -m genserve.services.serve` with GENSERVE_TLS_CERT/KEY from a throwaway CA made here.

gRPC goes through the Caddy that serve.py starts (Serve's own proxy moves to port + 20000), HTTP through Ray's ssl_*
options. Mutual TLS is checked on the same stack with a second front from services/common/tls_front.py that
requires client certificates, in front of the same Serve gRPC proxy (the serve-config side of GENSERVE_TLS_CLIENT_CA
is unit-tested in tests/services/common/test_tls_front.py). Everything stays on 127.0.0.1.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from genserve.services.client import Client, ClientTls
from genserve.services.client.cli import main
from genserve.services.client.errors import InvalidArgument, Unavailable
from genserve.services.common import tls_front
from genserve.services.common.tls_front import Route, TlsFiles
from tests.e2e.serve_configs import serve_config
from tests.services.common.tls_certs import Pki, make_pki

pytestmark = pytest.mark.e2e

STACK_OFFSET = 80
MTLS_FRONT_OFFSET = 85
PROMPT = "The with statement"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_stack(serve, base_port: int, pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    env = {"GENSERVE_TLS_CERT": str(pki.server.cert), "GENSERVE_TLS_KEY": str(pki.server.key),
           "GENSERVE_TLS_CLIENT_CA": ""}
    folder = tmp_path_factory.mktemp("tls")
    config = serve_config(folder, ("text", "gan", "http", "health"))
    with serve(base_port + STACK_OFFSET, folder / "serve.log", "--config", str(config), env=env) as stack:
        yield stack
    # serve.py stopped Caddy with the stack: nothing listens on the public gRPC port any more.
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", stack.grpc_port), timeout=5).close()


def _tls(pki: Pki, ca: Path | None = None, client=None) -> ClientTls:
    return ClientTls(str(ca or pki.ca), *((str(client.cert), str(client.key)) if client else ()))


def _internal(stack) -> str:
    """Serve's own gRPC proxy behind Caddy (plaintext, on 127.0.0.1 here)."""
    return f"127.0.0.1:{tls_front.internal_port(stack.grpc_port)}"


def test_start_up_message_says_tls_is_on(tls_stack) -> None:
    log = tls_stack.log.read_text()
    assert f"https://127.0.0.1:{tls_stack.http_port}/v1" in log
    assert "--tls-ca CA.pem" in log and "TLS on (server certificate only)" in log


def test_a_client_trusting_the_ca_gets_what_serve_itself_answers(tls_stack, pki: Pki) -> None:
    secure, raw = Client(tls_stack.address, timeout=60, tls=_tls(pki)), Client(_internal(tls_stack), timeout=60)
    with secure, raw:
        reply = secure.generate(PROMPT, max_tokens=8, temperature=0, seed=1)
        assert reply == raw.generate(PROMPT, max_tokens=8, temperature=0, seed=1)
        streamed = list(secure.generate_stream(PROMPT, max_tokens=8, temperature=0, seed=1))
        assert "".join(chunk.text for chunk in streamed) == reply.text and len(streamed) > 1
        images = secure.gan_sample(2, seed=3)
        assert [image.png for image in images.images] == [image.png for image in raw.gan_sample(2, seed=3).images]


def test_errors_keep_their_code_and_field_through_the_front(tls_stack, pki: Pki) -> None:
    with Client(tls_stack.address, timeout=60, tls=_tls(pki)) as client:
        for _ in range(20):
            with pytest.raises(InvalidArgument, match="temperature"):
                client.generate(PROMPT, temperature=-1)


def test_plaintext_and_other_ca_clients_fail_on_grpc(tls_stack, pki: Pki) -> None:
    for tls in (None, _tls(pki, ca=pki.other_ca)):  # no retries: a handshake that fails once fails every time
        with Client(tls_stack.address, timeout=30, tls=tls, retry=None) as client, pytest.raises(Unavailable):
            client.model_info()


def test_cli_over_tls(tls_stack, pki: Pki, capsys) -> None:
    assert main(["--address", tls_stack.address, "--tls-ca", str(pki.ca), "info"]) == 0
    assert "model_name" in capsys.readouterr().out


def _https(ca: Path) -> httpx.Client:
    return httpx.Client(verify=ssl.create_default_context(cafile=str(ca)), timeout=60)


def test_openai_client_over_https(tls_stack, pki: Pki) -> None:
    base_url = f"https://127.0.0.1:{tls_stack.http_port}/v1"
    with _https(pki.ca) as http, openai.OpenAI(base_url=base_url, api_key="unused", http_client=http,
                                                max_retries=0) as api, \
            Client(tls_stack.address, timeout=60, tls=_tls(pki)) as client:
        assert {model.id for model in api.models.list()} == {"text", "diffusion"}
        reply = api.completions.create(model="text", prompt=PROMPT, max_tokens=8, temperature=0)
        assert reply.choices[0].text == client.generate(PROMPT, max_tokens=8, temperature=0).text
        stream = api.completions.create(model="text", prompt=PROMPT, max_tokens=8, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == reply.choices[0].text


def test_plaintext_and_other_ca_clients_fail_on_http(tls_stack, pki: Pki) -> None:
    with _https(pki.other_ca) as http, pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        http.get(f"https://127.0.0.1:{tls_stack.http_port}/v1/models")
    with httpx.Client(timeout=30) as plain, pytest.raises(httpx.HTTPError):
        plain.get(f"http://127.0.0.1:{tls_stack.http_port}/v1/models")


@pytest.fixture(scope="module")
def mtls_address(tls_stack, pki: Pki, base_port: int) -> Iterator[str]:
    """A front that requires client certificates from the CA, in front of the same Serve gRPC proxy."""
    address = f"127.0.0.1:{base_port + MTLS_FRONT_OFFSET}"
    files = TlsFiles(str(pki.server.cert), str(pki.server.key), client_ca=str(pki.ca))
    front = tls_front.launch(files, (Route("grpc", address, _internal(tls_stack), grpc=True),))
    yield address
    front.stop()


def test_mutual_tls_serves_only_clients_with_a_certificate_from_the_ca(mtls_address: str, pki: Pki) -> None:
    with Client(mtls_address, timeout=60, tls=_tls(pki, client=pki.client)) as client:
        assert client.model_info().model_name
    for tls in (_tls(pki), _tls(pki, client=pki.other_client)):
        with Client(mtls_address, timeout=30, tls=tls, retry=None) as client, pytest.raises(Unavailable):
            client.model_info()
