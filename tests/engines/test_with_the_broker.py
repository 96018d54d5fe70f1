"""Engine pools under a real node agent: leases, identity and start-up turns from its broker.

``kvshare node`` runs with fake GPUs and no cluster (as in the node agent's own tests);
the pools are opened by the same functions the engine patches call, on the host backend.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvshare.api import env
from kvshare.runtime.engines import pools
from kvshare.runtime.engines.pools import Role
from kvshare.runtime.geometry import KVGeometry
from tests.deviceplugin.conftest import AgentProcess, check_engines_take_turns, wait_until

MIB = 2**20
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
        env.POD_UID.name: "uid-qwen-0",
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


def test_under_the_broker_a_worker_is_granted_its_static_footprint_and_kv_min(
    agent: AgentProcess,
) -> None:
    # What the start-up turn reserves for it: KVSHARE_STATIC_BYTES + KVSHARE_KV_MIN.
    assert pools.startup_budget() == 256 * MIB + 16 * MIB
