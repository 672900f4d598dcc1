"""The text app's LoRA serving, without Ray: the serve config's `lora` block, the `adapter` field, the admin RPCs and
the replica following the app's record of adapter names (services/text/adapter_names.py), on the committed demo
model with a random PEFT adapter. The same through the real stack: tests/e2e/test_e2e_auth.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from pydantic import ValidationError

from genserve.services.common.errors import to_status
from genserve.services.common.validation import parse
from genserve.services.text.app import TextGeneration
from genserve.services.text.engine.adapters import LoraConfig
from genserve.services.text.schema import LoadAdapterIn, TextIn
from genserve.services.text.settings import LoraArgs, TextArgs
from genserve.v1 import text_pb2
from tests.services.text.lora_helpers import demo_adapter

PROMPT = text_pb2.TextRequest(prompt="Once upon a time", max_tokens=6, temperature=0.0)


@pytest.mark.parametrize(("lora", "field"), [
    ({}, "lora.root"),
    ({"root": "/r", "max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras"),
    ({"root": "/r", "max_lora_rank": 0}, "lora.max_lora_rank"),
    ({"root": "/r", "adapters": {"no spaces": "a"}}, "adapters"),
    ({"root": "/r", "rank": 8}, "lora.rank"),
])
def test_a_bad_lora_block_fails_naming_the_field(lora: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=field.replace(".", r"\.")):
        TextArgs.model_validate({"lora": lora})


def test_the_lora_block_reaches_the_engine_config(tmp_path: Path) -> None:
    args = TextArgs.model_validate({"lora": {"root": str(tmp_path), "max_loras": 2, "max_cpu_loras": 3,
                                             "max_lora_rank": 8, "adapters": {"sql": "sql-lora"}}})
    assert args.engine_config().lora == LoraConfig(str(tmp_path), 2, 3, 8, (("sql", "sql-lora"),))
    assert args.lora.folders() == {"sql": str(tmp_path.resolve() / "sql-lora")}
    assert TextArgs().engine_config().lora is None


@pytest.mark.parametrize("name", ["x" * 129, "a b", "-a", "é", "a\n"])
def test_an_adapter_name_out_of_bounds_is_invalid_naming_the_field(name: str) -> None:
    with pytest.raises(ValidationError) as bad:
        parse(TextIn, text_pb2.TextRequest(prompt="hi", adapter=name))
    status = to_status(bad.value, "rid")
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT and status.details.startswith("adapter: ")
    with pytest.raises(ValidationError, match="name"):
        parse(LoadAdapterIn, text_pb2.LoadAdapterRequest(name=name, path="a"))


def test_an_adapter_name_within_bounds_reaches_the_sampling_params() -> None:
    request = parse(TextIn, text_pb2.TextRequest(prompt="hi", adapter="org/sql-lora_v1.2"))
    assert request.sampling_params(room=10).adapter == "org/sql-lora_v1.2"
    assert parse(TextIn, text_pb2.TextRequest(prompt="hi")).sampling_params(room=10).adapter == ""


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TextGeneration]:
    root = tmp_path_factory.mktemp("lora-root")
    demo_adapter(root / "a", seed=1)
    demo_adapter(root / "b", seed=2)
    demo_adapter(tmp_path_factory.mktemp("elsewhere") / "c", seed=3)
    service = TextGeneration.func_or_class(None, TextArgs(lora=LoraArgs(root=str(root))))
    try:
        yield service
    finally:
        service.engine.shutdown()


def status_of(app: TextGeneration, call) -> tuple[grpc.StatusCode, str]:
    """The status a gRPC client would get for what `call` (a coroutine) raised."""
    with pytest.raises(Exception) as raised:
        asyncio.run(call)
    status = to_status(raised.value, "rid", app.known_errors)
    return status.code, status.details


def generate(app: TextGeneration, adapter: str = "") -> list[int]:
    request = text_pb2.TextRequest()
    request.CopyFrom(PROMPT)
    if adapter:
        request.adapter = adapter
    return list(asyncio.run(app.Generate(request)).token_ids)


def test_an_adapter_loaded_at_run_time_is_listed_used_and_unloaded(app: TextGeneration) -> None:
    base = generate(app)
    loaded = asyncio.run(app.LoadAdapter(text_pb2.LoadAdapterRequest(name="a", path="a")))
    assert list(loaded.adapters) == ["a"]
    assert list(asyncio.run(app.GetModelInfo(text_pb2.ModelInfoRequest())).adapters) == ["a"]
    adapted = generate(app, "a")
    assert adapted != base  # the adapter's delta changes the greedy tokens
    assert generate(app, "a") == adapted
    assert list(asyncio.run(app.UnloadAdapter(text_pb2.UnloadAdapterRequest(name="a"))).adapters) == []
    assert status_of(app, app.Generate(text_pb2.TextRequest(prompt="hi", adapter="a"))) == (
        grpc.StatusCode.NOT_FOUND, "adapter: adapter 'a' is not loaded")
    assert status_of(app, app.UnloadAdapter(text_pb2.UnloadAdapterRequest(name="a")))[0] == grpc.StatusCode.NOT_FOUND


def test_an_unknown_adapter_is_not_found_naming_it(app: TextGeneration) -> None:
    code, details = status_of(app, app.Generate(text_pb2.TextRequest(prompt="hi", adapter="nobody")))
    assert code == grpc.StatusCode.NOT_FOUND and "'nobody'" in details


@pytest.mark.parametrize("path", ["../elsewhere/c", "/etc", "a/../../x"])
def test_a_path_outside_the_root_is_refused_naming_the_field(app: TextGeneration, path: str) -> None:
    code, details = status_of(app, app.LoadAdapter(text_pb2.LoadAdapterRequest(name="c", path=path)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("path: ") and "outside" in details
    assert "c" not in app.engine.engine.adapters()


def test_a_folder_that_is_no_adapter_is_refused(app: TextGeneration) -> None:
    code, details = status_of(app, app.LoadAdapter(text_pb2.LoadAdapterRequest(name="c", path=".")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "adapter_config.json" in details


class Remote:
    """`handle.method.remote(...)` of a deployment handle: awaitable, calling `fn`."""

    def __init__(self, fn):
        self.fn = fn

    async def remote(self, *args):
        return self.fn(*args)


class Record:
    """A stand-in for the handle of the app's AdapterNames deployment, over the dict `folders`."""

    def __init__(self, folders: dict[str, str]):
        self.folders = folders
        self.folder = Remote(folders.get)
        self.set = Remote(self._set)
        self.remove = Remote(lambda name: folders.pop(name, None) is not None)
        self.names = Remote(lambda: sorted(folders))

    def _set(self, name: str, folder: str) -> list[str]:
        self.folders[name] = folder
        return sorted(self.folders)


def test_a_replica_follows_the_shared_record_of_names(app: TextGeneration) -> None:
    """A load recorded by another replica is loaded here on first use; an unload there is NOT_FOUND here."""
    root = Path(app.engine.engine.registry.root)
    app.names = Record({"b": str(root / "b")})
    try:
        assert "b" not in app.engine.engine.adapters()
        assert generate(app, "b") != generate(app)
        assert app.engine.engine.adapter_folders() == {"b": root / "b"}
        assert list(asyncio.run(app.GetModelInfo(text_pb2.ModelInfoRequest())).adapters) == ["b"]
        app.names.folders.clear()  # unloaded through another replica
        assert status_of(app, app.Generate(text_pb2.TextRequest(prompt="hi", adapter="b")))[0] == (
            grpc.StatusCode.NOT_FOUND)
        assert app.engine.engine.adapters() == []
        asyncio.run(app.LoadAdapter(text_pb2.LoadAdapterRequest(name="b2", path="b")))
        assert app.names.folders == {"b2": str(root / "b")}  # recorded for the other replicas
    finally:
        app.names = None
        for name in app.engine.engine.adapters():
            app.engine.engine.unload_adapter(name)


def test_without_a_lora_block_adapters_cannot_be_loaded_or_used() -> None:
    service = TextGeneration.func_or_class(None, TextArgs())
    try:
        code, details = status_of(service, service.LoadAdapter(text_pb2.LoadAdapterRequest(name="a", path="a")))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "lora" in details
        code, details = status_of(service, service.Generate(text_pb2.TextRequest(prompt="hi", adapter="a")))
        assert code == grpc.StatusCode.NOT_FOUND and "'a'" in details
    finally:
        service.engine.shutdown()
