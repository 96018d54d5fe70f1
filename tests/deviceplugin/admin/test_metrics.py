"""The node agent's metrics: the names the design and the chart rely on, per-pool labels,
and /healthz and /readyz over HTTP."""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from prometheus_client import generate_latest

from kvshare.api.wire import Hello, Report
from kvshare.deviceplugin.admin.metrics import MetricsServer, NodeMetrics, metric_names
from kvshare.deviceplugin.broker.books import Books
from kvshare.deviceplugin.broker.peers import process_start_time
from kvshare.deviceplugin.inventory import parse_fake_gpus
from tests.deviceplugin.conftest import GIB, AgentProcess, wait_until

DESIGN_NAMES = {
    "kvshare_gpu_memory_total_bytes",
    "kvshare_gpu_memory_free_bytes",
    "kvshare_pool_kv_mapped_bytes",
    "kvshare_pool_kv_used_bytes",
    "kvshare_pool_kv_lease_bytes",
    "kvshare_pool_kv_min_bytes",
    "kvshare_broker_grants_total",
    "kvshare_broker_denials_total",
    "kvshare_broker_reclaims_total",
    "kvshare_broker_reclaim_seconds",
}


def test_the_registry_lists_the_design_names_and_the_indicators() -> None:
    names = set(metric_names())
    assert names >= DESIGN_NAMES
    assert {"kvshare_pool_over_lease", "kvshare_broker_reclaim_deadline_missed_total",
            "kvshare_pool_reclaim_overdue"} <= names  # fmt: skip
    assert all(re.fullmatch(r"kvshare_[a-z_]+", n) for n in names)


def test_pool_series_carry_their_identity_as_labels() -> None:
    gpus = parse_fake_gpus("1x16Gi", "n")
    metrics = NodeMetrics()
    books = Books(gpus, headroom=GIB, events=metrics)
    hello = Hello(version=1, gpu=gpus[0].uuid, page_size=2 * 2**20, kv_min=GIB, kv_max=None,
                  priority=100, static=0, namespace="llm", pod="qwen-0", modelserver="qwen",
                  rank=1, tp_size=2)  # fmt: skip
    pool = books.admit(hello, 42, 0.0).record
    assert pool is not None
    books.want(pool.id, 1, 3 * GIB, 0.0)
    books.report(pool.id, Report(mapped=2 * GIB, used=GIB, cached=0, reserved=0), 0.0)
    metrics.set_source(lambda: books.view(0.0), [gpus[0].uuid])
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in generate_latest(metrics.registry).decode().splitlines()
        if not line.startswith("#")
    }
    labels = (
        f'gpu="{gpus[0].uuid}",modelserver="qwen",namespace="llm",pod="qwen-0",'
        'pool="llm/qwen-0/rank1",rank="1"'
    )
    assert samples[f"kvshare_pool_kv_lease_bytes{{{labels}}}"] == 3 * GIB
    assert samples[f"kvshare_pool_kv_mapped_bytes{{{labels}}}"] == 2 * GIB
    assert samples[f'kvshare_broker_grants_total{{gpu="{gpus[0].uuid}"}}'] == 2


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_readyz_waits_for_the_pools_of_a_previous_broker(
    agent_factory: Callable[..., AgentProcess], short_tmp: Path
) -> None:
    gpu = parse_fake_gpus("1x8Gi", "test-node")[0].uuid
    # A pool of a "previous broker" that is still running: this very process.
    pool = {"pid": os.getpid(), "name": "llm/qwen-0", "gpu": gpu, "static": 0, "kv_min": GIB,
            "start_time": process_start_time(os.getpid())}  # fmt: skip
    state = {"version": 1, "pools": [pool]}
    (short_tmp / "admin").mkdir(mode=0o700)
    (short_tmp / "admin" / "broker.state").write_text(json.dumps(state))
    agent = agent_factory("1x8Gi", "--recovery", "2")
    assert _get(agent.metrics_port, "/healthz") == (200, "ok\n")
    status, body = _get(agent.metrics_port, "/readyz")
    assert status == 503 and "re-declare" in body
    assert "kvshare_broker_recovering 1.0" in agent.metrics()
    # It never re-declares: after --recovery the broker stops waiting for it.
    wait_until(lambda: _get(agent.metrics_port, "/readyz")[0] == 200, what="readiness")
    assert "did not re-declare" in "".join(agent.log)
    assert _get(agent.metrics_port, "/nope")[0] == 404


def test_an_exporter_that_cannot_render_answers_500_and_is_not_ready() -> None:
    # A value that got past every check (the codec refuses it: see test_hostile_peers):
    # the scrape says why, and /readyz stops reporting a node Prometheus cannot read.
    gpus = parse_fake_gpus("1x16Gi", "n")
    books = Books(gpus, headroom=GIB)
    hello = Hello(version=1, gpu=gpus[0].uuid, page_size=2 * 2**20, kv_min=0, kv_max=None,
                  priority=100, static=0, namespace="\ud800", pod="qwen-0")  # fmt: skip
    assert books.admit(hello, 42, 0.0).record is not None
    metrics = NodeMetrics(lambda: books.view(0.0))
    server = MetricsServer("127.0.0.1", 0, metrics, lambda: (True, "ok"), lambda: (True, "ok"))
    server.start()
    try:
        assert _get(server.port, "/healthz") == (200, "ok\n")
        status, body = _get(server.port, "/metrics")
        assert status == 500 and "UnicodeEncodeError" in body
        status, body = _get(server.port, "/readyz")
        assert status == 503 and body.startswith("metrics exporter cannot serve")
    finally:
        server.stop()


def test_each_pool_s_page_size_and_layout_reach_metrics_from_its_own_reports(
    agent_factory: Callable[..., AgentProcess],
) -> None:
    """Real pools (host memory) report to a real node agent; its /metrics says what one
    page of each moves and, for per-layer pages, why."""
    from kvshare.runtime.backends import open_backend
    from kvshare.runtime.broker_client import BrokerLease, PoolIdentity, PoolPolicy
    from kvshare.runtime.geometry import KVGeometry
    from kvshare.runtime.paging import Paging
    from kvshare.runtime.pool import KVPool

    agent = agent_factory("1x8Gi")
    granule = 2 * 2**20
    pools = []
    # A block-outer pool: one buffer of 4 MiB blocks (64 tokens of an 8B model), a page
    # of two granules; a per-layer one: a granule in each of 32 layers' buffers.
    cases = {
        "block": (KVGeometry(1, 2 * granule, 64, 2 * granule), Paging("block-outer")),
        "layers": (
            KVGeometry(32, granule // 8, 64, granule, "per-layer"),
            Paging("per-layer", "backend", "FLEX_ATTENTION supports LBNHC"),
        ),
    }
    try:
        for pod, (geometry, paging) in cases.items():
            lease = BrokerLease(
                agent.gpus[0].uuid,
                policy=PoolPolicy(kv_min=geometry.page_bytes, page_size=granule),
                identity=PoolIdentity(namespace="llm", pod=pod),
                socket_path=str(agent.broker_socket),
                report_interval_s=0.01,
            )
            pools.append(KVPool(geometry, open_backend("host"), lease, paging=paging))
        wait_until(
            lambda: all(p.page_bytes for p in agent.pools().values()), what="both pools' reports"
        )
        text = agent.metrics()
    finally:
        for pool in pools:
            pool.close()
    samples = _samples(text)
    gpu = agent.gpus[0].uuid
    block = {"gpu": gpu, "namespace": "llm", "pod": "block", "pool": "llm/block", "rank": "0"}
    layers = {**block, "pod": "layers", "pool": "llm/layers"}
    assert samples["kvshare_pool_kv_page_bytes", _labels(block)] == 2 * granule
    assert samples["kvshare_pool_kv_page_bytes", _labels(layers)] == 32 * granule
    assert samples[LAYOUT, _labels({**block, "layout": "block-outer", "reason": ""})] == 1
    assert samples[LAYOUT, _labels({**layers, "layout": "per-layer", "reason": "backend"})] == 1


LAYOUT = "kvshare_pool_kv_layout_info"


def _labels(labels: dict[str, str]) -> frozenset[tuple[str, str]]:
    return frozenset({"modelserver": "", **labels}.items())


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Prometheus text samples by name and label set."""
    found = {}
    for line in text.splitlines():
        match = re.fullmatch(r"(\w+)\{(.*)\} (\S+)", line)
        if match:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
            found[match.group(1), labels] = float(match.group(3))
    return found
