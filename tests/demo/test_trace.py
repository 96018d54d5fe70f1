"""The demo's trace: seeded, bursty in staggered phases, chat-like sizes, saved and loaded."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import pytest

from kvshare.demo import trace
from kvshare.demo.trace import TraceConfig, TraceError


def test_the_same_seed_gives_the_same_trace_and_another_seed_another() -> None:
    config = TraceConfig(seed=7, duration_s=20)
    assert trace.generate(config) == trace.generate(config)
    other = trace.generate(dataclasses.replace(config, seed=8))
    assert other.requests != trace.generate(config).requests


def test_busy_windows_are_staggered_one_model_at_a_time() -> None:
    config = TraceConfig(duration_s=30, models=3, cycles=2)
    windows = trace.phases(config)
    assert len(windows) == 3 * 6
    for start in sorted({p.start_s for p in windows}):
        busy = [p.model for p in windows if p.start_s == start and p.busy]
        assert len(busy) == 1, f"exactly one model is busy in the window at {start}"
    for model in range(3):
        mine = [p for p in windows if p.model == model]
        assert sum(p.busy for p in mine) == 2  # once per cycle
        assert mine[0].start_s == 0 and mine[-1].end_s == pytest.approx(30)


def test_arrivals_follow_the_stated_load_in_each_phase() -> None:
    config = TraceConfig(duration_s=600, models=3, busy_gpu_load=1.0, quiet_load=0.1)
    generated = trace.generate(config)
    for model in range(3):
        prefix = next(r.prefix_tokens for r in generated.for_model(model) if r.prefix_tokens)
        capacity = trace.share_capacity_rps(config, prefix)
        for phase in (p for p in trace.phases(config) if p.model == model):
            count = sum(
                1 for r in generated.for_model(model) if phase.start_s <= r.arrival_s < phase.end_s
            )
            expected = capacity * (3.0 if phase.busy else 0.1) * (phase.end_s - phase.start_s)
            assert count == pytest.approx(expected, rel=0.2), (model, phase)


def test_sizes_stay_inside_the_clipped_mix_and_look_like_chat() -> None:
    config = TraceConfig(duration_s=300)
    requests = trace.generate(config).requests
    assert all(config.prompt.low <= r.prompt_tokens <= config.prompt.high for r in requests)
    assert all(config.output.low <= r.output_tokens <= config.output.high for r in requests)
    # Long-tailed: medians near the configured ones, means above them.
    prompts = [r.prompt_tokens for r in requests if not r.prefix_tokens]
    outputs = [r.output_tokens for r in requests]
    assert 400 <= statistics.median(prompts) <= 650 < statistics.mean(prompts)
    assert 100 <= statistics.median(outputs) <= 160 < statistics.mean(outputs)


def test_a_share_of_requests_carries_its_models_system_prompt() -> None:
    config = TraceConfig(duration_s=300, prefix_share=0.5)
    generated = trace.generate(config)
    for model in range(config.models):
        mine = generated.for_model(model)
        prefixes = {r.prefix_tokens for r in mine if r.prefix_tokens}
        assert len(prefixes) == 1, "one system prompt per model"
        (prefix,) = prefixes
        assert config.prefix_tokens_low <= prefix <= config.prefix_tokens_high
        share = sum(1 for r in mine if r.prefix_tokens) / len(mine)
        assert 0.4 <= share <= 0.6
        assert all(r.prompt_tokens > r.prefix_tokens for r in mine)


def test_capacity_does_not_depend_on_the_seed() -> None:
    config = TraceConfig()
    assert trace.share_capacity_rps(config) == trace.share_capacity_rps(
        dataclasses.replace(config, seed=99)
    )


def test_kv_block_steps_counts_blocks_held_per_step() -> None:
    # 15-token prompt, 3 output tokens, 16-token blocks: 16 tokens -> 1, 17 -> 2, 18 -> 2.
    assert trace.kv_block_steps(15, 3, 16) == 1 + 2 + 2
    brute = sum(-(-(100 + t) // 16) for t in range(1, 301))
    assert trace.kv_block_steps(100, 300, 16) == brute


def test_a_trace_survives_a_round_trip_through_its_file(tmp_path: Path) -> None:
    original = trace.generate(TraceConfig(seed=3, duration_s=15))
    path = tmp_path / "trace.json"
    trace.save(original, path)
    assert trace.load(path) == original


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda p: "not json", "not a trace file"),
        (lambda p: json.dumps({**p, "format": "other"}), "is not a kvshare-demo-trace file"),
        (lambda p: json.dumps({**p, "version": 9}), "trace version 9"),
        (lambda p: json.dumps({**p, "config": {**p["config"], "x": 1}}), "unknown config"),
        (lambda p: json.dumps({**p, "requests": [[0, 1.0, 10]]}), "malformed trace"),
        (lambda p: json.dumps({**p, "requests": [[5, 1.0, 10, 10, 0]]}), "out of range"),
        (
            lambda p: json.dumps({**p, "requests": [[0, 2.0, 10, 10, 0], [0, 1.0, 10, 10, 0]]}),
            "arrival order",
        ),
    ],
)
def test_a_bad_trace_file_is_refused_with_the_reason(
    tmp_path: Path, mangle: object, message: str
) -> None:
    path = tmp_path / "trace.json"
    trace.save(trace.generate(TraceConfig(duration_s=5)), path)
    payload = json.loads(path.read_text())
    path.write_text(mangle(payload))  # type: ignore[operator]
    with pytest.raises(TraceError, match=message):
        trace.load(path)


def test_a_missing_trace_file_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        trace.load(tmp_path / "nope.json")


def test_a_gpu_too_small_for_the_largest_request_is_refused() -> None:
    with pytest.raises(TraceError, match="give the GPU more memory"):
        trace.generate(TraceConfig(gpu_memory_bytes=256 * 2**20))


def test_a_patience_that_is_not_positive_is_refused() -> None:
    with pytest.raises(TraceError, match="patience_s must be > 0"):
        trace.generate(TraceConfig(duration_s=5, patience_s=0))


def test_the_patience_travels_with_the_trace(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    trace.save(trace.generate(TraceConfig(duration_s=5, patience_s=4.5)), path)
    assert trace.load(path).config.patience_s == 4.5


def test_a_version_3_file_replays_with_the_fixed_step_engine_it_ran_on(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    trace.save(trace.generate(TraceConfig(duration_s=5)), path)
    payload = json.loads(path.read_text())
    for key in ("step_token_s", "step_context_s", "max_step_tokens"):
        del payload["config"][key]
    payload["version"] = 3
    path.write_text(json.dumps(payload))
    cost = trace.load(path).config.step_cost()
    assert (cost.per_token_s, cost.per_context_token_s, cost.max_tokens) == (0.0, 0.0, None)


def test_twice_the_memory_serves_twice_as_much_only_when_steps_cost_nothing_per_token() -> None:
    fixed = TraceConfig(step_token_s=0.0, step_context_s=0.0, max_step_tokens=None)
    priced = TraceConfig()

    def gain(config: TraceConfig) -> float:
        bigger = dataclasses.replace(config, gpu_memory_bytes=2 * config.gpu_memory_bytes)
        return trace.share_capacity_rps(bigger) / trace.share_capacity_rps(config)

    assert gain(fixed) == pytest.approx(2.0, rel=0.01)
    assert 1.0 < gain(priced) < 1.8
    assert trace.share_capacity_rps(priced) < trace.share_capacity_rps(fixed)


def test_busy_windows_come_from_the_arrivals_not_from_the_config() -> None:
    # The config says model 0 is busy in [0, 10) and model 1 in [10, 20); the requests
    # say model 1 was busy in [4, 8) and model 0 never.
    config = TraceConfig(duration_s=20, models=2, gpu_memory_bytes=2 * 2**30)
    rate = trace.share_capacity_rps(config) * 3
    rng = trace.model_rng(0, 1)
    rows = trace.poisson_requests(config, rng, model=1, prefix=0, start_s=4, end_s=8, rate=rate)
    rows += trace.poisson_requests(
        config, rng, model=0, prefix=0, start_s=0, end_s=20, rate=rate / 30
    )
    windows = trace.busy_windows(trace.assemble(config, rows))  # 2 s bins
    assert [(w.model, w.start_s, w.end_s) for w in windows] == [(1, 4.0, 8.0)]
