"""tests/load/run.py's own helpers: the command docs/load.md shows."""

from __future__ import annotations

from tests.load.run import ROOT, Scenario, locust_command, shown_command


def test_the_shown_locust_command_names_checkout_paths_relative_to_it() -> None:
    command = locust_command(Scenario("mixed", 16, 4, 60, 0.5, "text=1", 48, 20, 40), "127.0.0.1:9200")
    command[4] = str(ROOT / ".venv" / "bin" / "locust")  # wherever this interpreter lives, a checkout's own venv
    shown = shown_command(command)
    assert shown.startswith("timeout -k 10 120 .venv/bin/locust -f tests/load/locustfile.py --headless -u 16 -r 4 ")
    assert str(ROOT) not in shown
    assert shown_command(["/usr/bin/env", "a b"]) == "/usr/bin/env 'a b'"  # outside the checkout: as it is
