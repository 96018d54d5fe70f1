"""The elastic world in simulated time: the real books, policy and pools, deterministic."""

from __future__ import annotations

from kvshare.demo import trace
from kvshare.demo.elastic_sim import SimOptions, simulate
from kvshare.demo.trace import TraceConfig

SMALL = TraceConfig(duration_s=24, models=3, gpu_memory_bytes=3 * 2**30, seed=2)


def test_a_simulated_run_depends_only_on_the_trace_and_the_settings() -> None:
    made = trace.generate(SMALL)
    first = simulate(made)
    assert simulate(made) == first
    assert simulate(made, SimOptions(latency_s=0.05)) != first


def test_staggered_bursts_gain_from_elastic_memory_in_simulated_time() -> None:
    result = simulate(trace.generate(SMALL))
    assert sum(result.bound.shared) > sum(result.bound.partitioned)
    assert sum(result.served) > sum(result.bound.partitioned)
    assert 0 < result.gain_share <= 1.2
    model, ratio = result.worst_model()
    assert 0 <= model < SMALL.models and ratio > 0


def test_with_every_model_guaranteed_its_equal_share_nobody_can_borrow() -> None:
    made = trace.generate(SMALL)
    partitions = simulate(made, SimOptions(kv_min_share=1.0))
    static = sum(partitions.bound.partitioned)
    assert abs(sum(partitions.served) - static) <= 0.05 * static
    assert sum(simulate(made, SimOptions(kv_min_share=0.25)).served) > 1.05 * static
