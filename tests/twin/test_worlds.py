"""The four worlds on one workload: static shares hold, first-come pages come back only
empty, the pooled bound beats every world where memory binds, and the kvshare world
runs the real broker books."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from kvshare.deviceplugin.broker.books import Books
from kvshare.twin import families, worlds
from kvshare.twin.allocators import FirstComePages
from kvshare.twin.capacity import capacity
from kvshare.twin.gpus import gpu_kind
from kvshare.twin.models import footprint
from kvshare.twin.pages import pool_shape
from kvshare.twin.workload import ModelSpec
from kvshare.twin.worlds import TwinOptions, place, run_world
from tests.twin.helpers import onoff

GIB = 2**30
#: Two 8B models on an L40S: about 4 GiB of KV between them, so memory binds.
TIGHT = onoff(models=2, gpu="l40s", duration_s=20.0, busy_rps=3.0, prompt=(500, 3000), seed=1)


def test_the_budget_is_the_gpus_usable_memory_less_every_static_footprint() -> None:
    placement = place(TIGHT)
    gpu = gpu_kind("l40s")
    static = sum(f.static_bytes for f in placement.footprints)
    assert placement.budget_bytes == gpu.usable_bytes - static
    assert 2 * GIB < placement.budget_bytes < 6 * GIB


def test_static_never_holds_more_than_its_share(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[Counted] = []

    class Counted(worlds.FixedBlocks):
        def __init__(self, count: int) -> None:
            super().__init__(count)
            self.count, self.held, self.peak = count, 0, 0
            made.append(self)

        def alloc(self, n: int, *, running: bool = False) -> list[int] | None:
            got = super().alloc(n, running=running)
            if got is not None:
                self.held += n
                self.peak = max(self.peak, self.held)
            return got

        def free(self, ids: Iterable[int]) -> None:
            ids = list(ids)
            self.held -= len(ids)
            super().free(ids)

    monkeypatch.setattr(worlds, "FixedBlocks", Counted)
    placement = place(TIGHT)
    run_world("static", TIGHT.at_scale(2.0), TwinOptions())
    assert len(made) == 2
    for pool, item in zip(made, placement.footprints, strict=True):
        assert (pool.count + 1) * item.block_bytes <= placement.share_bytes
        assert pool.peak <= pool.count
    assert max(pool.peak / pool.count for pool in made) > 0.9  # memory bound, and it held


def test_first_come_never_returns_a_page_that_holds_a_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    checked: list[int] = []

    class Checked(FirstComePages):
        def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            super().__init__(*args, **kwargs)
            self.live: list[set[int]] = [set() for _ in self._per_page]

        def alloc(self, model: int, n: int) -> list[int] | None:
            got = super().alloc(model, n)
            self.live[model].update(got or ())
            return got

        def free(self, model: int, ids: Iterable[int]) -> None:
            ids = list(ids)
            self.live[model].difference_update(ids)
            before = set(self._in_use[model])
            super().free(model, ids)
            per_page = self._per_page[model]
            for page in before - set(self._in_use[model]):
                blocks = range(page * per_page + 1, (page + 1) * per_page + 1)
                assert not self.live[model].intersection(blocks)
                checked.append(page)

    monkeypatch.setattr(worlds, "FirstComePages", Checked)
    run_world("first-come", TIGHT.at_scale(2.0), TwinOptions(page_layout="per-layer"))
    assert checked  # pages did come back


def test_the_pooled_bound_serves_at_least_what_every_world_serves_where_memory_binds() -> None:
    found = {
        name: capacity(
            lambda s, name=name: run_world(name, TIGHT.at_scale(s), TwinOptions()).verdict.met,
            precision=0.05,
        )
        for name in ("static", "first-come", "kvshare", "pooled-bound")
    }
    bound = found["pooled-bound"]
    for name, result in found.items():
        assert result.scale <= bound.missed_at, name
    assert bound.scale > found["static"].scale  # memory binds: sharing it helps


def test_the_kvshare_world_runs_the_real_broker_books(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"want": 0, "report": 0, "check": 0}
    for name in calls:
        real = getattr(Books, name)

        def spy(self, *args, _real=real, _name=name, **kwargs):  # type: ignore[no-untyped-def]
            calls[_name] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(Books, name, spy)
    result = run_world("kvshare", TIGHT, TwinOptions())
    assert result.world == "kvshare:entitlement"
    assert calls["want"] > 0 and calls["report"] > 0 and calls["check"] == 1


@pytest.mark.parametrize("policy", ["entitlement", "fair-share"])
def test_every_policy_has_a_kvshare_world(policy: str) -> None:
    assert run_world(f"kvshare:{policy}", TIGHT, TwinOptions()).verdict.requests == len(
        TIGHT.requests
    )


def test_a_workload_one_gpu_cannot_hold_serves_nothing_in_any_world() -> None:
    big = onoff(models=1, architecture="meta-llama/Llama-3.1-70B", duration_s=5.0)
    result = run_world("pooled-bound", big, TwinOptions())
    assert not result.verdict.met and "does not fit" in result.note


def test_pages_hold_the_blocks_of_each_layout() -> None:
    gpu = gpu_kind("h200_sxm")
    llama = footprint(ModelSpec("a", "meta-llama/Llama-3.1-8B"), gpu)
    qwen = footprint(ModelSpec("b", "Qwen/Qwen3-8B"), gpu)
    outer = pool_shape(llama, 10 * GIB, "block-outer")
    assert (outer.page_bytes, outer.blocks_per_page) == (2 * 2**20, 1)
    outer_qwen = pool_shape(qwen, 10 * GIB, "block-outer")
    assert (outer_qwen.page_bytes, outer_qwen.blocks_per_page) == (18 * 2**20, 8)
    layered = pool_shape(llama, 10 * GIB, "per-layer")
    assert (layered.page_bytes, layered.blocks_per_page) == (64 * 2**20, 32)
    assert layered.geometry.num_buffers == 32
    assert outer.geometry.num_blocks * outer.block_bytes >= 10 * GIB


def test_kvshare_keeps_no_idle_memory_that_first_come_would_serve_with() -> None:
    # Sixteen small models of Zipf popularity, at a load first-come sharing serves within
    # the SLO. Each quiet pool that kept headroom, and each growing pool that held a 256 MiB
    # ask it did not yet use, left memory idle that the busiest model's queue needed: the
    # kvshare world missed the SLO here (p99 time to first token over 2 s).
    workload = families.generate(
        "zipf-small", seed=2, model_class="small", duration_s=60.0
    ).at_scale(4.1)
    assert run_world("first-come", workload, TwinOptions()).verdict.met
    assert run_world("kvshare", workload, TwinOptions()).verdict.met
