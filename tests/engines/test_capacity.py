"""KV capacity comes from the pool's virtual size, and start-up runs in the GPU's turn.

The wrappers are exercised on stand-in workers (plain objects with the attributes vLLM's
and SGLang's workers have) whose "original" records what it saw: the engines' real
profiling needs a GPU. The real broker and its start-up turn are the node agent's; here
the test checks the standalone case (no broker: no turn, no error) and the sizing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvshare.runtime.engines import pools, vllm_common
from kvshare.runtime.engines.pools import EngineConfigError, Role


@pytest.fixture
def standalone(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("KVSHARE_BROKER_SOCKET", str(tmp_path / "no-broker.sock"))
    monkeypatch.setenv("KVSHARE_KV_MAX", "40Gi")


def test_pool_devices_are_explicit_indices() -> None:
    assert pools.device_index("cuda:3") == 3
    assert pools.device_index("cpu") == 0


def test_the_virtual_size_is_kv_max(standalone: None) -> None:
    assert pools.virtual_kv_bytes("cuda:3") == 40 * 2**30


def test_the_capacity_the_operator_sets_sizes_the_pool_above_kv_max(
    standalone: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kvCache.max can then be raised in place up to the capacity."""
    monkeypatch.setenv("KVSHARE_KV_CAPACITY", "60Gi")
    assert pools.virtual_kv_bytes("cpu") == 60 * 2**30


def test_without_kv_max_a_host_pool_asks_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSHARE_KV_MAX", raising=False)
    monkeypatch.delenv("KVSHARE_KV_LIMIT", raising=False)
    monkeypatch.delenv("KVSHARE_KV_CAPACITY", raising=False)
    with pytest.raises(EngineConfigError, match="set KVSHARE_KV_CAPACITY"):
        pools.virtual_kv_bytes("cpu")


def test_a_standalone_host_pool_is_sized_from_its_fixed_lease(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVSHARE_KV_MAX", raising=False)
    monkeypatch.setenv("KVSHARE_KV_LIMIT", "48Mi")
    assert pools.virtual_kv_bytes("cpu") == 48 * 2**20


def test_vllm_profiles_with_its_own_explicit_kv_size(standalone: None) -> None:
    seen: list[int] = []

    def profile(worker: Any) -> int:
        seen.append(worker.cache_config.kv_cache_memory_bytes)
        return int(worker.cache_config.kv_cache_memory_bytes)

    worker = SimpleNamespace(
        device="cuda:1", cache_config=SimpleNamespace(kv_cache_memory_bytes=None)
    )
    assert vllm_common.sizing_from_pool(profile)(worker) == 40 * 2**30
    assert seen == [40 * 2**30]


def test_without_a_broker_there_is_no_turn_to_take(standalone: None) -> None:
    with pools.startup_turn(Role("vllm", 0, 1, "coordinated")):
        pass


def test_a_failed_init_device_gives_the_turn_back(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []

    @contextlib.contextmanager
    def recording_turn(role: Role, group: str = "") -> Iterator[None]:
        events.append(f"take {role.engine} rank {role.rank}/{role.world_size} of {group}")
        try:
            yield
        finally:
            events.append("give back")

    def init_device(worker: Any) -> None:
        events.append("init_device")
        raise RuntimeError("no GPU")

    monkeypatch.setattr(pools, "startup_turn", recording_turn)
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=1, tensor_parallel_size=2, data_parallel_rank=0
        ),
        instance_id="abc",
    )
    worker = SimpleNamespace(vllm_config=config, local_rank=1)
    with pytest.raises(RuntimeError, match="no GPU"):
        vllm_common.taking_the_startup_turn(init_device)(worker)
    assert events == ["take vllm rank 1/2 of vllm-abc-dp0", "init_device", "give back"]


def test_vllm_groups_are_named_after_the_engine_instance() -> None:
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=1, tensor_parallel_size=4, data_parallel_rank=2
        ),
        instance_id="a1b2/c3",
    )
    assert vllm_common.group_of(config) == vllm_common.Group("vllm-a1b2-c3-dp2", 4)
    config.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(EngineConfigError, match="pipeline-parallel size 1"):
        vllm_common.group_of(config)


def test_standalone_a_worker_is_granted_its_static_footprint_and_fixed_limit(
    standalone: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSHARE_STATIC_BYTES", "12Gi")
    monkeypatch.setenv("KVSHARE_KV_LIMIT", "8Gi")
    monkeypatch.setenv("KVSHARE_KV_MIN", "1Gi")  # the broker's guarantee: not used standalone
    assert pools.startup_budget() == 20 * 2**30
