"""What the chart points at, running for real: the operator (against kmock) and the node
agent (fake GPUs, real pools) serve /metrics that `promtool check metrics` accepts, the
`helm test` pod's script passes against them, and a real Prometheus scraping them returns
series for every query of the dashboard."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chart.helm import CHART
from tests.chart.live import Target, http_get, operator_metrics_port, prometheus
from tests.chart.prometheus import label_values_metric, tool
from tests.chart.test_autoscaling import queries_for
from tests.chart.test_dashboard import (
    dashboard,
    grafana_to_promql,
    panel_queries,
    variable_queries,
)
from tests.deviceplugin.conftest import AgentProcess, PoolProcess, wait_until
from tests.operator.conftest import cluster, start_operator  # noqa: F401 (fixtures)
from tests.operator.harness import Cluster, StartOperator, wait_for

MIB = 2**20
#: What the broker can lend on the fake 2 GiB GPU after its 256 MiB headroom.
BUDGET = 2048 * MIB - 256 * MIB
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
async def test_operator_metrics_pass_promtool_check_metrics(
    cluster: Cluster,  # noqa: F811
    start_operator: StartOperator,  # noqa: F811
) -> None:
    port = await operator_metrics_port(cluster, start_operator)
    text = http_get(f"http://127.0.0.1:{port}/metrics")
    assert "kvshare_operator_placements_total" in text
    assert 'kvshare_modelserver_status_phase{modelserver="big",namespace="llm"' in text
    done = promtool_check_metrics(text)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.asyncio
async def test_helm_test_script_passes_against_the_operator_and_fails_without_it(
    start_operator: StartOperator,  # noqa: F811
) -> None:
    process = start_operator("operator-a")
    port = await wait_for(process.metrics_port, "the operator's metrics port", 90)
    done = check_metrics(f"127.0.0.1:{port}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"ok http://127.0.0.1:{port}/metrics")
    await process.stop()
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


@contextlib.contextmanager
def node_agent_with_traded_memory() -> Iterator[AgentProcess]:
    """``kvshare node`` on one fake 2 GiB GPU with two real pools (KVPool on the host
    backend, leasing through BrokerLease) that trade memory: grants, a denial while the
    broker waits for memory, a reclaim and its completion all happen for real."""
    directory = Path(tempfile.mkdtemp(prefix="kvc", dir="/tmp"))
    agent = AgentProcess(directory, "1x2Gi", ["--headroom", "256Mi"])
    pools: list[PoolProcess] = []
    try:
        agent.start()
        socket_args = ["--socket", str(agent.broker_socket), "--gpu", agent.gpus[0].uuid]
        for pod in ("a", "b"):
            pool = PoolProcess([*socket_args, "--pod", pod, "--kv-min", str(128 * MIB),
                                "--kv-max", str(BUDGET)])  # fmt: skip
            assert pool.error is None, pool.error
            pools.append(pool)
        a, b = pools
        a.demand(BUDGET)  # A's traffic peaks: it borrows all that B is not guaranteed
        wait_until(lambda: a.status()["used"] >= 1536 * MIB, 60, "A to use what it borrowed")
        a.demand(256 * MIB)  # A's traffic drops but it keeps its lease ...
        b.demand(1280 * MIB)  # ... until B's rises: the broker reclaims from A
        wait_until(lambda: b.status()["used"] >= 1280 * MIB, 60, "B to grow into A's memory")
        yield agent
    finally:
        for pool in pools:
            if pool.process.poll() is None:
                pool.kill()
        if agent.process is not None and agent.process.poll() is None:
            agent.stop()
        shutil.rmtree(directory, ignore_errors=True)


def test_node_agent_metrics_pass_promtool_check_metrics() -> None:
    with node_agent_with_traded_memory() as agent:
        text = agent.metrics()
    assert "kvshare_pool_kv_lease_bytes{" in text
    assert "kvshare_broker_reclaim_seconds_count{" in text
    done = promtool_check_metrics(text)
    assert done.returncode == 0, done.stdout + done.stderr


def test_helm_test_script_passes_against_the_node_agent() -> None:
    with node_agent_with_traded_memory() as agent:
        done = check_metrics(f"127.0.0.1:{agent.metrics_port}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"ok http://127.0.0.1:{agent.metrics_port}/metrics")


@pytest.mark.asyncio
async def test_prometheus_scraping_node_agent_and_operator_answers_every_dashboard_query(
    tmp_path: Path,
    cluster: Cluster,  # noqa: F811
    start_operator: StartOperator,  # noqa: F811
) -> None:
    """Every query of the dashboard (panels and variables, all variables at "All") and of
    the autoscaling examples returns series from a real Prometheus scraping a real node
    agent and a real operator (serving a Starting and an Unschedulable ModelServer)."""
    queries = _dashboard_queries()
    operator_port = await operator_metrics_port(cluster, start_operator)
    with node_agent_with_traded_memory() as agent:
        targets = [
            Target("kvshare-operator", f"127.0.0.1:{operator_port}", {}),
            # The node label the chart's PodMonitor adds from the pod's node name.
            Target("kvshare-node-agent", f"127.0.0.1:{agent.metrics_port}",
                   {"node": "test-node"}),
        ]  # fmt: skip
        with prometheus(tmp_path, targets) as server:
            server.wait_until('up{job="kvshare-node-agent"} == 1', "the node agent scraped")
            server.wait_until('up{job="kvshare-operator"} == 1', "the operator scraped")
            empty = []
            for query in queries:
                try:
                    server.wait_until(query, query, timeout=30)
                except AssertionError:
                    empty.append(query)
            assert empty == [], f"queries with no series: {empty}"
            # The autoscaling examples' queries, aimed at the operator's placed ModelServer.
            for query in queries_for("llm", "qwen"):
                (series,) = server.wait_until(query, query, timeout=30)
                assert float(series["value"][1]) >= 0
            # The check can fail: a metric nothing exports has no series.
            assert server.query("kvshare_no_such_metric_bytes") == []
