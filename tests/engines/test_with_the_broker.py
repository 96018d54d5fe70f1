"""Engine pools under a real node agent: leases, identity and start-up turns from its broker.

``kvshare node`` runs with fake GPUs and no cluster (as in the node agent's own tests);
the pools are opened by the same functions the engine patches call, on the host backend.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvshare.api import env
from kvshare.runtime.engines import pools
from kvshare.runtime.engines.pools import Role
from kvshare.runtime.geometry import KVGeometry
from tests.deviceplugin.conftest import AgentProcess, check_engines_take_turns, wait_until

MIB = 2**20
ROOT = Path(__file__).resolve().parents[2]
POD_UIDS = {
    "a": "0f8fad5b-d9cb-469f-a165-70867728950a",
    "b": "0f8fad5b-d9cb-469f-a165-70867728950b",
}
GEOMETRY = KVGeometry(num_buffers=4, block_bytes=16 * 2**10, num_blocks=512, page_size=2 * MIB)


@pytest.fixture
def agent(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[AgentProcess]:
    node = AgentProcess(short_tmp, "2x8Gi", [])
    node.start()
    settings = {
        env.BROKER_SOCKET.name: str(node.broker_socket),
        env.GPU_UUIDS.name: ",".join(gpu.uuid for gpu in node.gpus),
        env.BACKEND.name: "host",
        env.RESERVE_PAGES.name: "0",
        env.KV_MIN.name: str(16 * MIB),
        env.STATIC_BYTES.name: str(256 * MIB),
        env.POD_NAMESPACE.name: "llm",
        env.POD_NAME.name: "qwen-0",
        env.POD_UID.name: "0f8fad5b-d9cb-469f-a165-70867728950e",
        env.MODELSERVER.name: "qwen",
    }
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    try:
        yield node
    finally:
        pools.forget_pools()
        node.stop()


def test_an_sglang_rank_leases_from_its_gpu_with_its_rank_and_real_tp_size(
    agent: AgentProcess,
) -> None:
    pool = pools.open_local_pool(GEOMETRY, "cpu", Role("sglang", 1, 2, "local"), agreed=True)
    views = wait_until(lambda: list(agent.pools().values()), what="the pool to say hello")
    (view,) = views
    assert (view.rank, view.tp_size, view.engine) == (1, 2, "sglang")
    assert view.gpu == agent.gpus[1].uuid  # rank 1's GPU, from KVSHARE_GPU_UUIDS
    assert (view.namespace, view.pod, view.modelserver) == ("llm", "qwen-0", "qwen")
    assert pool.ownership.mode == "local" and pool.ownership.world_size == 2
    ids = pool.alloc(8)
    assert ids, "the broker's lease covers a few pages"
    wait_until(lambda: agent.pools()[view.name].mapped > 0, what="the usage report")


def test_engines_starting_on_one_gpu_take_turns(agent: AgentProcess) -> None:
    check_engines_take_turns(
        agent,
        lambda: pools.startup_turn(Role("vllm", 0, 1, "coordinated")),
        static_bytes=256 * MIB,  # KVSHARE_STATIC_BYTES of the fixture
    )


def test_a_host_pool_is_sized_from_the_gpu_memory_the_agent_declares(
    agent: AgentProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(env.KV_MAX.name, raising=False)
    monkeypatch.delenv(env.KV_LIMIT.name, raising=False)
    monkeypatch.delenv(env.KV_CAPACITY.name, raising=False)
    with pools.startup_turn(Role("vllm", 0, 1, "coordinated")):
        # Rank 0's GPU is agent.gpus[0]: its declared 8 GiB, less the worker's static bytes.
        assert pools.virtual_kv_bytes("cpu", rank=0) == 8 * 2**30 - 256 * MIB
    with pytest.raises(pools.EngineConfigError, match="set KVSHARE_KV_CAPACITY"):
        pools.virtual_kv_bytes("cpu", rank=1)  # no turn taken on GPU 1: nothing stated it


def test_under_the_broker_a_worker_is_granted_its_static_footprint_and_kv_min(
    agent: AgentProcess,
) -> None:
    # What the start-up turn reserves for it: KVSHARE_STATIC_BYTES + KVSHARE_KV_MIN.
    assert pools.startup_budget() == 256 * MIB + 16 * MIB


def test_two_tp2_engines_starting_together_on_the_same_two_gpus_both_get_through(
    agent: AgentProcess,
) -> None:
    """Each group's rank 0 asks first, on the GPU the other group's rank 1 wants: given
    per GPU, each group would hold one turn and wait for the other until a timeout."""

    def rank(engine: str, rank: int, port: int) -> subprocess.Popen[str]:
        environ = {**os.environ, env.POD_UID.name: POD_UIDS[engine], env.POD_NAME.name: engine}
        command = [sys.executable, "-m", "tests.engines.tp_start", "--rank", str(rank)]
        return subprocess.Popen(
            [*command, "--port", str(port)],
            cwd=ROOT,
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    ports = {name: free_port() for name in ("a", "b")}
    first = [rank("a", 0, ports["a"]), rank("b", 1, ports["b"])]
    for process in first:
        assert process.stdout is not None and process.stdout.readline().strip() == "asking"
    wait_until(
        lambda: sum(gpu.turn_waiting + bool(gpu.turn_holder) for gpu in agent.view().gpus) == 2,
        what="both first ranks to ask",
    )
    second = [rank("a", 1, ports["a"]), rank("b", 0, ports["b"])]
    try:
        outputs = [process.communicate(timeout=60)[0] for process in (*first, *second)]
    finally:
        for process in (*first, *second):
            if process.poll() is None:
                process.kill()
    results = []
    for process, output in zip((*first, *second), outputs, strict=True):
        assert process.returncode == 0, output[-2000:]  # a deadlock: the set-up timed out
        results.append(json.loads(output.strip().splitlines()[-1]))
    assert all(result["peers"] == 2 for result in results)
    slowest = max(result["through_s"] for result in results)  # from asking to through
    assert slowest < 20, f"a rank took {slowest:.1f} s to get through its turn"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port
