"""The device plugin against a stand-in kubelet: real gRPC on real unix sockets, the
kubelet's side written from the public device plugin API (registration with dial-back,
ListAndWatch, GetPreferredAllocation, Allocate, restarts that delete every socket)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvshare.api import names
from kvshare.deviceplugin.agent import AgentConfig, NodeAgent
from kvshare.deviceplugin.inventory import FakeInventory, GpuInfo, parse_fake_gpus
from kvshare.deviceplugin.kubelet.kubelet_api import HEALTHY, UNHEALTHY
from kvshare.deviceplugin.kubelet.kubelet_standin import StandInKubelet
from kvshare.deviceplugin.kubelet.slots import AllocationError, allocate, preferred_slots
from tests.deviceplugin.conftest import ROOT
from tests.polling import wait_until

SLOTS = names.RESOURCE_GPU
MEMORY = names.RESOURCE_GPU_MEMORY


def start_agent(directory: Path, plugin_dir: Path) -> NodeAgent:
    agent = NodeAgent(
        AgentConfig.for_broker(
            "test-node",
            directory / "run" / "broker.sock",
            admin_dir=directory / "admin",
            fake_gpus="2x16Gi",
            device_plugin_dir=plugin_dir,
            metrics_host="127.0.0.1",
            metrics_port=0,
            use_kube=False,
            health_interval_s=3600,
        )
    )
    agent.start()
    return agent


@pytest.fixture
def node(short_tmp: Path) -> Iterator[tuple[NodeAgent, StandInKubelet]]:
    plugin_dir = short_tmp / "dp"
    kubelet = StandInKubelet(plugin_dir)
    kubelet.start()
    agent = start_agent(short_tmp, plugin_dir)
    assert kubelet.wait_registered(SLOTS) and kubelet.wait_registered(MEMORY)
    yield agent, kubelet
    agent.stop()
    kubelet.stop()


def gpus_of(agent: NodeAgent) -> list[GpuInfo]:
    return agent.current_gpus()


def test_both_resources_register_and_list_their_devices(
    node: tuple[NodeAgent, StandInKubelet],
) -> None:
    agent, kubelet = node
    slots = kubelet.endpoint(SLOTS)
    assert slots.options.get_preferred_allocation_available
    assert not kubelet.endpoint(MEMORY).options.get_preferred_allocation_available
    gpus = gpus_of(agent)
    assert sorted(kubelet.devices(SLOTS)) == sorted(
        f"{g.uuid}::{n}" for g in gpus for n in range(8)
    )
    assert set(kubelet.devices(SLOTS).values()) == {HEALTHY}
    # 16 GiB GPUs with 512 MiB headroom lend 15 whole GiB each.
    assert len(kubelet.devices(MEMORY)) == 2 * 15
    # The kubelet records a registration before the plugin's Register call returns.
    wait_until(lambda: agent.plugin_registered() == {SLOTS: True, MEMORY: True},
               what="the agent to know both registered")  # fmt: skip


def test_preferred_allocation_puts_k_slots_on_k_distinct_gpus(
    node: tuple[NodeAgent, StandInKubelet],
) -> None:
    _, kubelet = node
    available = sorted(kubelet.devices(SLOTS))
    chosen = kubelet.preferred(SLOTS, available, [], 2)
    assert len(chosen) == 2 and set(chosen) <= set(available)
    assert len({c.rsplit("::", 1)[0] for c in chosen}) == 2
    must = [available[3]]
    chosen = kubelet.preferred(SLOTS, available, must, 2)
    assert must[0] in chosen and len({c.rsplit("::", 1)[0] for c in chosen}) == 2
    # Only one GPU has slots left: the answer still has the exact size and is a subset.
    one_gpu = [a for a in available if a.startswith(available[0].rsplit("::", 1)[0])]
    chosen = kubelet.preferred(SLOTS, one_gpu, [], 2)
    assert len(chosen) == 2 and set(chosen) <= set(one_gpu)


def test_allocate_gives_visible_gpus_the_broker_mount_and_kvshare_env(
    node: tuple[NodeAgent, StandInKubelet],
) -> None:
    agent, kubelet = node
    gpus = gpus_of(agent)
    response = kubelet.allocate(SLOTS, [f"{gpus[1].uuid}::3", f"{gpus[0].uuid}::0"])
    envs = dict(response.envs)
    assert envs["KVSHARE_GPU_UUIDS"] == f"{gpus[0].uuid},{gpus[1].uuid}"  # rank = GPU order
    assert envs["KVSHARE_BROKER_SOCKET"] == f"{names.RUN_DIR}/broker.sock"
    assert envs["KVSHARE_BACKEND"] == "host"  # fake GPUs: no NVIDIA devices to expose
    assert "NVIDIA_VISIBLE_DEVICES" not in envs and "CUDA_VISIBLE_DEVICES" not in envs
    [mount] = response.mounts
    assert (mount.container_path, mount.read_only) == (names.RUN_DIR, True)
    assert mount.host_path == str(agent.config.broker_socket.parent)
    memory = kubelet.allocate(MEMORY, sorted(kubelet.devices(MEMORY))[:4])
    assert dict(memory.envs) == {} and list(memory.mounts) == []


@pytest.mark.parametrize(
    ("ids", "fragment"),
    [
        (lambda g: [f"{g[0].uuid}::0", f"{g[0].uuid}::1"], "must be on distinct GPUs"),
        (lambda g: ["GPU-not-here::0"], "names a GPU this node does not have"),
        (lambda g: ["nonsense"], "is not a kvshare device id"),
    ],
)
def test_allocate_refuses_slots_it_cannot_honour(
    node: tuple[NodeAgent, StandInKubelet], ids: object, fragment: str
) -> None:
    agent, kubelet = node
    with pytest.raises(grpc.RpcError) as info:
        kubelet.allocate(SLOTS, ids(gpus_of(agent)))  # type: ignore[operator]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in info.value.details()


def test_list_and_watch_streams_health_changes_and_stays_open(
    node: tuple[NodeAgent, StandInKubelet],
) -> None:
    agent, kubelet = node
    inventory = agent.inventory
    assert isinstance(inventory, FakeInventory)
    sick = gpus_of(agent)[1].uuid

    def health(resource: str, on_sick: bool) -> set[str]:
        devices = kubelet.devices(resource)
        return {h for d, h in devices.items() if d.startswith(sick) == on_sick}

    inventory.set_healthy(sick, False)
    agent.refresh_health()
    for resource in (SLOTS, MEMORY):
        assert kubelet.wait_for(lambda r=resource: health(r, True) == {UNHEALTHY}, 30)
        assert health(resource, False) == {HEALTHY}
    # An unhealthy GPU gets no new pools either.
    assert not agent.broker.view().gpus[1].healthy  # type: ignore[union-attr]
    inventory.set_healthy(sick, True)
    agent.refresh_health()
    assert kubelet.wait_for(lambda: set(kubelet.devices(SLOTS).values()) == {HEALTHY}, 30)
    assert kubelet.endpoint(SLOTS).stream_open


def test_the_plugin_registers_again_after_the_kubelet_restarts(
    node: tuple[NodeAgent, StandInKubelet],
) -> None:
    agent, kubelet = node
    restarted = time.monotonic()
    kubelet.restart()  # deletes every socket in the directory, the plugin's included
    assert kubelet.wait_registered(SLOTS, count=2) and kubelet.wait_registered(MEMORY, count=2)
    seconds = max(t for _, t in kubelet.registrations) - restarted
    assert seconds < 30  # the loop polls every 0.5 s; bench/deviceplugin.py measures it
    # Re-registering closes the previous streams; that must not trigger yet another round.
    time.sleep(2.0)
    assert [name for name, _ in kubelet.registrations].count(SLOTS) == 2
    gpus = gpus_of(agent)
    response = kubelet.allocate(SLOTS, [f"{gpus[0].uuid}::5"])
    assert dict(response.envs)["KVSHARE_GPU_UUIDS"] == gpus[0].uuid
    assert agent.plugin_registered() == {SLOTS: True, MEMORY: True}


def test_without_a_kubelet_the_plugin_waits_and_registers_when_one_appears(
    short_tmp: Path,
) -> None:
    plugin_dir = short_tmp / "dp"
    plugin_dir.mkdir()
    agent = start_agent(short_tmp, plugin_dir)
    try:
        time.sleep(1.0)
        assert agent.plugin_registered() == {SLOTS: False, MEMORY: False}
        assert agent.broker is not None and agent.broker.alive  # the broker serves anyway
        kubelet = StandInKubelet(plugin_dir)
        kubelet.start()
        try:
            assert kubelet.wait_registered(SLOTS) and kubelet.wait_registered(MEMORY)
        finally:
            kubelet.stop()
    finally:
        agent.stop()


def test_a_kubelet_refuses_a_bad_registration_with_status_unknown(short_tmp: Path) -> None:
    from kvshare.deviceplugin.kubelet.kubelet_api import pb, rpc

    kubelet = StandInKubelet(short_tmp)
    kubelet.start()
    try:
        with grpc.insecure_channel(f"unix://{kubelet.socket}") as channel:
            stub = rpc.RegistrationStub(channel)
            for version, resource in (("v1alpha", SLOTS), ("v1beta1", "kubernetes.io/gpu")):
                with pytest.raises(grpc.RpcError) as info:
                    stub.Register(
                        pb.RegisterRequest(
                            version=version, endpoint="x.sock", resource_name=resource
                        ),
                        timeout=10,
                    )
                assert info.value.code() == grpc.StatusCode.UNKNOWN
    finally:
        kubelet.stop()


def test_sigterm_removes_the_plugin_sockets(short_tmp: Path) -> None:
    plugin_dir = short_tmp / "dp"
    kubelet = StandInKubelet(plugin_dir)
    kubelet.start()
    agent = subprocess.Popen(
        [sys.executable, "-m", "kvshare.cli", "node", "--fake-gpus", "1x8Gi", "--no-kube",
         "--broker-socket", str(short_tmp / "run" / "broker.sock"),
         "--admin-dir", str(short_tmp / "admin"), "--device-plugin-dir",
         str(plugin_dir), "--metrics-address", "127.0.0.1:0"],
        cwd=ROOT, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert kubelet.wait_registered(SLOTS, timeout=60)
        sockets = {p.name for p in plugin_dir.iterdir()}
        assert {"kvshare-gpu.sock", "kvshare-gpu-memory.sock"} <= sockets
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=30) == 0
        assert {p.name for p in plugin_dir.iterdir()} == {names.KUBELET_SOCKET_NAME}
        assert not (short_tmp / "broker.sock").exists()
    finally:
        if agent.poll() is None:
            agent.kill()
        kubelet.stop()


# --- the decisions, without gRPC ---------------------------------------------------------

GPUS = {g.uuid: g for g in parse_fake_gpus("4x80Gi", "n")}
UUIDS = list(GPUS)


def slot(i: int, n: int = 0) -> str:
    return f"{UUIDS[i]}::{n}"


def test_preferred_slots_take_the_gpus_with_the_most_free_memory_without_a_plan() -> None:
    available = [slot(i, n) for i in range(4) for n in range(2)]
    free = {UUIDS[0]: 10, UUIDS[1]: 70, UUIDS[2]: 5, UUIDS[3]: 60}
    assert preferred_slots(available, [], 2, GPUS, free) == [slot(1), slot(3)]


def test_preferred_slots_follow_a_pending_pods_plan_when_it_fits() -> None:
    available = [slot(i, n) for i in range(4) for n in range(2)]
    free = dict.fromkeys(UUIDS, 10)
    asked: list[tuple[int, frozenset[str], frozenset[str]]] = []

    def planned(size: int, usable: frozenset[str], must: frozenset[str]) -> tuple[str, ...]:
        asked.append((size, usable, must))
        return (UUIDS[0], UUIDS[2])

    chosen = preferred_slots(available, [slot(2, 1)], 2, GPUS, free, planned=planned)
    assert chosen == [slot(2, 1), slot(0)]
    assert asked == [(2, frozenset(UUIDS), frozenset({UUIDS[2]}))]
    # A plan naming a GPU without a free slot is ignored: placement decides.
    only = [slot(1), slot(3)]
    assert sorted(preferred_slots(only, [], 2, GPUS, free, planned=planned)) == only


def test_allocation_on_real_gpus_uses_nvidia_env_or_cdi_names() -> None:
    ids = [slot(2), slot(0)]
    plain = allocate(ids, GPUS, backend="cuda", run_dir="/run/kvshare", broker_socket_name="b.sock")
    listed = f"{UUIDS[0]},{UUIDS[2]}"
    assert plain.envs["NVIDIA_VISIBLE_DEVICES"] == plain.envs["CUDA_VISIBLE_DEVICES"] == listed
    assert plain.cdi_devices == []
    cdi = allocate(ids, GPUS, backend="cuda", run_dir="/run/kvshare", broker_socket_name="b.sock",
                   cdi_kind="nvidia.com/gpu")  # fmt: skip
    assert cdi.cdi_devices == [f"nvidia.com/gpu={UUIDS[0]}", f"nvidia.com/gpu={UUIDS[2]}"]
    assert "NVIDIA_VISIBLE_DEVICES" not in cdi.envs
    with pytest.raises(AllocationError, match="distinct GPUs"):
        allocate([slot(1), slot(1, 3)], GPUS, backend="cuda", run_dir="/r", broker_socket_name="b")
