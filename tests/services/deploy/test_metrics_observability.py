"""The genserve_* metrics are documented, charted with the names Prometheus sees, and scraped where Ray exports them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

# Prometheus series a Ray metric turns into: Ray prefixes `ray_`; counters get `_total`, histograms `_bucket`.
SERIES_SUFFIX = {"Counter": "_total", "Histogram": "_bucket", "Gauge": ""}
# What issue 7 asks the one naming scheme to cover.
REQUIRED = {
    "requests by gRPC code": "genserve_requests",
    "queue depth": "genserve_ongoing_requests",
    "time to first token": "genserve_text_time_to_first_token_seconds",
    "tokens/s": "genserve_text_generated_tokens",
    "free KV blocks": "genserve_text_kv_free_blocks",
    "denoising steps/s": "genserve_diffusion_steps",
    "images/s": "genserve_images",
}


def _defined_metrics(root: Path) -> dict[str, str]:
    """name -> kind (Counter | Histogram | Gauge), read from services/common/metrics.py."""
    source = (root / "services" / "common" / "metrics.py").read_text()
    found = re.findall(r"metrics\.(Counter|Histogram|Gauge)\(\s*\"(genserve_\w+)\"", source)
    return {name: kind for kind, name in found}


def _dashboard(root: Path) -> dict:
    return json.loads((root / "deploy" / "grafana" / "dashboards" / "genserve.json").read_text())


def _expressions(dashboard: dict) -> list[str]:
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_metrics_cover_what_the_issue_asks_for(root: Path) -> None:
    defined = _defined_metrics(root)
    missing = {what: name for what, name in REQUIRED.items() if name not in defined}
    assert not missing
    assert "code" in re.search(r'"genserve_requests".*?tag_keys=\(([^)]*)\)',
                               (root / "services" / "common" / "metrics.py").read_text(), re.S).group(1)


def test_every_metric_is_documented_with_its_prometheus_name(root: Path) -> None:
    docs = (root / "docs" / "metrics.md").read_text()
    for name, kind in _defined_metrics(root).items():
        assert f"`ray_{name}{SERIES_SUFFIX[kind]}`" in docs, f"{name} ({kind}) is not in docs/metrics.md"


def test_dashboard_charts_every_metric_by_its_exported_series(root: Path) -> None:
    defined = _defined_metrics(root)
    used = set(re.findall(r"ray_genserve_\w+", " ".join(_expressions(_dashboard(root)))))
    exported = {f"ray_{name}{SERIES_SUFFIX[kind]}" for name, kind in defined.items()}
    exported |= {f"ray_{name}{part}" for name, kind in defined.items() if kind == "Histogram"
                 for part in ("_count", "_sum")}  # a histogram's other series
    assert used <= exported, f"the dashboard queries series no service exports: {sorted(used - exported)}"
    uncharted = {name for name, kind in defined.items() if f"ray_{name}{SERIES_SUFFIX[kind]}" not in used}
    assert not uncharted


def test_dashboard_panels_are_well_formed(root: Path) -> None:
    dashboard = _dashboard(root)
    provisioned = yaml.safe_load(
        (root / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )["datasources"][0]["uid"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == provisioned
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]


@pytest.mark.parametrize("kind", ["dashboards", "datasources"])
def test_grafana_provisioning_is_mounted_where_grafana_reads_it(kind: str, root: Path, compose: dict) -> None:
    mounts = dict(m.split(":")[:2] for m in compose["services"]["grafana"]["volumes"])
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    assert (root / "deploy" / "grafana" / "provisioning" / kind).is_dir()
    provider_file = root / "deploy" / "grafana" / "provisioning" / "dashboards" / "genserve.yml"
    provider = yaml.safe_load(provider_file.read_text())
    assert mounts["./deploy/grafana/dashboards"] == provider["providers"][0]["options"]["path"]
