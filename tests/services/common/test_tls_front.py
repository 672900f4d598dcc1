"""services/common/tls_front.py: the TLS settings, the serve-config rewrite, Caddy's config, and a real Caddy in
front of in-process gRPC and HTTP servers on 127.0.0.1 (the e2e test puts it in front of the real stack)."""

from __future__ import annotations

import copy
import json
import socket
import ssl
import threading
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import httpx
import pytest

from genserve.services.common import tls_front
from genserve.services.common.deploy_config import serve_config
from genserve.services.common.tls_front import Route, TlsFiles
from genserve.v1 import text_pb2, text_pb2_grpc
from tests.services.common.tls_certs import Pki, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _files(pki: Pki, *, mutual: bool) -> TlsFiles:
    return TlsFiles(str(pki.server.cert), str(pki.server.key), str(pki.ca) if mutual else None)


def _env(pki: Pki, **extra: str) -> dict[str, str]:
    return {"GENSERVE_TLS_CERT": str(pki.server.cert), "GENSERVE_TLS_KEY": str(pki.server.key), **extra}


# --- settings -------------------------------------------------------------------------------------------------------

def test_no_tls_variables_means_no_tls() -> None:
    assert TlsFiles.from_env({"GENSERVE_TLS_CA": "ca.pem"}) is None


def test_tls_settings_come_from_the_environment(pki: Pki) -> None:
    assert TlsFiles.from_env(_env(pki)) == _files(pki, mutual=False)
    assert TlsFiles.from_env(_env(pki, GENSERVE_TLS_CLIENT_CA=str(pki.ca))) == _files(pki, mutual=True)


@pytest.mark.parametrize("drop", ["GENSERVE_TLS_CERT", "GENSERVE_TLS_KEY"])
def test_cert_and_key_are_needed_together(pki: Pki, drop: str) -> None:
    env = _env(pki, GENSERVE_TLS_CLIENT_CA=str(pki.ca))
    del env[drop]
    with pytest.raises(ValueError, match="TLS needs both GENSERVE_TLS_CERT and GENSERVE_TLS_KEY"):
        TlsFiles.from_env(env)


def test_a_missing_file_names_its_variable(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="GENSERVE_TLS_CLIENT_CA: no such file"):
        TlsFiles.from_env(_env(pki, GENSERVE_TLS_CLIENT_CA=str(tmp_path / "missing.pem")))


def test_start_without_tls_changes_nothing_and_starts_nothing() -> None:
    config = serve_config("local")
    before = copy.deepcopy(config)
    front = tls_front.start(config, {})
    assert not front.active and front.summary() == "" and front.client_flags() == ""
    assert config == before
    front.stop()


def test_start_reports_bad_settings_as_a_runtime_error(pki: Pki) -> None:
    with pytest.raises(RuntimeError, match="TLS: TLS needs both"):
        tls_front.start(serve_config("local"), {"GENSERVE_TLS_CERT": str(pki.server.cert)})


# --- the serve config -------------------------------------------------------------------------------------------------

def test_tls_moves_serve_grpc_behind_caddy_and_gives_http_rays_ssl_options(pki: Pki) -> None:
    from ray.serve.config import HTTPOptions
    from ray.serve.schema import ServeDeploySchema

    config = serve_config("local", grpc_port=9000, http_port=8000)
    routes = tls_front.plan(config, _files(pki, mutual=False), local_only=False)
    assert routes == (Route("grpc", ":9000", "127.0.0.1:29000", grpc=True),)
    assert config["grpc_options"]["port"] == 29000
    assert config["http_options"] == {"host": "127.0.0.1", "port": 8000, "ssl_certfile": str(pki.server.cert),
                                      "ssl_keyfile": str(pki.server.key)}
    # What Ray reads: its own schema and the HTTPOptions its proxy starts uvicorn with.
    options = HTTPOptions(**ServeDeploySchema.model_validate(config).http_options.model_dump())
    assert (options.ssl_certfile, options.ssl_keyfile, options.ssl_ca_certs) == (
        str(pki.server.cert), str(pki.server.key), None)


def test_mutual_tls_puts_http_behind_caddy_too(pki: Pki) -> None:
    """Ray hands uvicorn ssl_ca_certs but not ssl_cert_reqs (CERT_NONE), which would serve clients without a
    certificate; so Caddy checks them and Serve's HTTP proxy moves to 127.0.0.1."""
    config = serve_config("gpu", grpc_port=9000, http_port=8000)
    routes = tls_front.plan(config, _files(pki, mutual=True), local_only=False)
    assert routes == (Route("grpc", ":9000", "127.0.0.1:29000", grpc=True),
                      Route("http", "0.0.0.0:8000", "127.0.0.1:28000", grpc=False))
    assert config["http_options"] == {"host": "127.0.0.1", "port": 28000}


@pytest.mark.parametrize(("auth", "listen"), [({}, "127.0.0.1:9000"), ({"GENSERVE_INSECURE": "1"}, ":9000"),
                                             ({"GENSERVE_API_KEYS": "k1"}, ":9000")])
def test_without_api_keys_the_front_serves_this_host_only(pki: Pki, auth: dict, listen: str, monkeypatch) -> None:
    """Serve sees callers through the front as 127.0.0.1, which the no-keys peer rule would serve."""
    launched = []
    monkeypatch.setattr(tls_front, "launch", lambda files, routes: launched.append(routes) or tls_front.Front())
    tls_front.start(serve_config("local", grpc_port=9000), _env(pki, **auth))
    assert launched[0][0].listen == listen


def test_a_port_too_high_to_move_is_refused(pki: Pki) -> None:
    with pytest.raises(ValueError, match="at most 45535"):
        tls_front.plan(serve_config("local", grpc_port=50000), _files(pki, mutual=False), local_only=False)


# --- Caddy's config ---------------------------------------------------------------------------------------------------

def test_caddy_config_requires_client_certificates_only_for_mutual_tls(pki: Pki) -> None:
    routes = (Route("grpc", ":9000", "127.0.0.1:29000", grpc=True),)
    for mutual in (False, True):
        server = tls_front.caddy_config(_files(pki, mutual=mutual), routes, "/tmp/x")["apps"]["http"]["servers"]["grpc"]
        (policy,) = server["tls_connection_policies"]  # one policy, no SNI match: no fallback without client auth
        assert "match" not in policy
        if mutual:
            assert policy["client_authentication"] == {"ca": {"provider": "file", "pem_files": [str(pki.ca)]},
                                                       "mode": "require_and_verify"}
        else:
            assert "client_authentication" not in policy
        assert server["protocols"] == ["h1", "h2"]
        assert server["routes"][0]["handle"][0]["transport"]["versions"] == ["h2c", "2"]


def test_caddy_config_has_no_admin_endpoint_and_loads_the_certificate(pki: Pki) -> None:
    config = tls_front.caddy_config(_files(pki, mutual=False), (), "/tmp/x")
    assert config["admin"]["disabled"] is True
    assert config["apps"]["tls"]["certificates"]["load_files"] == [
        {"certificate": str(pki.server.cert), "key": str(pki.server.key), "tags": [tls_front.CERTIFICATE_TAG]}]


def test_committed_deploy_configs_are_fresh() -> None:
    """Fails when tls_front changed and `python -m genserve.services.common.tls_front` was not rerun."""
    for name in tls_front.DEPLOY_CONFIGS:
        assert (tls_front.DEPLOY_DIR / name).read_text() == tls_front.deploy_config_text(name), name
    mutual = json.loads((tls_front.DEPLOY_DIR / "caddy.mtls.json").read_text())
    policies = [s["tls_connection_policies"] for s in mutual["apps"]["http"]["servers"].values()]
    assert all(p[0]["client_authentication"]["ca"]["pem_files"] == ["/certs/ca.crt"] for p in policies)


# --- a real Caddy -----------------------------------------------------------------------------------------------------

class Upstream(text_pb2_grpc.TextGenerationServicer):
    """Generate answers with the x-forwarded-for metadata Caddy adds, or, for "deny", RESOURCE_EXHAUSTED with a
    trailing retry-after; GenerateStream sends "a", waits for the test to have read it, then sends "b"."""

    def __init__(self) -> None:
        self.first_chunk_read = threading.Event()

    def Generate(self, request, context):
        if request.prompt == "deny":
            context.set_trailing_metadata((("retry-after", "3"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "slow down")
        return text_pb2.TextResponse(text=dict(context.invocation_metadata()).get("x-forwarded-for", ""))

    def GenerateStream(self, request, context):
        yield text_pb2.TextChunk(text="a")
        assert self.first_chunk_read.wait(10), "the first chunk never reached the client: the front buffers"
        yield text_pb2.TextChunk(text="b", finish_reason="stop")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[Upstream, int]]:
    servicer = Upstream()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    text_pb2_grpc.add_TextGenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(grace=None)


SSE_FIRST_EVENT_READ = threading.Event()


class _HttpUpstream(BaseHTTPRequestHandler):
    """GET /stream: an SSE stream of two events, the second once the test has read the first; else the request as
    JSON."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        if self.path == "/stream":
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("connection", "close")
            self.end_headers()
            self.wfile.write(b"data: a\n\n")
            self.wfile.flush()
            SSE_FIRST_EVENT_READ.wait(10)
            self.wfile.write(b"data: b\n\n")
            return
        body = json.dumps({"path": self.path, "proto": self.headers.get("x-forwarded-proto")}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def http_upstream() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _HttpUpstream)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()


@pytest.fixture(scope="module", params=["tls", "mtls"])
def front(request, pki: Pki, upstream, http_upstream: int) -> Iterator[tuple[str, str, bool]]:
    """Caddy on two free 127.0.0.1 ports: gRPC (h2c to `upstream`) and HTTP (to `http_upstream`)."""
    mutual = request.param == "mtls"
    grpc_address, http_address = f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"
    routes = (Route("grpc", grpc_address, f"127.0.0.1:{upstream[1]}", grpc=True),
              Route("http", http_address, f"127.0.0.1:{http_upstream}", grpc=False))
    running = tls_front.launch(_files(pki, mutual=mutual), routes)
    yield grpc_address, http_address, mutual
    running.stop()
    assert running.process.returncode is not None and not Path(running.workdir.name).exists()


def _credentials(pki: Pki, ca: Path, client: bool) -> grpc.ChannelCredentials:
    if not client:
        return grpc.ssl_channel_credentials(ca.read_bytes())
    return grpc.ssl_channel_credentials(ca.read_bytes(), pki.client.key.read_bytes(), pki.client.cert.read_bytes())


def _generate(address: str, credentials: grpc.ChannelCredentials | None, prompt: str = "") -> text_pb2.TextResponse:
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel:
        return text_pb2_grpc.TextGenerationStub(channel).Generate(text_pb2.TextRequest(prompt=prompt), timeout=10)


def test_a_client_trusting_the_ca_is_served_and_seen_as_forwarded(front, pki: Pki) -> None:
    grpc_address, _, mutual = front
    assert _generate(grpc_address, _credentials(pki, pki.ca, client=mutual)).text == "127.0.0.1"


def test_plaintext_and_untrusting_clients_fail(front, pki: Pki) -> None:
    grpc_address, _, mutual = front
    for credentials in (None, _credentials(pki, pki.other_ca, client=mutual)):
        with pytest.raises(grpc.RpcError) as failure:
            _generate(grpc_address, credentials)
        assert failure.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_refuses_clients_without_a_certificate_from_the_ca(front, pki: Pki) -> None:
    grpc_address, _, mutual = front
    foreign = grpc.ssl_channel_credentials(pki.ca.read_bytes(), pki.other_client.key.read_bytes(),
                                           pki.other_client.cert.read_bytes())
    for credentials in (grpc.ssl_channel_credentials(pki.ca.read_bytes()), foreign):
        if mutual:
            with pytest.raises(grpc.RpcError) as failure:
                _generate(grpc_address, credentials)
            assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
        else:  # TLS only: a certificate is neither asked for nor checked
            assert _generate(grpc_address, credentials).text == "127.0.0.1"


def test_status_details_and_trailing_metadata_pass_through_every_time(front, pki: Pki) -> None:
    """A trailers-only error, 100 times: with flush_interval -1 about 1 in 10 reached the client as UNKNOWN."""
    grpc_address, _, mutual = front
    seen = []
    with grpc.secure_channel(grpc_address, _credentials(pki, pki.ca, client=mutual)) as channel:
        stub = text_pb2_grpc.TextGenerationStub(channel)
        for _ in range(100):
            with pytest.raises(grpc.RpcError) as failure:
                stub.Generate(text_pb2.TextRequest(prompt="deny"), timeout=10)
            seen.append((failure.value.code(), failure.value.details(), failure.value.trailing_metadata()))
    assert all(code == grpc.StatusCode.RESOURCE_EXHAUSTED and details == "slow down" for code, details, _ in seen), \
        {(code, details) for code, details, _ in seen}
    assert all(("retry-after", "3") in tuple(trailing) for _, _, trailing in seen)


def test_stream_chunks_arrive_one_by_one(front, pki: Pki, upstream) -> None:
    grpc_address, _, mutual = front
    servicer = upstream[0]
    servicer.first_chunk_read.clear()
    with grpc.secure_channel(grpc_address, _credentials(pki, pki.ca, client=mutual)) as channel:
        stream = text_pb2_grpc.TextGenerationStub(channel).GenerateStream(text_pb2.TextRequest(), timeout=15)
        assert next(stream).text == "a"
        servicer.first_chunk_read.set()
        assert [chunk.text for chunk in stream] == ["b"]


def _https_client(pki: Pki, ca: Path, client: bool) -> httpx.Client:
    context = ssl.create_default_context(cafile=str(ca))
    if client:
        context.load_cert_chain(str(pki.client.cert), str(pki.client.key))
    return httpx.Client(verify=context, timeout=10)


def test_http_route_over_tls(front, pki: Pki) -> None:
    _, http_address, mutual = front
    with _https_client(pki, pki.ca, client=mutual) as client:
        assert client.get(f"https://{http_address}/v1/models").json() == {"path": "/v1/models", "proto": "https"}
    failing = [(pki.other_ca, mutual)] + ([(pki.ca, False)] if mutual else [])
    for client in (_https_client(pki, ca, with_certificate) for ca, with_certificate in failing):
        with client, pytest.raises(httpx.HTTPError):
            client.get(f"https://{http_address}/v1/models")
    with httpx.Client(timeout=10) as plain:  # Caddy answers plaintext on a TLS port itself, never forwarding it
        refused = plain.get(f"http://{http_address}/v1/models")
    assert refused.status_code == 400 and "/v1/models" not in refused.text


def test_http_event_stream_arrives_event_by_event(front, pki: Pki) -> None:
    _, http_address, mutual = front
    SSE_FIRST_EVENT_READ.clear()
    with _https_client(pki, pki.ca, client=mutual) as client, client.stream("GET", f"https://{http_address}/stream") \
            as response:
        lines = response.iter_lines()
        assert next(lines) == "data: a"
        SSE_FIRST_EVENT_READ.set()
        assert [line for line in lines if line] == ["data: b"]


def test_summary_and_client_flags_say_how_to_connect(front) -> None:
    grpc_address, _, mutual = front
    running = tls_front.Front((Route("grpc", grpc_address, "127.0.0.1:29000", grpc=True),),
                              TlsFiles("c", "k", "ca" if mutual else None), process=object())
    assert running.client_flags().startswith(" --tls-ca CA.pem")
    assert ("--tls-cert client.pem --tls-key client.key" in running.client_flags()) == mutual
    assert "plaintext on [::]:29000" in running.summary()


def test_a_busy_port_fails_start_with_caddys_exit_code(pki: Pki, upstream) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(RuntimeError, match="did not start"):
            tls_front.launch(_files(pki, mutual=False), (Route("grpc", address, "127.0.0.1:1", grpc=True),))
