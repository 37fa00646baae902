"""Reading what a process serves: HTTP status and body, its Prometheus families, and the metric names the
committed Grafana dashboard's queries use."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).parents[2] / "docs" / "operations" / "grafana-dashboard.json"
# the sample names a family of each type renders (a counter's family drops its _total)
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def get(url: str, method: str = "GET") -> tuple[int, bytes]:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def scrape(url: str) -> dict[str, Metric]:
    status, body = get(url)
    assert status == 200, (url, status, body[:300])
    return {family.name: family for family in text_string_to_metric_families(body.decode())}


def value(families: dict[str, Metric], sample: str, **labels: str) -> float | None:
    """The value of the sample named `sample` with (at least) these labels; None where none is rendered."""
    for family in families.values():
        for s in family.samples:
            if s.name == sample and labels.items() <= s.labels.items():
                return s.value
    return None


def values(families: dict[str, Metric], sample: str, **labels: str) -> list[float]:
    return [s.value for family in families.values() for s in family.samples
            if s.name == sample and labels.items() <= s.labels.items()]


def rendered_names(families: dict[str, Metric]) -> set[str]:
    """Every sample name the families declare (with samples or not yet: a labelled counter before its first)."""
    return {family.name + suffix for family in families.values() for suffix in _SUFFIXES.get(family.type, ("",))}


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bdynamo_pd_[a-z0-9_]+", expr))
