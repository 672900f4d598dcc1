"""tests/load/replica_processes.py: replica processes found by title below a root process, with their RSS."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from tests.load.replica_processes import descendants, parse_title, pids_by_app, replicas, status_field


def test_titles_name_the_app_and_deployment() -> None:
    assert parse_title("ray::ServeReplica:text:TextGeneration\x00\x00") == ("text", "TextGeneration")
    assert parse_title("ray::ServeReplica:diffusion:Diffusion.handle_request_with_rejection") == (
        "diffusion", "Diffusion")
    assert parse_title("ray::ServeController") is None
    assert parse_title("python\x00-m\x00services.serve") is None
    assert parse_title("ray::ServeReplica:") is None


def test_a_replica_titled_child_is_found_below_its_root_with_its_rss() -> None:
    """Below a root of its own: under `make test` the session's e2e stack also runs below this pytest process."""
    root = subprocess.Popen(["bash", "-c", 'exec -a "ray::ServeReplica:gan:ImageGan" sleep 30 & wait'])
    child = 0
    try:
        deadline = time.monotonic() + 10
        while not (found := replicas(root.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [(r.app, r.deployment) for r in found] == [("gan", "ImageGan")]
        child = found[0].pid
        assert child != root.pid and child in descendants(root.pid)
        assert found[0].rss_kib > 0 and status_field(child, "VmRSS") is not None
        assert pids_by_app(root.pid) == {"gan": {child}}
        assert replicas(child) == []  # nothing below the child itself
    finally:
        if child:
            os.kill(child, signal.SIGKILL)
        root.kill()
        root.wait()
    # SIGKILL is delivered asynchronously: a loaded machine may show the child alive for a moment after os.kill.
    deadline = time.monotonic() + 10
    while status_field(child, "VmRSS") is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert status_field(child, "VmRSS") is None
