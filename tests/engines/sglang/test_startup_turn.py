"""SGLang's start-up turn covers the weights and the KV buffers, under the real broker.

``kvshare node`` runs with fake GPUs (as in the node agent's tests). The rank's start-up is
SGLang's ``Scheduler.init_model_worker``, patched, around a stand-in of the real one that
keeps its order — load the weights, build the KV pools, then capture graphs — because the
real one needs a model and a GPU; the KV buffers are SGLang's own ``MHATokenToKVPool``
(patched: a pool on the host backend that says hello to the broker).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvshare.api import env
from kvshare.runtime.engines import pools, sglang_common
from kvshare.runtime.engines.activation import activate
from tests.deviceplugin.conftest import AgentProcess
from tests.engines.sglang.test_token_pools import PAGE, build

MIB = 2**20
STATIC = 512 * MIB


@pytest.fixture
def agent(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[AgentProcess]:
    node = AgentProcess(short_tmp, "1x8Gi", [])
    node.start()
    activate("sglang")
    for variable, value in (
        (env.BROKER_SOCKET, str(node.broker_socket)),
        (env.GPU_UUIDS, node.gpus[0].uuid),
        (env.BACKEND, "host"),
        (env.PAGE_SIZE, str(PAGE)),
        (env.RESERVE_PAGES, "0"),
        (env.STATIC_BYTES, str(STATIC)),
        (env.KV_MIN, str(4 * PAGE)),
    ):
        monkeypatch.setenv(variable.name, value)
    try:
        yield node
    finally:
        pools.forget_pools()
        node.stop()


def test_the_turn_is_held_from_the_weights_until_the_kv_buffers_exist(
    agent: AgentProcess,
) -> None:
    seen: dict[str, tuple[str, int]] = {}

    def broker_sees(step: str) -> None:
        gpu = agent.view().gpus[0]
        seen[step] = (gpu.turn_holder, gpu.static)

    def init_model_worker(scheduler: object) -> None:  # SGLang's order of start-up steps
        broker_sees("weights")  # init_tp_model_worker loads the model here
        build(page_size=1)  # init_memory_pools: the KV pool, its buffers, the allocator
        broker_sees("graphs")  # init_all_cuda_graphs

    scheduler = SimpleNamespace()
    rank = sglang_common.taking_the_startup_turn(lambda _: (0, 1))
    rank(init_model_worker)(scheduler)
    holder = f"pid {os.getpid()}"
    assert seen["weights"] == (holder, STATIC), "the weights loaded outside the GPU's turn"
    # The buffers ended the turn; the pool now holds the static footprint it reserved.
    assert seen["graphs"] == ("", STATIC)
    (pool,) = agent.pools().values()
    assert pool.static == STATIC and pool.kv_min == 4 * PAGE


def test_a_start_up_that_fails_gives_the_turn_back(agent: AgentProcess) -> None:
    def init_model_worker(scheduler: object) -> None:
        raise RuntimeError("the weights do not fit")

    with pytest.raises(RuntimeError, match="do not fit"):
        sglang_common.taking_the_startup_turn(lambda _: (0, 1))(init_model_worker)(object())
    gpu = agent.view().gpus[0]
    assert (gpu.turn_holder, gpu.static) == ("", 0)


def test_sglangs_own_vmm_arena_is_refused_before_the_rank_takes_its_turn(
    agent: AgentProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SGLang 0.5.23's post-capture KV sizing reserves the KV cache in a VMM arena of its
    # own: with kvshare's pool that would be a second reservation for one KV cache.
    started: list[object] = []
    monkeypatch.setenv("SGLANG_ENABLE_POST_CAPTURE_KV_SIZING", "1")
    rank = sglang_common.taking_the_startup_turn(lambda _: (0, 1))
    with pytest.raises(pools.EngineConfigError, match="SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=0"):
        rank(started.append)(SimpleNamespace())
    assert started == []  # no weights loaded, nothing reserved
    view = agent.view()
    assert (view.gpus[0].turn_holder, view.gpus[0].static, view.pools) == ("", 0, [])
