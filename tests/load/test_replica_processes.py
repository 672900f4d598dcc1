"""tests/load/replica_processes.py: replica processes found by title below a root process, with their RSS."""

from __future__ import annotations

import os
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
    child = subprocess.Popen(["bash", "-c", 'exec -a "ray::ServeReplica:gan:ImageGan" sleep 30'])
    try:
        deadline = time.monotonic() + 10
        while not (found := replicas(os.getpid())) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [(r.pid, r.app, r.deployment) for r in found] == [(child.pid, "gan", "ImageGan")]
        assert found[0].rss_kib > 0 and status_field(child.pid, "VmRSS") is not None
        assert child.pid in descendants(os.getpid())
        assert pids_by_app(os.getpid()) == {"gan": {child.pid}}
        assert replicas(child.pid) == []  # nothing below the child itself
    finally:
        child.kill()
        child.wait()
    assert status_field(child.pid, "VmRSS") is None
