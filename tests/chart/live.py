"""Running programs for the chart's live checks: the operator against kmock, and a real
Prometheus server scraping what runs (Debian's `prometheus`, on loopback)."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.chart.prometheus import tool
from tests.operator.harness import MS, Cluster, Gpu, StartOperator, wait_for
from tests.operator.specs import modelserver

#: Generous: the suite must pass on a loaded 2-core machine.
TIMEOUT = 90.0


def http_get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return str(response.read().decode("utf-8"))


def free_port() -> int:
    """A port free right now on loopback (for Prometheus, which cannot report port 0)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def operator_metrics_port(cluster: Cluster, start_operator: StartOperator) -> int:
    """Start ``kvshare operator`` (a real process) against the test's kmock cluster (the
    operator tests' ``cluster``/``start_operator`` fixtures, which also check on teardown
    that every API call it made is one the chart's RBAC, generated from the same list,
    allows) with two ModelServers on one 80Gi GPU: ``qwen`` placed and Starting, ``big``
    Unschedulable next to it. Returns the operator's metrics port once both are so."""
    await cluster.add_gpu_node("gpu-node-1", [Gpu("GPU-1a")])
    process = start_operator("operator-a")
    await cluster.create(MS, modelserver("qwen"))
    await wait_for(lambda: cluster.status("qwen").get("phase") == "Starting", "qwen Starting")
    await cluster.create(MS, modelserver("big", staticMemory="70Gi", kvCache={"min": "4Gi"}))
    await wait_for(
        lambda: cluster.status("big").get("phase") == "Unschedulable", "big Unschedulable"
    )
    return await wait_for(process.metrics_port, "the operator's metrics port", TIMEOUT)


@dataclass(frozen=True)
class Target:
    """What one scrape job reaches, with the labels the chart's monitors would add."""

    job: str
    address: str
    labels: dict[str, str]


class PrometheusServer:
    """A real Prometheus scraping ``targets`` every second, with a throwaway TSDB."""

    def __init__(self, workdir: Path, targets: list[Target]) -> None:
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [
                {
                    "job_name": t.job,
                    "static_configs": [{"targets": [t.address], "labels": t.labels}],
                }
                for t in targets
            ],
        }
        self.config = workdir / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(config), encoding="utf-8")
        self.port = free_port()
        self.log = workdir / "prometheus.log"
        self._log = self.log.open("wb")
        self.process = subprocess.Popen(
            [tool("prometheus"), f"--config.file={self.config}",
             f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The instant query's result vector (an error is an AssertionError with its text)."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": promql}
        )
        try:
            body = json.loads(http_get(url))
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{promql}: {exc.read().decode()}") from None
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def wait_until(self, promql: str, what: str, timeout: float = TIMEOUT) -> list[dict[str, Any]]:
        """Poll until ``promql`` returns series."""
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"prometheus exited: {self.log.read_text()[-2000:]}")
            with contextlib.suppress(OSError, AssertionError):
                result = self.query(promql)
                if result:
                    return result
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what} ({promql})")
            time.sleep(0.5)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(30)
        self._log.close()


@contextlib.contextmanager
def prometheus(workdir: Path, targets: list[Target]) -> Iterator[PrometheusServer]:
    server = PrometheusServer(workdir, targets)
    try:
        yield server
    finally:
        server.stop()
