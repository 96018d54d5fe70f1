"""vLLM's own scheduler while the broker reclaims memory: running requests keep decoding.

A reclaim lowers the pool's lease below what it holds. The pool then takes no new request,
but a request vLLM already runs whose next token starts a block gets that block from a
page a finished request emptied, rather than being preempted (and later recomputed) for
want of memory the pool still holds. Prefix caching is off, so a finished request's blocks
go straight back to the pool.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvshare.runtime.pool import KVPool
from tests.engines.vllm.kv_setup import BLOCK_TOKENS, LAYERS, PAGE
from tests.engines.vllm.scheduler_setup import STOP, Engine, output, request, scheduled_engine
from tests.polling import wait_until


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Engine]:
    with scheduled_engine(monkeypatch, tmp_path, asynchronous=False, prefix_caching=False) as made:
        yield made


def pages_of(pool: KVPool, blocks: list[int]) -> set[int]:
    return {pool.geometry.page_of(block) for block in blocks}


def test_a_running_request_grows_into_an_emptied_page_while_the_pool_shrinks(
    engine: Engine,
) -> None:
    from vllm.v1.request import RequestStatus

    scheduler, pool = engine.scheduler, engine.pool
    manager = scheduler.kv_cache_manager
    scheduler.add_request(request("b", 7 * BLOCK_TOKENS - 4))  # page 0, around the null block
    scheduler.add_request(request("a", 8 * BLOCK_TOKENS))  # page 1, full: its next token
    scheduler.add_request(request("c", 8 * BLOCK_TOKENS - 4))  # page 2: finishes at once
    step1 = scheduler.schedule()
    assert set(step1.num_scheduled_tokens) == {"a", "b", "c"}
    a_page = pages_of(pool, manager.get_block_ids("a")[0])
    c_page = pages_of(pool, manager.get_block_ids("c")[0])
    assert len(a_page) == 1 and len(c_page) == 1 and a_page != c_page
    lease = 2 * len(LAYERS) * PAGE  # the broker reclaims: two pages, a and b hold both
    engine.rank.lease.set_limit(lease)
    wait_until(lambda: pool.snapshot().limit == lease, 10, "the pool to hear of the reclaim")

    scheduler.update_from_output(step1, output({"a": 9, "b": 9, "c": STOP}))
    assert not manager.get_block_ids("c")[0], "c's blocks are still held"
    pool.maintain()
    assert pool.snapshot().held > lease, "the pool gave back the page a is about to need"

    scheduler.add_request(request("d", 2 * BLOCK_TOKENS))  # arrives during the reclaim
    step2 = scheduler.schedule()
    a = scheduler.requests["a"]
    assert "a" in step2.num_scheduled_tokens and a.status == RequestStatus.RUNNING, (
        "the running request was preempted for want of a block"
    )
    assert a.num_preemptions == 0
    assert len(pages_of(pool, manager.get_block_ids("a")[0]) - a_page) == 1
    assert "d" not in step2.num_scheduled_tokens, "a new request was admitted over the lease"

    scheduler.update_from_output(step2, output({"a": STOP, "b": STOP}))
    pool.maintain()
    assert pool.snapshot().held <= lease, "the reclaim did not complete"
    step3 = scheduler.schedule()  # within its lease again: the pool takes d
    assert "d" in step3.num_scheduled_tokens
