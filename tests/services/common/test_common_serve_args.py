"""`make serve` / `genserve serve`: flags reach the deployed config; the printed usage names the right address."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from genserve.services import serve


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_are_the_documented_ports(monkeypatch) -> None:
    for name in ("GENSERVE_GRPC_PORT", "GENSERVE_HEALTH_PORT", "GENSERVE_HTTP_PORT", "GENSERVE_METRICS_PORT"):
        monkeypatch.delenv(name, raising=False)
    args = parse()
    assert (args.grpc_port, args.health_port, args.http_port, args.metrics_port) == (9000, 9001, 8000, 8080)
    text = serve.usage(args, serve.load_config(args))
    assert "genserve chat" in text and "genserve text" in text and "--address" not in text


def test_ports_and_model_dirs_reach_the_config(tmp_path: Path) -> None:
    args = parse("--grpc-port", "9100", "--health-port", "9101", "--http-port", "8100", "--text-model", str(tmp_path))
    config = serve.load_config(args)
    apps = {app["name"]: app for app in config["applications"]}
    assert config["grpc_options"]["port"] == 9100 and config["http_options"]["port"] == 8100
    assert apps["health"]["args"]["port"] == 9101
    assert apps["text"]["args"]["model_dir"] == str(tmp_path.resolve())
    assert apps["gan"]["args"]["model_dir"] is None
    assert "--address 127.0.0.1:9100" in serve.usage(args, config)
    assert f"text model: {tmp_path.resolve()}" in serve.usage(args, config)


def test_the_text_model_is_the_flag_else_the_env_var_else_the_fetched_default(monkeypatch, tmp_path: Path) -> None:
    """Neither set: the default GGUF once `make serve` has fetched it, else None (the replica's demo weights)."""
    def text_model(*argv: str) -> str | None:
        apps = {app["name"]: app for app in serve.load_config(parse(*argv))["applications"]}
        return apps["text"]["args"]["model_dir"]

    fetched = tmp_path / "default.gguf"
    monkeypatch.setattr(serve.default_model, "DEFAULT_GGUF", fetched)
    monkeypatch.delenv("GENSERVE_TEXT_MODEL", raising=False)
    assert text_model() is None
    fetched.write_bytes(b"GGUF")
    assert text_model() == str(fetched)
    monkeypatch.setenv("GENSERVE_TEXT_MODEL", str(tmp_path))
    assert text_model() == str(tmp_path)
    assert text_model("--text-model", str(fetched)) == str(fetched)


def test_env_vars_set_the_ports(monkeypatch) -> None:
    monkeypatch.setenv("GENSERVE_GRPC_PORT", "9200")
    monkeypatch.setenv("GENSERVE_HEALTH_PORT", "9201")
    args = parse()
    assert (args.grpc_port, args.health_port) == (9200, 9201)


def _pipeline_folder(root: Path) -> Path:
    (root / "vae").mkdir(parents=True)
    (root / "model_index.json").write_text("{}")
    return root


def test_a_diffusers_folder_serves_its_vae_unless_told_otherwise(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("GENSERVE_VAE_MODEL", raising=False)
    sd = _pipeline_folder(tmp_path / "sd")
    apps = {a["name"]: a for a in serve.load_config(parse("--diffusion-model", str(sd)))["applications"]}
    assert apps["diffusion"]["args"]["model_dir"] == str(sd.resolve())
    assert apps["vae"]["args"]["model_dir"] == str((sd / "vae").resolve())
    other = tmp_path / "other-vae"
    apps = {a["name"]: a for a in serve.load_config(parse("--diffusion-model", str(sd), "--vae-model",
                                                          str(other)))["applications"]}
    assert apps["vae"]["args"]["model_dir"] == str(other.resolve())
    monkeypatch.setenv("GENSERVE_VAE_MODEL", str(other))
    apps = {a["name"]: a for a in serve.load_config(parse("--diffusion-model", str(sd)))["applications"]}
    assert apps["vae"]["args"]["model_dir"] is None  # the replica reads GENSERVE_VAE_MODEL itself


def test_the_vae_app_follows_genserve_diffusion_model(tmp_path: Path, monkeypatch) -> None:
    from genserve.services.common.builder import resolve_model_dir

    sd = _pipeline_folder(tmp_path / "sd")
    monkeypatch.delenv("GENSERVE_VAE_MODEL", raising=False)
    monkeypatch.setenv("GENSERVE_DIFFUSION_MODEL", str(sd))
    assert resolve_model_dir("vae", None) == str(sd / "vae")
    assert resolve_model_dir("vae", "/configured") == "/configured"
    monkeypatch.setenv("GENSERVE_VAE_MODEL", "/from-env")
    assert resolve_model_dir("vae", None) == "/from-env"
    monkeypatch.setenv("GENSERVE_DIFFUSION_MODEL", str(tmp_path))  # not a diffusers folder: demo VAE
    monkeypatch.delenv("GENSERVE_VAE_MODEL")
    assert resolve_model_dir("vae", None) is None


def test_start_up_says_who_may_call_and_insecure_says_it_loudly(monkeypatch, capsys) -> None:
    for name in ("GENSERVE_API_KEYS", "GENSERVE_API_KEYS_FILE", "GENSERVE_INSECURE"):
        monkeypatch.setenv(name, "")  # set, so that what --insecure puts there is undone after the test
    serve.announce(serve.access(parse()))
    out, err = capsys.readouterr()
    assert "auth: off" in out and "only callers on this host are served" in out and err == ""
    rule = serve.access(parse("--insecure"))
    assert rule.insecure and serve.os.environ["GENSERVE_INSECURE"] == "1"  # the replicas inherit it
    serve.announce(rule)
    out, err = capsys.readouterr()
    assert "INSECURE" in out and "NO API KEYS" in err


def test_keys_are_checked_before_anything_starts(monkeypatch, tmp_path: Path, capsys) -> None:
    monkeypatch.delenv("GENSERVE_API_KEYS", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "keys").write_text("sha256:1234\n")
    monkeypatch.setenv("GENSERVE_API_KEYS_FILE", "keys")  # relative: made absolute for the replicas
    monkeypatch.setattr(serve, "start", lambda *a: pytest.fail("started with a bad key file"))
    assert serve.run(parse()) == 1
    assert "API keys: GENSERVE_API_KEYS_FILE line 1: `sha256:` must be followed" in capsys.readouterr().err
    (tmp_path / "keys").write_text("a-real-key\n")
    serve.announce(serve.access(parse()))
    out = capsys.readouterr().out
    assert "API keys required (1 configured)" in out and "a-real-key" not in out
    assert serve.os.environ["GENSERVE_API_KEYS_FILE"] == str(tmp_path / "keys")


def test_the_drain_time_is_the_flag_else_the_env_var_and_reaches_every_deployment(monkeypatch) -> None:
    monkeypatch.delenv("GENSERVE_DRAIN_SECONDS", raising=False)
    assert parse().drain_seconds == 30.0
    monkeypatch.setenv("GENSERVE_DRAIN_SECONDS", "12")
    assert parse().drain_seconds == 12.0
    config = serve.load_config(parse("--drain-seconds", "45"))
    deployments = [d for app in config["applications"] for d in app["deployments"]]
    assert {d["graceful_shutdown_timeout_s"] for d in deployments} == {45.0}
    assert {d["graceful_shutdown_wait_loop_s"] for d in deployments} == {1.0}


def _listening() -> socket.socket:
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind(("127.0.0.1", 0))
    held.listen()
    return held


def test_taken_ports_names_each_port_something_listens_on() -> None:
    with _listening() as grpc_held, _listening() as metrics_held:
        grpc_port, metrics_port = grpc_held.getsockname()[1], metrics_held.getsockname()[1]
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            free_port = free.getsockname()[1]
        args = parse("--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port), "--http-port",
                     str(free_port), "--health-port", str(free_port))
        assert serve.taken_ports(args) == [f"{grpc_port} (gRPC: --grpc-port or GENSERVE_GRPC_PORT)",
                                           f"{metrics_port} (metrics: --metrics-port or GENSERVE_METRICS_PORT)"]


def test_a_second_serve_on_a_taken_port_says_which_and_exits_at_once() -> None:
    root = Path(__file__).resolve().parents[3]
    with _listening() as held:
        port = held.getsockname()[1]
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-P", "-m", "genserve.services.serve", "--grpc-port", str(port)],
                              cwd=root, capture_output=True, text=True, timeout=60)
        elapsed = time.monotonic() - started
    assert done.returncode == 1
    assert f"port {port} (gRPC: --grpc-port or GENSERVE_GRPC_PORT) already in use" in done.stderr
    assert "Traceback" not in done.stderr and "ray" not in done.stdout.lower()
    assert elapsed < 30, elapsed  # before Ray starts: no wait for a cluster that cannot bind


def test_args_errors_name_each_app_and_field_before_ray_starts() -> None:
    config = serve.load_config(parse())
    assert serve.args_errors(config) == {}
    for app in config["applications"]:
        if app["name"] in ("text", "gan"):
            app["args"]["torch_threads"] = 0
        if app["name"] == "text":
            app["args"]["max_running"] = "many"
    errors = serve.args_errors(config)
    assert set(errors) == {"text", "gan"}
    assert "torch_threads" in errors["gan"] and "torch_threads" in errors["text"] and "max_running" in errors["text"]
