"""The committed Grafana dashboard (docs/operations/grafana-dashboard.json) as Grafana imports it: panels on a
24-column grid that do not overlap, each with Prometheus queries on the dashboard's data-source variable, over
the frontend's and the workers' metrics. That a real deployment renders every metric the queries name is
test_metrics_e2e.py's check."""

from __future__ import annotations

import json

from tests.deploy.scrape import DASHBOARD, dashboard_exprs, metric_names

# what the issue asks the dashboard to show, frontend and workers
WANTED = {"dynamo_pd_ttft_seconds_bucket", "dynamo_pd_itl_seconds_bucket", "dynamo_pd_requests_total",
          "dynamo_pd_worker_step_seconds_bucket", "dynamo_pd_worker_batch_size_sum",
          "dynamo_pd_worker_requests_running", "dynamo_pd_worker_requests_waiting", "dynamo_pd_worker_kv_blocks_used",
          "dynamo_pd_worker_kv_transfer_bytes_total", "dynamo_pd_worker_kv_transfer_seconds_total",
          "dynamo_pd_worker_handoff_failures_total", "dynamo_pd_worker_side_channel_malformed_total",
          "dynamo_pd_worker_nixl_agents_torn_down_total"}


def balanced(expr: str) -> bool:
    depth = 0
    for char in expr:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth < 0:
            return False
    return depth == 0


def test_the_dashboard_is_one_grafana_imports():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"] and dashboard["schemaVersion"] >= 36
    (variable,) = dashboard["templating"]["list"]
    assert (variable["name"], variable["type"], variable["query"]) == ("datasource", "datasource", "prometheus")
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert all(isinstance(grid[k], int) for k in ("x", "y", "w", "h")) and grid["x"] + grid["w"] <= 24
        x, y = grid["x"], grid["y"]
        mine = {(i, j) for i in range(x, x + grid["w"]) for j in range(y, y + grid["h"])}
        assert not mine & cells, f"panel {panel['title']!r} overlaps another"
        cells |= mine
        if panel["type"] == "row":
            continue
        assert panel["type"] == "timeseries" and panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        targets = panel["targets"]
        assert targets and len({t["refId"] for t in targets}) == len(targets)
        for target in targets:
            assert target["datasource"] == panel["datasource"]
            assert balanced(target["expr"]) and metric_names(target["expr"]), target["expr"]


def test_the_dashboard_shows_the_frontend_and_every_worker_metric_the_issue_asks_for():
    asked = set().union(*(metric_names(expr) for expr in dashboard_exprs()))
    assert WANTED <= asked, sorted(WANTED - asked)
