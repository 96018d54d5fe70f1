"""What a trace allows: the same schedulers over partitions and over one shared pool."""

from __future__ import annotations

from kvshare.demo import trace
from kvshare.demo.bound import sharing_bound
from kvshare.demo.trace import TraceConfig


def test_one_model_gets_the_same_from_a_partition_and_a_pool() -> None:
    alone = trace.generate(TraceConfig(duration_s=8, models=1, gpu_memory_bytes=2**30))
    bound = sharing_bound(alone)
    assert bound.partitioned == bound.shared and bound.ratio == 1.0


def test_staggered_bursts_are_served_better_by_one_shared_pool() -> None:
    config = TraceConfig(duration_s=12, models=3, gpu_memory_bytes=2 * 2**30, seed=1)
    bursty = trace.generate(config)
    bound = sharing_bound(bursty)
    assert len(bound.partitioned) == len(bound.shared) == 3
    assert sum(bound.shared) > sum(bound.partitioned) > 0
    assert sum(bound.shared) <= len(bursty.requests)
    assert bound.ratio > 1
    assert sharing_bound(bursty) == bound  # no clock, no randomness: the same every time
