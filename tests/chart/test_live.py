"""What the chart points at, running for real: the operator (against kmock) and the node
agent (fake GPUs, real pools) serve /metrics that `promtool check metrics` accepts, the
`helm test` pod's script passes against them, and a real Prometheus scraping them returns
series for every query of the dashboard."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvshare.cli import SUBCOMMANDS
from tests.chart.helm import CHART
from tests.chart.live import Target, http_get, operator_on_kmock, prometheus
from tests.chart.prometheus import label_values_metric, tool
from tests.chart.test_dashboard import (
    dashboard,
    grafana_to_promql,
    panel_queries,
    variable_queries,
)

CHECK_METRICS = CHART / "files" / "check_metrics.py"


def check_metrics(*targets: str) -> subprocess.CompletedProcess[str]:
    """The `helm test` pod's script, as the pod runs it (python3 -c SCRIPT TIMEOUT TARGET...)."""
    script = CHECK_METRICS.read_text(encoding="utf-8")
    return subprocess.run(
        [sys.executable, "-c", script, "10", *targets],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip


def promtool_check_metrics(text: str) -> subprocess.CompletedProcess[str]:
    """`promtool check metrics` reads the exposition from stdin and lints it."""
    return subprocess.run(
        [tool("promtool"), "check", "metrics"], input=text, capture_output=True, text=True,
        check=False, timeout=60,
    )  # fmt: skip


@pytest.mark.asyncio
async def test_operator_metrics_pass_promtool_check_metrics(tmp_path: Path) -> None:
    async with operator_on_kmock(tmp_path) as port:
        text = http_get(f"http://127.0.0.1:{port}/metrics")
    assert "kvshare_operator_placements_total" in text
    done = promtool_check_metrics(text)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.asyncio
async def test_helm_test_script_passes_against_the_operator_and_fails_without_it(
    tmp_path: Path,
) -> None:
    async with operator_on_kmock(tmp_path) as port:
        done = check_metrics(f"127.0.0.1:{port}")
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.startswith(f"ok http://127.0.0.1:{port}/metrics")
    refused = check_metrics(f"127.0.0.1:{port}")
    assert refused.returncode == 1
    assert f"FAILED http://127.0.0.1:{port}/metrics" in refused.stdout
    unknown = check_metrics("no-such-service.invalid:9400")
    assert unknown.returncode == 1
    assert "no ready pod behind this name" in unknown.stdout


def _dashboard_queries() -> list[str]:
    board = dashboard()
    queries = [grafana_to_promql(q, "1m") for q in panel_queries(board)]
    queries += [grafana_to_promql(label_values_metric(q)) for q in variable_queries(board)]
    return queries


@pytest.mark.asyncio
async def test_prometheus_scraping_the_operator_answers_its_dashboard_queries(
    tmp_path: Path,
) -> None:
    """The operator's panels, on a real Prometheus scraping a real operator process."""
    operator_queries = [q for q in _dashboard_queries() if "kvshare-operator" in q or
                        "kvshare_operator_" in q]  # fmt: skip
    assert len(operator_queries) >= 3
    async with operator_on_kmock(tmp_path) as port:
        targets = [Target("kvshare-operator", f"127.0.0.1:{port}", {})]
        with prometheus(tmp_path, targets) as server:
            server.wait_until('up{job="kvshare-operator"} == 1', "the operator scraped")
            for query in operator_queries:
                assert server.wait_until(query, query), query


def test_node_agent_is_runnable() -> None:
    if "node" not in SUBCOMMANDS:
        pytest.skip(
            "`kvshare node` is not in this tree: the node agent has not been merged into this "
            "branch, so its /metrics cannot be run through promtool or scraped yet"
        )
