"""SGLang's KV budget is the pool's virtual size, not its free-memory profile.

The configurator is a stand-in with the attributes SGLang's has (its real profiling needs a
GPU); its "original" profiling fails the test if it runs.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvshare.runtime.engines import sglang_common


@pytest.fixture
def standalone(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("KVSHARE_BROKER_SOCKET", str(tmp_path / "no-broker.sock"))
    monkeypatch.setenv("KVSHARE_KV_MAX", "40Gi")


def test_sglang_budget_is_the_virtual_size_on_its_own_gpu(standalone: None) -> None:
    def profile(configurator: Any, pre_model_load_memory: int) -> int:
        raise AssertionError("SGLang's free-memory profiling must not run")

    configurator = SimpleNamespace(device="cuda", gpu_id=1)
    assert sglang_common.sizing_from_pool(profile)(configurator, 10) == 40 * 2**30
