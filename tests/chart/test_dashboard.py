"""The Grafana dashboard the chart ships is the one tools/dashboard.py generates, every query
in it is valid PromQL (promtool parses it), and it has the panels users look for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.chart.helm import CHART, ROOT
from tests.chart.prometheus import label_values_metric, metric_names, promtool, write_yaml

DASHBOARD_FILE = CHART / "dashboards" / "kvshare.json"


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD_FILE.read_text(encoding="utf-8")))


def panel_queries(board: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]


def variable_queries(board: dict[str, Any]) -> list[str]:
    return [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]


def dashboard_metric_names() -> set[str]:
    board = dashboard()
    names: set[str] = set()
    for expr in panel_queries(board):
        names |= metric_names(expr)
    for query in variable_queries(board):
        names |= metric_names(label_values_metric(query))
    return names


def test_shipped_dashboard_is_what_the_generator_writes() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "dashboard.py")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert done.stdout == DASHBOARD_FILE.read_text(encoding="utf-8"), "run `make dashboard`"


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each query as a recording rule (Grafana's variables filled in)."""
    board = dashboard()
    exprs = panel_queries(board) + [label_values_metric(q) for q in variable_queries(board)]
    rules = [
        {"record": f"dashboard:query_{i}", "expr": grafana_to_promql(expr)}
        for i, expr in enumerate(exprs)
    ]
    path = write_yaml(
        tmp_path / "dashboard.rules.yaml", {"groups": [{"name": "q", "rules": rules}]}
    )
    done = promtool("check", "rules", str(path))
    assert done.returncode == 0, done.stdout + done.stderr


def grafana_to_promql(expr: str, rate_interval: str = "5m") -> str:
    """What Grafana sends for ``expr`` with every variable at "All"."""
    for variable in ("node", "gpu", "namespace", "modelserver"):
        expr = expr.replace(f"${variable}", ".*")
    return expr.replace("$__rate_interval", rate_interval)


def test_dashboard_has_the_panels_users_look_for() -> None:
    board = dashboard()
    titles = {p["title"]: p for p in board["panels"]}
    gpu = titles["GPU memory of $gpu"]
    assert gpu["repeat"] == "gpu"
    assert gpu["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    legends = [t["legendFormat"] for t in gpu["targets"]]
    assert legends == ["static", "KV mapped, in use", "KV cached", "free"]
    kv = titles["KV cache of $modelserver"]
    assert [t["legendFormat"] for t in kv["targets"]] == ["used", "min", "lease", "max"]
    broker = " ".join(panel_queries({"panels": [titles["Broker decisions per second"]]}))
    for counter in ("grants", "denials", "reclaims"):
        assert f"kvshare_broker_{counter}_total" in broker
    assert "histogram_quantile" in titles["Reclaim latency"]["targets"][0]["expr"]
    assert {"Placements per second", "ModelServers by phase", "Node agents up"} <= set(titles)
    # Per ModelServer, by name: ready against desired, and which ones the two ModelServer
    # alerts are about.
    replicas = titles["Replicas of $modelserver"]
    assert replicas["repeat"] == "modelserver"
    assert [t["legendFormat"] for t in replicas["targets"]] == ["desired", "ready"]
    assert "kvshare_modelserver_ready_replicas" in replicas["targets"][1]["expr"]
    for title, phases in (
        ("Unschedulable ModelServers", 'phase="Unschedulable"'),
        ("ModelServers not ready", 'phase=~"Pending|Starting|Degraded"'),
    ):
        (target,) = titles[title]["targets"]
        assert "kvshare_modelserver_status_phase" in target["expr"] and phases in target["expr"]
        assert target["legendFormat"].startswith("{{namespace}}/{{modelserver}}")
    # Every ModelServer the operator serves has its panels, placed on a GPU or not.
    variables = {
        v["name"]: v["definition"] for v in board["templating"]["list"] if v["type"] == "query"
    }
    assert "kvshare_modelserver_replicas" in variables["modelserver"]
    for panel in board["panels"]:
        assert panel["type"] == "row" or panel["description"], panel["title"]


def test_panels_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard()["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]
