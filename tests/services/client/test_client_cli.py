"""The `genserve` CLI against the fake server: text (unary and --stream), chat, gan PNGs, errors, option order and
dispatch."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from genserve.services.client.cli import main


def test_text_prints_the_completion(fake_server, capsys) -> None:
    address, seen = fake_server
    assert main(["--address", address, "text", "hello", "--max-tokens", "5", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == "olleh\n"
    request = seen[-1][1]
    assert request.max_tokens == 5 and request.HasField("temperature") and request.temperature == 0
    assert not request.HasField("top_p")


def test_text_json(fake_server, capsys) -> None:
    address, _ = fake_server
    assert main(["--address", address, "text", "ab", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"text": "ba", "token_ids": [1, 2], "finish_reason": "length"}


def test_text_sends_a_json_schema_or_a_regex(fake_server, capsys) -> None:
    address, seen = fake_server
    assert main(["--address", address, "text", "ab", "--json-schema", '{"type": "object"}']) == 0
    assert seen[-1][1].json_schema == '{"type": "object"}' and seen[-1][1].regex == ""
    assert main(["--address", address, "text", "ab", "--regex", "[a-z]+", "--stream"]) == 0
    assert seen[-1][1].regex == "[a-z]+" and seen[-1][1].json_schema == ""
    with pytest.raises(SystemExit):  # argparse: not both
        main(["--address", address, "text", "ab", "--regex", "a", "--json-schema", "{}"])


def test_text_stream_writes_chunks(fake_server, capsys) -> None:
    address, _ = fake_server
    assert main(["--address", address, "text", "hey", "--stream", "--stop", "."]) == 0
    assert capsys.readouterr().out == "hey\n"


def test_gan_writes_pngs(fake_server, tmp_path: Path, capsys) -> None:
    address, _ = fake_server
    assert main(["--address", address, "gan", "-n", "2", "-o", str(tmp_path / "out")]) == 0
    files = sorted((tmp_path / "out").glob("*.png"))
    assert [f.name for f in files] == ["gan-0.png", "gan-1.png"]
    assert files[0].read_bytes().startswith(b"\x89PNG")


def test_errors_exit_1_with_code_and_details(fake_server, capsys) -> None:
    address, _ = fake_server
    assert main(["--address", address, "text", "hi", "--temperature", "-1"]) == 1
    assert capsys.readouterr().err == "genserve: INVALID_ARGUMENT: temperature: must be >= 0\n"


def test_offline_commands_dispatch_to_their_modules(monkeypatch) -> None:
    calls = []

    class Module:
        @staticmethod
        def add_arguments(parser):
            parser.add_argument("--epochs", type=int)

        @staticmethod
        def run(args):
            calls.append(args.epochs)
            return 0

    monkeypatch.setattr("importlib.import_module", lambda name: calls.append(name) or Module)
    assert main(["train", "gan", "--epochs", "3"]) == 0
    assert main(["serve", "--epochs", "1"]) == 0
    assert calls == ["genserve.services.gan.train", 3, "genserve.services.serve", 1]


def test_unknown_arguments_are_refused(fake_server) -> None:
    address, _ = fake_server
    with pytest.raises(SystemExit):
        main(["--address", address, "status", "--bogus"])


def test_a_missing_input_file_is_a_clear_error(fake_server, tmp_path: Path, capsys) -> None:
    address, _ = fake_server
    assert main(["--address", address, "vae", "decode", str(tmp_path / "nope.json"), "-o", str(tmp_path)]) == 2
    assert "nope.json" in capsys.readouterr().err


def test_chat_one_shot_streams_the_answer(fake_server, capsys) -> None:
    address, seen = fake_server
    assert main(["chat", "Capital of France?", "--address", address]) == 0
    assert capsys.readouterr().out == "[1] Capital of France?\n"
    request = seen[-1][1]
    assert [(m.role, m.content) for m in request.messages] == [("user", "Capital of France?")]
    assert not request.prompt and request.temperature == 0 and request.max_tokens == 512


def test_chat_loop_keeps_the_history_until_reset_and_ends_on_eof(fake_server, capsys, monkeypatch) -> None:
    address, seen = fake_server
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nagain\n/reset\n\nfresh\n"))
    assert main(["--address", address, "chat", "--system", "Be brief."]) == 0
    out, err = capsys.readouterr()
    assert "fake-model" in err and "(history cleared)" in err
    assert out.splitlines()[:3] == ["> [2] hello", "> [4] again", "> > > [2] fresh"]
    history = [[(m.role, m.content) for m in r.messages] for _, r in seen]
    assert history[1] == [("system", "Be brief."), ("user", "hello"), ("assistant", "[2] hello"), ("user", "again")]
    assert history[2] == [("system", "Be brief."), ("user", "fresh")]


def test_common_options_go_before_or_after_the_subcommand(fake_server, capsys) -> None:
    address, _ = fake_server
    assert main(["text", "hi", "--address", address, "--timeout", "2"]) == 0
    assert main(["--address", "127.0.0.1:1", "--timeout", "1", "text", "hi", "--address", address]) == 0
    assert capsys.readouterr().out == "ih\nih\n"


def test_the_api_key_comes_from_the_flag_before_or_after_the_subcommand_or_the_env(fake_server, capsys,
                                                                                  monkeypatch) -> None:
    address, _ = fake_server
    monkeypatch.delenv("GENSERVE_API_KEY", raising=False)
    assert main(["info", "--address", address]) == 0
    assert main(["--api-key", "k1", "info", "--address", address]) == 0
    assert main(["info", "--address", address, "--api-key", "k2"]) == 0
    monkeypatch.setenv("GENSERVE_API_KEY", "k3")
    assert main(["info", "--address", address]) == 0
    names = [line.split(None, 1)[1] for line in capsys.readouterr().out.splitlines() if line.startswith("model_name")]
    assert names == ["fake-model", "Bearer k1", "Bearer k2", "Bearer k3"]


def test_no_server_is_said_plainly(capsys) -> None:
    assert main(["info", "--address", "127.0.0.1:1", "--timeout", "2"]) == 1
    assert capsys.readouterr().err == "genserve: no genserve server at 127.0.0.1:1 — start one with `make serve`\n"


def test_adapters_load_list_unload_and_text_with_an_adapter(fake_server, capsys) -> None:
    address, seen = fake_server
    assert main(["--address", address, "adapters", "load", "sql", "loras/sql"]) == 0
    assert (seen[-1][1].name, seen[-1][1].path) == ("sql", "loras/sql")
    assert main(["adapters", "list", "--address", address]) == 0  # the options after the op, as after a command
    assert main(["--address", address, "text", "hi", "--adapter", "sql"]) == 0
    assert seen[-1][1].adapter == "sql"
    assert main(["--address", address, "adapters", "unload", "sql"]) == 0
    assert capsys.readouterr().out == "sql\nsql\nih\n\n"
    assert main(["--address", address, "adapters", "unload", "sql"]) == 1
    assert capsys.readouterr().err == "genserve: NOT_FOUND: adapter: adapter 'sql' is not loaded\n"


def test_model_picks_one_of_the_text_apps_further_base_models(fake_server, capsys) -> None:
    address, seen = fake_server
    assert main(["--address", address, "text", "hi", "--model", "qwen3"]) == 0
    assert seen[-1][1].model == "qwen3" and not seen[-1][1].HasField("adapter")
    assert main(["--address", address, "text", "hi"]) == 0
    assert not seen[-1][1].HasField("model")  # unset: the app's first model
    assert main(["--address", address, "chat", "hi", "--model", "qwen3"]) == 0
    assert seen[-1][1].model == "qwen3"
    assert main(["--address", address, "tokenize", "hi", "--model", "qwen3"]) == 0
    assert seen[-1][1].model == "qwen3"
    capsys.readouterr()
    assert main(["--address", address, "info", "--model", "qwen3"]) == 0
    assert "model_name       qwen3\n" in capsys.readouterr().out  # the fake server names the model it was asked for
