"""Step ``fence``: no page is unmapped while a kernel may still read it.

A pool's blocks hold a known pattern. A kernel is launched on a stream of its own that
first spins for a while (``torch.cuda._sleep``) and then reads those blocks; the launch
marks the backend's device fence on that stream, as the engine hooks do after each step.
Another thread then frees the blocks and runs the pool's maintenance, which unmaps the
emptied pages. The check passes when the unmap waited for the kernel (the kernel was done
when the maintenance returned), the kernel read the pattern (no stale read), no CUDA error
followed (no fault), and the pages are gone afterwards. In a dry run the kernel is work on
the ``host`` backend's stream.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from gpucheck.machine import MIB, Setup

PATTERN = 7
SPIN_S = 0.3  # how long the kernel runs before it reads


def _launch(setup: Setup, backend: Any, read: Callable[[], Any]) -> Callable[[], bool]:
    """Launch ``read`` behind a spin on a stream of its own, mark the backend's device fence
    on it; returns "is the kernel done"."""
    if setup.dry_run:
        finished = threading.Event()

        def kernel() -> None:
            time.sleep(SPIN_S)
            read()
            finished.set()

        backend.launch(kernel)
        backend.record_fence()
        return finished.is_set
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # after the pattern is written
    props = torch.cuda.get_device_properties(0)
    cycles = int(SPIN_S * props.clock_rate * 1000)  # clock_rate is in kHz
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)
        read()
    backend.record_fence((stream.cuda_stream,))
    return lambda: bool(stream.query())


def fence_check(setup: Setup) -> dict[str, Any]:
    import torch

    from kvshare.runtime.backends import open_backend
    from kvshare.runtime.geometry import KVGeometry
    from kvshare.runtime.lease import StaticLease
    from kvshare.runtime.pool import KVPool

    backend = open_backend(setup.backend, 0)  # type: ignore[arg-type]
    page = max(backend.granularity, 2 * MIB)
    geometry = KVGeometry(num_buffers=2, block_bytes=page // 8, num_blocks=8 * 16, page_size=page)
    pool = KVPool(geometry, backend, StaticLease(16 * geometry.page_bytes), reserve_pages=0)
    try:
        ids = pool.alloc(8 * 4)  # page 0 (the null block's) and four more
        assert isinstance(ids, list), ids
        view = pool.tensor(0)[0]
        blocks = [block for block in ids if geometry.page_of(block) > 0]
        index = torch.tensor(blocks, device=view.device)
        view[index] = PATTERN
        seen: list[Any] = []
        done = _launch(setup, backend, lambda: seen.append(view[index].to(torch.int64).sum()))
        freed_at = time.monotonic()
        maintenance = threading.Thread(target=lambda: (pool.free(ids), pool.maintain()))
        maintenance.start()
        maintenance.join(60)
        waited_s = time.monotonic() - freed_at
        kernel_done_first = done()
        setup.synchronize()
        expected = PATTERN * len(blocks) * geometry.block_bytes
        read = int(seen[0]) if seen else None
        pages_left = len(pool.mapped_pages())
        return {
            "blocks_read": len(blocks),
            "unmap_waited_s": round(waited_s, 3),
            "kernel_done_before_unmap": kernel_done_first,
            "read_ok": read == expected,
            "pages_mapped_after": pages_left,
            "ok": kernel_done_first and read == expected and pages_left <= 1,
        }
    finally:
        pool.close()
