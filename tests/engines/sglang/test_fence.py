"""SGLang's overlap scheduler: a freed slot's page is unmapped only after the device work
that may still read it.

SGLang launches batch N+1 and only then processes batch N's result, freeing the slots of
requests that finished in N — which N+1 may still read. The rank's pool is on the ``host``
backend, whose stream stands in for the GPU: N+1's attention is work launched on it that
reads a finished request's KV slot, held until the test lets it run. The allocator, its
KV pool and the free are SGLang's own (patched); the launch is marked by the patched
``Scheduler.run_batch`` around a stand-in of the real one (which needs a model and a GPU).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from kvshare.runtime.backends.host import HostBackend
from kvshare.runtime.engines import sglang_common
from kvshare.runtime.pool import KVPool
from tests.engines.sglang.test_token_pools import (  # noqa: F401 - env is a fixture
    LAYERS,
    PAGE,
    build,
    env,
)

PATTERN = 42


@pytest.mark.usefixtures("env")
def test_a_slot_freed_under_a_launched_batch_stays_mapped_until_the_batch_is_done() -> None:
    cache = build(page_size=1)
    pool = cache.pool
    filler = cache.allocator.alloc(255)  # page 0, around the padding slot
    finished = cache.allocator.alloc(100)  # page 1: the request that finishes in batch N
    assert filler is not None and finished is not None
    page = pool.geometry.page_of(int(finished[0]))
    assert page != 0 and {pool.geometry.page_of(int(s)) for s in finished} == {page}
    k0 = cache.kvcache.k_buffer[0]
    k0[finished] = PATTERN  # batch N wrote its KV

    backend = pool.backend
    assert isinstance(backend, HostBackend)
    gate, cancelled, read = threading.Event(), threading.Event(), []

    def attention() -> None:  # batch N+1, still reading the finished request's KV
        gate.wait(60)
        if not cancelled.is_set():
            read.append(float(k0[finished[-1]].flatten()[0]))

    scheduler = SimpleNamespace(token_to_kv_pool_allocator=cache.allocator)
    try:
        sglang_common.marking_the_device_fence(lambda _: backend.launch(attention))(scheduler)
        cache.allocator.free(finished)  # batch N's result: the request is done
        pool.lease.set_limit(1 * 2 * LAYERS * PAGE)  # type: ignore[attr-defined]
        maintenance = threading.Thread(target=pool.maintain, daemon=True)  # the pool's pass
        maintenance.start()
        maintenance.join(1.0)
        assert mapped_on_device(pool, backend, page), "unmapped while the device still reads it"
        gate.set()
        maintenance.join(30)
        assert read == [PATTERN]  # no fault, no stale read
        assert not mapped_on_device(pool, backend, page)
        assert pool.snapshot().held == 1 * 2 * LAYERS * PAGE
    finally:
        cancelled.set()
        gate.set()


def mapped_on_device(pool: KVPool, backend: HostBackend, page: int) -> bool:
    """Whether the backend still maps ``page`` of layer 0's K buffer (the physical truth,
    not the pool's own bookkeeping)."""
    return pool.tensor(0).data_ptr() + page * pool.geometry.page_stride in backend.mapped_ranges()
