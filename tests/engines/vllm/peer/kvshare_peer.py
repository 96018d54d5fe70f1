"""A pytest plugin that runs vLLM's own KV-cache and scheduler tests on kvshare's pools.

Loaded by ``../test_peer_suite.py`` into a pytest run of the tests from vLLM's source
distribution (``-p kvshare_peer``, this folder on ``PYTHONPATH``). It stands in for what
vLLM's ``tests/conftest.py`` and a GPU machine give those tests, and nothing else:

- vLLM's platform is one CUDA GPU (``../fake_gpu.py``, as the engine suite's workers have
  it); CUDA tensors live in host memory;
- the fixtures the selected files use from vLLM's conftest: ``default_vllm_config`` and
  ``caplog_vllm`` (vLLM's own bodies, shortened);
- kvshare's patches are applied (``activate("vllm")``), as ``KVSHARE_ENABLE`` does in an
  engine, and every KV cache coordinator vLLM builds gets, as the engine's hooks give it,
  a rank server over real host memory and its group's owner pool, attached to the
  coordinator's block pool with kvshare's own :func:`~kvshare.runtime.engines.vllm_blocks.attach`.
  The tests build their KV cache configs without tensors (no worker), so the pool's
  geometry is a model's: one 4 KiB granule per block of all layers (block-outer, as a
  16-token block of Llama-3.1-8B is one 2 MiB granule), or under ``KVSHARE_LAYOUT=per-layer``
  two per-layer buffers with 32 blocks per granule;
- a test whose model is not in the offline hub cache is skipped, naming the model;
- the tests named in ``KVSHARE_PEER_BY_DESIGN`` (comma-separated function names, every
  parametrization) are deselected: ``../test_peer_suite.py`` says why each cannot pass.

``KVSHARE_PEER_REPORT`` names a JSON file that gets the pools attached and blocks served.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

_counts = {"pools": 0, "blocks": 0}
_groups = itertools.count()
_OFFLINE = "Invalid repository ID or local directory specified: "


def _load_by_path(name: str, path: Path) -> ModuleType:
    """A module of this repository's tests, by file: ``tests`` is vLLM's package here."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _geometry(num_blocks: int) -> Any:
    from kvshare.api import env
    from kvshare.runtime.engines import pools
    from kvshare.runtime.geometry import KVGeometry

    granule = pools.page_size()
    if env.LAYOUT.require() == "per-layer":
        return KVGeometry(2, granule // 32, num_blocks, granule)
    return KVGeometry(1, granule, num_blocks, granule)


def _backed_by_a_pool(original: Callable[..., None]) -> Callable[..., None]:
    """Wrapper for ``KVCacheCoordinator.__init__``: the block pool draws from kvshare."""

    def init(self: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        from kvshare.runtime.engines import pools, vllm_blocks
        from kvshare.runtime.engines.pools import Role

        original(self, kv_cache_config, *args, **kwargs)
        if kv_cache_config.kv_cache_tensors:
            return  # a config with tensors: kvshare's own hook attached a pool
        geometry = _geometry(kv_cache_config.num_blocks)
        group = f"peer-{os.getpid()}-{next(_groups)}"
        pools.open_rank(geometry, "cpu", Role("vllm", 0, 1, "coordinated"), group)
        vllm_blocks.attach(self.block_pool, pools.open_owner_pool(geometry, group, 1))
        _counts["pools"] += 1

    return init


def _counting(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrapper for ``KVPool.alloc``: counts the blocks handed out."""

    def alloc(self: Any, n: int, **kwargs: Any) -> Any:
        got = original(self, n, **kwargs)
        _counts["blocks"] += len(got) if got else 0
        return got

    return alloc


def pytest_configure(config: pytest.Config) -> None:
    fake_gpu = _load_by_path("kvshare_fake_gpu", Path(__file__).parents[1] / "fake_gpu.py")
    fake_gpu.install(fake_gpu.Gpu(total=80 * fake_gpu.GIB, held_by_others=0))
    fake_gpu.HostTensors().__enter__()  # for the whole run, as a GPU is
    from vllm.v1.core import kv_cache_coordinator

    from kvshare.runtime.engines.activation import activate
    from kvshare.runtime.pool import KVPool

    activate("vllm")
    coordinator: Any = kv_cache_coordinator.KVCacheCoordinator
    coordinator.__init__ = _backed_by_a_pool(coordinator.__init__)
    pool: Any = KVPool
    pool.alloc = _counting(pool.alloc)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    names = set(filter(None, os.environ.get("KVSHARE_PEER_BY_DESIGN", "").split(",")))
    left_out = [item for item in items if getattr(item, "originalname", item.name) in names]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item not in left_out]


def pytest_unconfigure(config: pytest.Config) -> None:
    report = os.environ.get("KVSHARE_PEER_REPORT")
    if report:
        Path(report).write_text(json.dumps(_counts), encoding="utf-8")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome: Any = yield
    report = outcome.get_result()
    error = str(call.excinfo.value) if call.excinfo is not None else ""
    if report.failed and _OFFLINE in error:
        model = error.split(_OFFLINE, 1)[1].split("'")[1]
        report.outcome = "skipped"
        reason = f"Skipped: needs {model}'s files, not in the offline hub cache"
        report.longrepr = (str(item.path), item.location[1] or 0, reason)


@pytest.fixture(autouse=True)
def _pools_closed_after_each_test() -> Iterator[None]:
    yield
    from kvshare.runtime.engines import pools

    pools.forget_pools()


@pytest.fixture
def default_vllm_config() -> Iterator[Any]:
    from vllm.config import VllmConfig, set_current_vllm_config

    config = VllmConfig()
    with set_current_vllm_config(config):
        yield config


@pytest.fixture
def caplog_vllm(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> Iterator[pytest.LogCaptureFixture]:
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)
    with caplog.at_level(logging.INFO):
        yield caplog
