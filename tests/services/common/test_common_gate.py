"""The gate inside the handler wrapper: keys and the peer rule before the handler runs, health and deployment-handle
calls open, rate limits with `retry-after`, generated tokens charged per chunk; and the HTTP form of a refusal."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from grpc_health.v1 import health_pb2

from genserve.services.common.auth import BAD_KEY, NOT_ADMIN, REMOTE_NEEDS_KEY, Access, digest
from genserve.services.common.errors import PermissionDenied, RateLimited, Unauthenticated
from genserve.services.common.gate import RETRY_AFTER, Gate
from genserve.services.common.metrics import ServiceMetrics
from genserve.services.common.rate_limit import RateLimits
from genserve.services.common.rpc import StatusSet, streaming, unary
from genserve.services.http.errors import refusal
from genserve.v1 import text_pb2

KEY = "s3cret-key"
LOCAL, REMOTE = "ipv6:%5B::ffff:127.0.0.1%5D:40000", "ipv4:10.0.0.1:40000"


class Context:
    """The part of Ray Serve's RayServegRPCContext the wrapper and the gate use."""

    def __init__(self, peer: str = LOCAL, key: str | None = None) -> None:
        self._peer = peer
        self._metadata = [("application", "test")] + ([("authorization", f"Bearer {key}")] if key else [])
        self.code, self.details, self.trailing = None, None, []

    def request_id(self) -> str:
        return "req-1"

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self._metadata

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def set_trailing_metadata(self, metadata: list[tuple[str, str]]) -> None:
        self.trailing = metadata


class Service:
    def __init__(self, access: Access, limits: RateLimits | None = None) -> None:
        self.metrics = ServiceMetrics("test")
        self.gate = Gate(access, limits)
        self.ran = 0

    @unary(text_pb2.TextRequest, text_pb2.TextResponse)
    async def Generate(self, request: text_pb2.TextRequest) -> text_pb2.TextResponse:
        self.ran += 1
        return text_pb2.TextResponse(text="ok", token_ids=[1, 2])

    @streaming(text_pb2.TextRequest)
    async def GenerateStream(self, request: text_pb2.TextRequest):
        self.ran += 1
        for i in range(4):
            yield text_pb2.TextChunk(text="x", token_ids=[i])

    @unary(health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse)
    async def Check(self, request: health_pb2.HealthCheckRequest) -> health_pb2.HealthCheckResponse:
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def call(service: Service, context: Context | None) -> text_pb2.TextResponse:
    return asyncio.run(service.Generate(text_pb2.TextRequest(prompt="p"), grpc_context=context))


def stream(service: Service, context: Context) -> list[text_pb2.TextChunk]:
    async def consume() -> list[text_pb2.TextChunk]:
        return [c async for c in service.GenerateStream(text_pb2.TextRequest(prompt="p"), grpc_context=context)]

    return asyncio.run(consume())


@pytest.mark.parametrize(("peer", "key"), [(LOCAL, None), (LOCAL, "wrong"), (REMOTE, None), (REMOTE, KEY + "x")])
def test_with_keys_a_missing_or_wrong_key_is_refused_before_the_handler(peer: str, key: str | None) -> None:
    service, context = Service(Access((digest(KEY),))), Context(peer, key)
    assert call(service, context) == text_pb2.TextResponse()
    assert (context.code, context.details) == (grpc.StatusCode.UNAUTHENTICATED, BAD_KEY)
    assert service.ran == 0 and service.metrics.ongoing == 0


def test_with_keys_the_right_key_is_served_from_any_host() -> None:
    service = Service(Access((digest("other"), digest(KEY))))
    for peer in (LOCAL, REMOTE):
        context = Context(peer, KEY)
        assert call(service, context).text == "ok" and context.code is None
    assert service.ran == 2


def test_without_keys_another_host_is_refused_and_this_one_served() -> None:
    service = Service(Access())
    remote, local = Context(REMOTE), Context(LOCAL)
    call(service, remote)
    assert (remote.code, remote.details) == (grpc.StatusCode.UNAUTHENTICATED, REMOTE_NEEDS_KEY)
    assert call(service, local).text == "ok" and local.code is None
    with pytest.raises(StatusSet):
        stream(service, Context(REMOTE))
    assert service.ran == 1


def test_insecure_serves_another_host_without_a_key() -> None:
    context = Context(REMOTE)
    assert call(Service(Access(insecure=True)), context).text == "ok" and context.code is None


def test_health_checks_and_deployment_handle_calls_need_no_key() -> None:
    service, context = Service(Access((digest(KEY),))), Context(REMOTE)
    reply = asyncio.run(service.Check(health_pb2.HealthCheckRequest(), grpc_context=context))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING and context.code is None
    assert call(service, None).text == "ok"  # another app's handle call (the HTTP API's, diffusion's)


def test_over_the_request_limit_the_call_gets_resource_exhausted_and_retry_after() -> None:
    service = Service(Access(), RateLimits(requests_per_minute=6, requests_burst=1))  # one per 10 s
    assert call(service, Context()).text == "ok"
    refused = Context()
    call(service, refused)
    assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.details == "rate limit of requests reached for this caller; retry in 10 s"
    assert refused.trailing == [(RETRY_AFTER, "10")]
    other_host_key = Service(Access((digest(KEY), digest("k2"))), RateLimits(requests_per_minute=6, requests_burst=1))
    assert call(other_host_key, Context(REMOTE, KEY)).text == "ok"
    assert call(other_host_key, Context(REMOTE, "k2")).text == "ok"  # per key, not per host
    assert (service.ran, other_host_key.ran) == (1, 2)


def test_streamed_tokens_are_charged_as_they_go_out() -> None:
    service = Service(Access(), RateLimits(tokens_per_minute=60, tokens_burst=3))  # one token a second
    assert len(stream(service, Context())) == 4  # admitted with 3, ends at -1
    with pytest.raises(StatusSet):
        stream(service, Context())
    refused = Context()
    call(service, refused)
    assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED and refused.trailing == [(RETRY_AFTER, "2")]


def test_an_http_refusal_is_an_openai_error_with_the_callers_retry_after() -> None:
    unauthorized = refusal(Unauthenticated(BAD_KEY))
    assert unauthorized.status_code == 401 and "retry-after" not in unauthorized.headers
    assert json.loads(unauthorized.body) == {"error": {"message": BAD_KEY, "type": "invalid_request_error",
                                                       "param": None, "code": "invalid_api_key"}}
    limited = refusal(RateLimited("tokens", 7))
    assert limited.status_code == 429 and limited.headers["retry-after"] == "7"
    body = json.loads(limited.body)["error"]
    assert (body["type"], body["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert body["message"] == "rate limit of tokens reached for this caller; retry in 7 s"


class Admin:
    """A service whose LoadAdapter is an admin call, as the text app's."""

    def __init__(self, access: Access) -> None:
        self.metrics = ServiceMetrics("test")
        self.gate = Gate(access, None, (text_pb2.LoadAdapterRequest,))

    @unary(text_pb2.LoadAdapterRequest, text_pb2.AdaptersResponse)
    async def LoadAdapter(self, request: text_pb2.LoadAdapterRequest) -> text_pb2.AdaptersResponse:
        return text_pb2.AdaptersResponse(adapters=[request.name])


def test_an_admin_rpc_needs_an_admin_key_when_keys_are_set() -> None:
    service = Admin(Access((digest(KEY), digest("root")), admin_digests=(digest("root"),)))

    def load(context: Context | None) -> text_pb2.AdaptersResponse:
        return asyncio.run(service.LoadAdapter(text_pb2.LoadAdapterRequest(name="a", path="a"), grpc_context=context))

    assert list(load(Context(REMOTE, "root")).adapters) == ["a"]
    assert list(load(None).adapters) == ["a"]  # a deployment-handle call: the HTTP ingress checked its caller
    for key, code, details in ((KEY, grpc.StatusCode.PERMISSION_DENIED, NOT_ADMIN),
                               (None, grpc.StatusCode.UNAUTHENTICATED, BAD_KEY)):
        refused = Context(LOCAL, key)
        assert load(refused) == text_pb2.AdaptersResponse()
        assert (refused.code, refused.details) == (code, details)
    open_here = Admin(Access())
    assert list(asyncio.run(open_here.LoadAdapter(text_pb2.LoadAdapterRequest(name="b"), grpc_context=Context())
                            ).adapters) == ["b"]


def test_an_http_admin_route_without_an_admin_key_is_403() -> None:
    denied = refusal(PermissionDenied(NOT_ADMIN))
    assert denied.status_code == 403
    assert json.loads(denied.body)["error"] == {"message": NOT_ADMIN, "type": "invalid_request_error", "param": None,
                                                "code": "permission_denied"}


def test_the_fake_context_has_only_methods_of_ray_serves_grpc_context() -> None:
    from ray.serve.grpc_util import RayServegRPCContext

    used = {name for name in vars(Context) if not name.startswith("_")}
    assert used <= set(dir(RayServegRPCContext))
