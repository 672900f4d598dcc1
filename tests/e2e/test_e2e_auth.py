"""API keys and rate limits on a real stack of their own (docs/security.md), on 127.0.0.1 only.

The stack takes the keys of a key file (one plain key, one `sha256:` line) and one more from GENSERVE_API_KEYS, and
small rate limits from its serve config: the `gan` app one request per 3 s (burst 2), the `text` app 2 generated
tokens a second (burst 2), the `http` app one request per 3 s (burst 3). Only text, gan, http and health are deployed.
Each limit test has a key of its own, so the buckets of one test never leak into another.

The text app also serves LoRA adapters from a root folder of the stack's own (serve config `lora`), loaded at run
time with the admin keys of GENSERVE_ADMIN_KEYS (issue 33): a random adapter of the demo text model, which the
stack serves unless GENSERVE_TEXT_MODEL points elsewhere.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from genserve.services.client import Client
from genserve.services.client import errors as client_errors
from genserve.services.common.auth import BAD_KEY
from tests.e2e.playground import ask, chromium, page_at, wait_ready
from tests.e2e.serve_configs import serve_config
from tests.services.text.lora_helpers import demo_adapter

pytestmark = pytest.mark.e2e

PLAIN, HASHED, GAN_LIMITED, TEXT_LIMITED, HTTP_LIMITED = "e2e-plain-key", "e2e-hashed-key", "gan-k", "text-k", "http-k"
BROWSER = "browser-k"  # the playground's (tests/e2e/playground.py): a bucket of its own under the http limit
# LoRA: two admin keys and two plain ones, so each stays within the http app's burst of 3 requests.
ADMIN, ADMIN_2, LORA_USER, LORA_USER_2 = "lora-admin-k", "lora-admin-2-k", "lora-user-k", "lora-user-2-k"
KEYS = (PLAIN, HASHED, GAN_LIMITED, TEXT_LIMITED, HTTP_LIMITED, BROWSER, ADMIN, ADMIN_2, LORA_USER, LORA_USER_2)
APPS = ("text", "gan", "http", "health")
LIMITS = {
    "gan": {"requests_per_minute": 20, "requests_burst": 2},
    "text": {"tokens_per_minute": 120, "tokens_burst": 2},
    "http": {"requests_per_minute": 20, "requests_burst": 3},
}
CHAT = [{"role": "user", "content": "Say hi"}]


@pytest.fixture(scope="module")
def keyed(serve, base_port: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    folder = tmp_path_factory.mktemp("auth")
    keys = folder / "keys"
    keys.write_text(f"# e2e keys\n{PLAIN}\nsha256:{hashlib.sha256(HASHED.encode()).hexdigest()}\n")
    lora_root = folder / "lora"
    demo_adapter(lora_root / "adapter-a", seed=1)
    demo_adapter(folder / "outside" / "adapter-b", seed=2)  # a real adapter, but not under the root
    args = {app: {"rate_limits": limits} for app, limits in LIMITS.items()}
    args["text"]["lora"] = {"root": str(lora_root), "max_loras": 2, "max_cpu_loras": 2, "max_lora_rank": 8}
    config = serve_config(folder, APPS, args)
    env = {"GENSERVE_API_KEYS_FILE": str(keys),
           "GENSERVE_API_KEYS": f"{GAN_LIMITED},{TEXT_LIMITED},{HTTP_LIMITED},{BROWSER},{LORA_USER},{LORA_USER_2}",
           "GENSERVE_ADMIN_KEYS": f"{ADMIN},{ADMIN_2}"}
    with serve(base_port + 50, folder / "serve.log", "--config", str(config), env=env) as stack:
        yield stack


def http(stack, key: str | None) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url, api_key=key, max_retries=0, timeout=60)


@pytest.mark.parametrize("key", [None, "wrong-key", f"sha256:{hashlib.sha256(HASHED.encode()).hexdigest()}"])
def test_grpc_without_the_right_key_is_unauthenticated_with_one_message(keyed, key: str | None) -> None:
    with Client(keyed.address, timeout=30, api_key=key) as client:
        for call in (lambda: client.gan_sample(1, seed=1), lambda: client.model_info(),
                     lambda: list(client.generate_stream("Hi", max_tokens=2)), client.status):
            with pytest.raises(client_errors.Unauthenticated) as refused:
                call()
            assert refused.value.details == BAD_KEY


@pytest.mark.parametrize("key", [PLAIN, HASHED])
def test_grpc_with_a_plain_or_a_hashed_key_is_served(keyed, key: str) -> None:
    with Client(keyed.address, timeout=60, api_key=key) as client:
        assert len(client.gan_sample(1, seed=1).images) == 1
        assert client.model_info().model_name
        assert {app.name for app in client.status().apps} == set(APPS)


def test_the_log_says_keys_are_required_and_never_shows_one(keyed) -> None:
    log = keyed.log.read_text(errors="replace")
    assert "auth: API keys required (10 configured), 2 of them admin" in log
    assert not any(key in log for key in KEYS)


def test_health_needs_no_key(keyed) -> None:
    with Client(keyed.address, timeout=30) as client:
        assert client.health("genserve.v1.ImageGan", application="gan") == health_pb2.HealthCheckResponse.SERVING
        assert client.health("genserve.v1.TextGeneration") == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(keyed.health_address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="genserve.v1.ImageGan"),
                                                         timeout=30)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with urllib.request.urlopen(f"http://127.0.0.1:{keyed.http_port}/-/healthz", timeout=30) as response:
        assert response.status == 200


def test_http_without_the_right_key_is_401_with_one_message(keyed) -> None:
    request = urllib.request.Request(f"{keyed.http_url}/models")  # no authorization header at all
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(request, timeout=30)
    assert missing.value.code == 401
    assert json.loads(missing.value.read())["error"] == {"message": BAD_KEY, "type": "invalid_request_error",
                                                         "param": None, "code": "invalid_api_key"}
    with http(keyed, "wrong-key") as api:
        with pytest.raises(openai.AuthenticationError) as wrong:
            api.models.list()
        with pytest.raises(openai.AuthenticationError):
            api.chat.completions.create(model="text", messages=CHAT, max_tokens=2)
    assert wrong.value.status_code == 401 and wrong.value.body["message"] == BAD_KEY


@pytest.mark.parametrize("key", [PLAIN, HASHED])
def test_http_with_a_plain_or_a_hashed_key_is_served_by_the_openai_client(keyed, key: str) -> None:
    with http(keyed, key) as api:
        assert {m.id for m in api.models.list()} == {"text", "diffusion"}
        reply = api.chat.completions.create(model="text", messages=CHAT, max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens >= 1


def test_grpc_request_limit_answers_resource_exhausted_with_retry_after_then_serves(keyed) -> None:
    with Client(keyed.address, timeout=60, api_key=GAN_LIMITED) as client:
        for seed in (1, 2):
            assert len(client.gan_sample(1, seed=seed).images) == 1
        with pytest.raises(client_errors.ResourceExhausted) as limited:
            client.gan_sample(1, seed=3)
        assert "rate limit of requests" in limited.value.details
        assert 1 <= limited.value.retry_after_s <= 3
        with Client(keyed.address, timeout=60, api_key=PLAIN) as other:  # another key's bucket is its own
            assert len(other.gan_sample(1, seed=3).images) == 1
        time.sleep(limited.value.retry_after_s)
        assert len(client.gan_sample(1, seed=3).images) == 1


def test_grpc_token_limit_counts_generated_tokens(keyed) -> None:
    with Client(keyed.address, timeout=60, api_key=TEXT_LIMITED) as client:
        reply = client.generate("The", max_tokens=8, temperature=0)
        left = 2 - len(reply.token_ids)  # the bucket held 2, then lost what was generated
        with pytest.raises(client_errors.ResourceExhausted) as limited:
            client.generate("The", max_tokens=8, temperature=0)
        assert "rate limit of tokens" in limited.value.details
        assert 1 <= limited.value.retry_after_s <= max(1, math.ceil((1 - left) / 2))  # refilled at 2 tokens a second
        time.sleep(limited.value.retry_after_s)
        assert client.generate("The", max_tokens=1, temperature=0).token_ids


def test_http_request_limit_is_429_with_retry_after_then_serves(keyed) -> None:
    with http(keyed, HTTP_LIMITED) as api:
        for _ in range(3):
            api.models.list()
        with pytest.raises(openai.RateLimitError) as limited:
            api.models.list()
        retry_after = int(limited.value.response.headers["retry-after"])
        assert 1 <= retry_after <= 3
        assert limited.value.body["code"] == "rate_limit_exceeded"
        time.sleep(retry_after)
        assert {m.id for m in api.models.list()} == {"text", "diffusion"}


def test_the_playground_asks_for_a_key_and_works_with_it(keyed) -> None:
    """Within the http app's burst of 3: the settings and the models once the key is given, then one answer."""
    with chromium() as browser, page_at(browser, f"http://127.0.0.1:{keyed.http_port}/") as page:
        dialog = page.get_by_role("dialog", name="This server needs an API key")
        dialog.wait_for()
        assert BAD_KEY in dialog.get_by_role("alert").text_content()  # the server's 401 message
        dialog.get_by_label("API key").fill(BROWSER)
        dialog.get_by_role("button", name="Use key").click()
        wait_ready(page)
        page.get_by_role("spinbutton", name="Max tokens").fill("4")
        ask(page, "Say hi")
        assert page.locator(".message.assistant:last-child").get_attribute("data-state") == "done"
        assert page.evaluate("[sessionStorage.getItem('genserve.apiKey'), localStorage.getItem('genserve.apiKey')]"
                             ) == [BROWSER, None]  # kept for the session only: "remember" was not ticked


def post(stack, path: str, body: dict, key: str | None) -> tuple[int, dict | str]:
    """POST a JSON body to the HTTP API: the status and the reply (an error object, or vLLM's text)."""
    headers = {"content-type": "application/json"} | ({"authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(f"{stack.http_url}{path}", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())["error"]


def test_lora_adapter_loaded_over_http_used_by_the_openai_client_then_unloaded(keyed) -> None:
    """Issue 33's Done-when 3, through the stack: vLLM's admin routes, `model=` the adapter, 404 once unloaded."""
    load = {"lora_name": "adapter-a", "lora_path": "adapter-a"}
    assert post(keyed, "/load_lora_adapter", load, None)[0] == 401  # without the admin key
    status, error = post(keyed, "/load_lora_adapter", load, LORA_USER)
    assert status == 403 and error["code"] == "permission_denied"
    assert post(keyed, "/load_lora_adapter", load, ADMIN) == (
        200, "Success: LoRA adapter 'adapter-a' added successfully.")
    status, error = post(keyed, "/load_lora_adapter", {"lora_name": "b", "lora_path": "../outside/adapter-b"}, ADMIN)
    assert status == 400 and error["param"] == "lora_path" and "outside the adapter root" in error["message"]

    with http(keyed, LORA_USER) as api:
        models = {m.id: m for m in api.models.list()}
        assert set(models) == {"text", "adapter-a", "diffusion"}
        assert models["adapter-a"].model_extra["parent"] == "text"
        reply = api.chat.completions.create(model="adapter-a", messages=CHAT, max_tokens=3, temperature=0)
        assert reply.model == "adapter-a" and reply.usage.completion_tokens >= 1
        assert post(keyed, "/unload_lora_adapter", {"lora_name": "adapter-a"}, ADMIN) == (
            200, "Success: LoRA adapter 'adapter-a' removed successfully.")
        with pytest.raises(openai.NotFoundError) as unloaded:
            api.chat.completions.create(model="adapter-a", messages=CHAT, max_tokens=3, temperature=0)
    assert unloaded.value.body["code"] == "model_not_found" and "'adapter-a'" in unloaded.value.body["message"]
    status, error = post(keyed, "/unload_lora_adapter", {"lora_name": "adapter-a"}, ADMIN_2)
    assert status == 404 and "'adapter-a'" in error["message"]
    with http(keyed, LORA_USER_2) as api, pytest.raises(openai.NotFoundError) as unknown:
        api.completions.create(model="nobody", prompt="The", max_tokens=2)
    assert unknown.value.body["code"] == "model_not_found" and "'nobody'" in unknown.value.body["message"]


def test_lora_over_grpc_needs_an_admin_key_and_an_unloaded_adapter_is_not_found(keyed) -> None:
    with Client(keyed.address, timeout=60, api_key=LORA_USER_2) as client:
        with pytest.raises(client_errors.PermissionDenied):
            client.load_adapter("adapter-a", "adapter-a")
        with pytest.raises(client_errors.NotFound) as unknown:
            client.generate("The", max_tokens=1, adapter="adapter-gone")
    assert "'adapter-gone'" in unknown.value.details
    with Client(keyed.address, timeout=60) as client, pytest.raises(client_errors.Unauthenticated):
        client.unload_adapter("adapter-a")
