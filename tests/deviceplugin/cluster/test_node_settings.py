"""``kvshare node`` reads its Node at start: the configuration its label names (from the
file the chart renders out of ``nodeAgent.configs``) and whether NVIDIA's device plugin
advertises the GPUs it serves. A real agent process against kmock's emulated API."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvshare.api import names
from kvshare.deviceplugin.cluster.node_checks import device_plugin_conflict
from kvshare.deviceplugin.kubelet.kubelet_standin import StandInKubelet
from tests.chart.helm import template
from tests.deviceplugin.cluster.test_kube import Emulator, agent_calls, rbac_allowed
from tests.deviceplugin.conftest import GIB, AgentProcess, wait_until
from tests.operator.harness import write_kubeconfig

LABEL = "kvshare.io/node-config"
KVSHARENODES = f"/apis/{names.GROUP}/{names.VERSION}/{names.KVSHARENODE_PLURAL}"


@pytest.fixture
def api() -> Iterator[Emulator]:
    emulator = Emulator()
    emulator.start()
    yield emulator
    emulator.stop()


def chart_configs(tmp_path: Path, values: dict[str, Any]) -> Path:
    """The node agents' configuration file as the chart renders it from ``values``."""
    rendered = template(values)
    configmap = rendered.one("ConfigMap", "-node-agent-config")
    path = tmp_path / "configs.yaml"
    path.write_text(configmap["data"]["configs.yaml"], encoding="utf-8")
    return path


def add_node(api: Emulator, name: str, labels: dict[str, str], allocatable: dict[str, str]) -> None:
    api.post(
        "/api/v1/nodes",
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "uid": f"uid-{name}", "labels": labels},
            "status": {"allocatable": {"cpu": "64", **allocatable}},
        },
    )


def start_agent(
    tmp_path: Path, short_tmp: Path, api: Emulator, node: str, config: Path, *extra: str
) -> AgentProcess:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", api.url)
    agent = AgentProcess(
        short_tmp,
        None,
        ["--config", str(config), "--publish-interval", "0.2", *extra],
        node_name=node,
        kubeconfig=kubeconfig,
    )
    agent.start()
    return agent


def published(api: Emulator, node: str) -> dict[str, Any]:
    """The KVShareNode's status once it carries the GPUs and the first Node check (which
    runs on its own thread, so an earlier write may lack its condition)."""
    try:
        status = api.get(f"{KVSHARENODES}/{node}").get("status") or {}
    except OSError:
        return {}
    checked = "NvidiaDevicePluginConflict" in conditions(status)
    return dict(status) if status.get("gpus") and checked else {}


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status.get("conditions") or ()}


def node_events(api: Emulator) -> list[dict[str, Any]]:
    return list(api.get("/api/v1/namespaces/default/events").get("items") or ())


def gauge(agent: AgentProcess, resource: str) -> float | None:
    match = re.search(
        rf'^kvshare_node_device_plugin_conflict\{{resource="{re.escape(resource)}"\}} (\S+)$',
        agent.metrics(),
        re.M,
    )
    return float(match.group(1)) if match else None


VALUES = {
    "nodeAgent.fakeGpus": "1x8Gi",
    "nodeAgent.configs": {"lab": {"fakeGpus": "2x16Gi", "slotsPerGpu": 4, "headroom": "1Gi"}},
}


def test_a_labelled_node_runs_its_configuration_and_reports_nvidias_plugin_on_its_gpus(
    tmp_path: Path, short_tmp: Path, api: Emulator
) -> None:
    add_node(api, "gpu-7", {LABEL: "lab"}, {"nvidia.com/gpu": "2"})
    agent = start_agent(tmp_path, short_tmp, api, "gpu-7", chart_configs(tmp_path, VALUES))
    try:
        # The configuration's fake GPUs and headroom, not the defaults (1x8Gi, 512Mi).
        gpus = agent.view().gpus
        assert [(g.total, g.headroom) for g in gpus] == [(16 * GIB, GIB)] * 2
        status = wait_until(lambda: published(api, "gpu-7"), 60, "the KVShareNode status")
        assert status["nodeConfig"] == "lab"
        assert {g["slots"] for g in status["gpus"]} == {4}
        found = conditions(status)
        assert found["NodeConfigApplied"]["status"] == "True"
        conflict = found["NvidiaDevicePluginConflict"]
        assert (conflict["status"], conflict["reason"]) == ("True", "NvidiaDevicePlugin")
        assert "nvidia.com/gpu: 2 for the 2 GPU(s) kvshare serves" in conflict["message"]
        assert "nvidia.com/gpu.deploy.device-plugin=false" in conflict["message"]
        (event,) = wait_until(lambda: node_events(api), 30, "a Warning Event on the Node")
        assert (event["type"], event["reason"]) == ("Warning", "NvidiaDevicePluginConflict")
        assert event["involvedObject"] == {
            "apiVersion": "v1",
            "kind": "Node",
            "name": "gpu-7",
            "uid": "uid-gpu-7",
        }
        assert gauge(agent, "nvidia.com/gpu") == 2.0
    finally:
        agent.stop()
    assert ("", "events", "create") in agent_calls(api)
    assert agent_calls(api) <= rbac_allowed()


def test_a_label_naming_no_configuration_runs_the_default_and_says_so(
    tmp_path: Path, short_tmp: Path, api: Emulator
) -> None:
    add_node(api, "gpu-8", {LABEL: "h100"}, {})
    agent = start_agent(
        tmp_path, short_tmp, api, "gpu-8", chart_configs(tmp_path, VALUES), "--slots-per-gpu", "2"
    )
    try:
        assert [g.total for g in agent.view().gpus] == [8 * GIB]  # the default's 1x8Gi
        status = wait_until(lambda: published(api, "gpu-8"), 60, "the KVShareNode status")
        assert status["nodeConfig"] == "default"
        assert {g["slots"] for g in status["gpus"]} == {2}  # the flag wins over the file
        found = conditions(status)
        applied = found["NodeConfigApplied"]
        assert (applied["status"], applied["reason"]) == ("False", "UnknownConfig")
        assert (
            "label kvshare.io/node-config=h100 names no configuration (known: lab)"
            in (applied["message"])
        )
        assert found["NvidiaDevicePluginConflict"]["status"] == "False"
        (event,) = wait_until(lambda: node_events(api), 30, "a Warning Event on the Node")
        assert event["reason"] == "UnknownNodeConfig"
        assert gauge(agent, "nvidia.com/gpu") == 0.0
    finally:
        agent.stop()


def test_every_nvidia_gpu_resource_counts_as_a_conflict_and_nothing_else() -> None:
    allocatable = {
        "cpu": "64",
        "nvidia.com/gpu": "0",
        "nvidia.com/gpu.shared": "16",
        "nvidia.com/mig-1g.10gb": "7",
        "example.com/fpga": "2",
        "kvshare.io/gpu": "16",
    }
    assert device_plugin_conflict(allocatable, gpus=2) == {
        "nvidia.com/gpu.shared": 16,
        "nvidia.com/mig-1g.10gb": 7,
    }
    assert device_plugin_conflict(allocatable, gpus=0) == {}
    assert device_plugin_conflict({"nvidia.com/gpu": "lots"}, gpus=1) == {}


def test_a_broken_configuration_file_stops_the_agent_with_a_clear_error(
    tmp_path: Path, short_tmp: Path
) -> None:
    bad = tmp_path / "configs.yaml"
    bad.write_text(json.dumps({"configs": {"lab": {"slotPerGpu": 4}}}), encoding="utf-8")
    agent = AgentProcess(short_tmp, None, ["--config", str(bad)])
    with pytest.raises(pytest.fail.Exception) as failed:
        agent.start()
    assert "slotPerGpu" in str(failed.value) and "exited 1" in str(failed.value)


def test_a_node_that_cannot_be_read_gets_no_slots_until_it_can(
    tmp_path: Path, short_tmp: Path, api: Emulator
) -> None:
    # No Node object (as when the API cannot answer): the agent must not guess its
    # configuration and advertise the default's slots.
    kubelet = StandInKubelet(short_tmp / "dp")
    kubelet.start()
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", api.url)
    agent = AgentProcess(
        short_tmp, None,
        ["--config", str(chart_configs(tmp_path, VALUES)), "--device-plugin-dir",
         str(short_tmp / "dp")],
        node_name="gpu-9", kubeconfig=kubeconfig,
    )  # fmt: skip
    agent.launch()
    try:
        port = wait_until(
            lambda: next((int(m.group(1)) for line in agent.log
                          if (m := re.search(r"answers 503 on 127\.0\.0\.1:(\d+)", line))), 0),
            60, "the agent to say it waits for its Node",
        )  # fmt: skip
        assert "waiting to read Node gpu-9 for its configuration" in "".join(agent.log)
        assert probe(port, "/healthz")[0] == 200  # alive: not restarted by its probe
        status, text = probe(port, "/readyz")
        assert status == 503 and "waiting to read Node gpu-9" in text
        time.sleep(2.0)  # retries meanwhile; nothing is advertised
        assert kubelet.registrations == []
        # The Node appears, labelled: the agent starts with that configuration.
        add_node(api, "gpu-9", {LABEL: "lab"}, {})
        wait_until(agent._started, 60, "the agent to start")
        assert kubelet.wait_registered(names.RESOURCE_GPU)
        assert [g.total for g in agent.view().gpus] == [16 * GIB, 16 * GIB]  # "lab"
    finally:
        agent.stop()
        kubelet.stop()


def probe(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
