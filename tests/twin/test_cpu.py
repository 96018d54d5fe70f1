"""The CPU device (the elastic-vllm benchmark's machine in the twin) and the demo's trace
counted as the demo counts its real servers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from tools.calibrate_step_cost import serve_args

from kvshare.demo import trace as trace_mod
from kvshare.demo.real_server import BLOCK_TOKENS, TINY_KV_BYTES_PER_TOKEN, trace_config
from kvshare.demo.serving.vllm_server import ServerOptions
from kvshare.demo.step_cost import StepWork
from kvshare.twin.cpu import (
    CALIBRATIONS,
    DEFAULT_CALIBRATION,
    TINY_ARCHITECTURE,
    CpuStepCost,
    cpu_device,
    cpu_device_name,
    measured_calibration,
    measured_step_cost,
    tiny_architecture,
)
from kvshare.twin.demo_check import check_options, client_view, trace_workload
from kvshare.twin.device import GpuDevice, device_named
from kvshare.twin.slo import RequestRecord, SloVerdict
from kvshare.twin.workload import ModelSpec, Slo, TwinRequest, Workload
from kvshare.twin.worlds import TwinOptions, WorldResult, place, run_world

MIB = 2**20


def test_a_cpu_device_is_named_by_its_memory_cores_and_calibration() -> None:
    device = cpu_device("cpu-48mib")
    assert (device.memory_bytes, device.cores, device.calibration) == (
        48 * MIB,
        2,
        DEFAULT_CALIBRATION,
    )
    assert device.usable_bytes == 48 * MIB and device.name == "cpu-48mib"
    other = next(name for name in CALIBRATIONS if name != DEFAULT_CALIBRATION)
    name = cpu_device_name(64 * MIB, 4, other)
    assert name == f"cpu-64mib-4cores@{other}"
    assert cpu_device(name).name == name
    assert isinstance(device_named("h200_sxm"), GpuDevice)
    for bad in ("cpu-", "cpu-0mib", "cpu-48", "cpu-48mib@nope", "cpu-48mib-0cores"):
        with pytest.raises(ValueError):
            device_named(bad)


def test_the_tiny_models_geometry_comes_from_its_config() -> None:
    arch = tiny_architecture()
    assert arch.kv_bytes_per_token() == TINY_KV_BYTES_PER_TOKEN
    item = cpu_device("cpu-48mib").footprint(ModelSpec("m", TINY_ARCHITECTURE))
    assert item.block_tokens == BLOCK_TOKENS and item.static_bytes == 0
    with pytest.raises(ValueError, match="serves kvshare/tiny-llama"):
        cpu_device("cpu-48mib").footprint(ModelSpec("m", "meta-llama/Llama-3.1-8B"))


def test_the_cpu_step_cost_adds_its_measured_terms() -> None:
    cost = CpuStepCost(1e-3, 10e-6, 1e-7, 2e-6, 1e-9, "hand")
    decode = StepWork(decode_requests=4, decode_context=1000)
    assert cost.step_seconds(decode) == pytest.approx(1e-3 + 40e-6 + 100e-6)
    prefill = StepWork(prefill_tokens=100, prefill_attended=100 * 100)
    assert cost.step_seconds(prefill) == pytest.approx(1e-3 + 200e-6 + 10e-6)


def test_a_calibration_measured_at_run_time_prices_the_steps_of_a_device_named_after_it() -> None:
    """twin-check measures the machine it runs on: the fit the calibration tool prints
    (these numbers from a run on an AMD EPYC core) becomes a calibration by name."""
    fit = {
        "fixed_s": 4.62e-3,
        "per_token_s": 84.5e-6,
        "per_context_token_s": 0.856e-6,
        "prefill_s": [8.68e-3, 64.3e-6, 32.3e-9],
        "host_s": [2.47e-3, 199e-6],
        "scheduler_step_s": 3.33e-3,
        "load_average": [1.4, 3.1, 3.1],
    }
    cost = measured_step_cost(fit, "here")
    assert (cost.fixed_s, cost.prefill_token_s, cost.prefill_attention_s) == (
        4.62e-3,
        64.3e-6,
        32.3e-9,
    )
    assert (cost.host_request_s, cost.host_token_s, cost.scheduler_step_s) == (
        2.47e-3,
        199e-6,
        3.33e-3,
    )
    name = cpu_device_name(48 * 2**20, calibration="this-machine")
    with measured_calibration("this-machine", cost):
        assert cpu_device(name).cost(ModelSpec("m", TINY_ARCHITECTURE)) is cost
    with pytest.raises(ValueError, match="no CPU calibration 'this-machine'"):
        cpu_device(name)  # forgotten after the block
    with pytest.raises(ValueError, match="lower-case"), measured_calibration("This Machine", cost):
        pass


def test_a_measured_calibration_never_replaces_a_known_one() -> None:
    cost = dataclasses.replace(CALIBRATIONS[DEFAULT_CALIBRATION], fixed_s=1.0, source="here")
    with (
        pytest.raises(ValueError, match="already known"),
        measured_calibration(DEFAULT_CALIBRATION, cost),
    ):
        pass
    assert CALIBRATIONS[DEFAULT_CALIBRATION].fixed_s != 1.0
    with measured_calibration("here", cost):
        with pytest.raises(ValueError, match="already known"), measured_calibration("here", cost):
            pass
        assert CALIBRATIONS["here"] is cost


def test_what_serving_costs_outside_the_engine_comes_with_every_token_and_request() -> None:
    cost = CpuStepCost(
        1e-3,
        10e-6,
        0.0,
        2e-6,
        0.0,
        "hand",
        host_request_s=5e-3,
        host_token_s=1e-4,
        scheduler_step_s=2e-3,
    )
    # Four decoded tokens streamed, and two prompts done: two first tokens, two requests,
    # and the engine-core process's own CPU for the step.
    work = StepWork(prefill_tokens=100, decode_requests=4, first_tokens=2)
    assert cost.step_seconds(work) == pytest.approx(
        1e-3 + 40e-6 + 200e-6 + 6 * 1e-4 + 2 * 5e-3 + 2e-3
    )


def _pair(gpu: str) -> Workload:
    """Two tiny models, one prompt each at t=0."""
    models = (ModelSpec("a", TINY_ARCHITECTURE), ModelSpec("b", TINY_ARCHITECTURE))
    requests = (TwinRequest(0.0, "a", 512, 4), TwinRequest(0.0, "b", 512, 4))
    return Workload("pair", gpu, models, requests, duration_s=5.0)


def test_engines_share_a_core_they_are_pinned_to_and_not_the_other() -> None:
    options = TwinOptions(page_layout="per-layer")
    apart = run_world("pooled-bound", _pair("cpu-48mib"), options)
    together = run_world("pooled-bound", _pair("cpu-48mib-1cores"), options)
    first_apart = sorted(r.ttft_s or 0.0 for r in apart.records)
    first_together = sorted(r.ttft_s or 0.0 for r in together.records)
    prefill = CALIBRATIONS[DEFAULT_CALIBRATION].step_seconds(
        StepWork(prefill_tokens=512, prefill_attended=512 * 512, first_tokens=1)
    )
    assert first_apart == pytest.approx([prefill, prefill])
    # On one core the second prompt waits for the first one's step.
    assert first_together == pytest.approx([prefill, 2 * prefill])
    assert place(_pair("cpu-48mib")).budget_bytes == 48 * MIB


def _demo_trace() -> trace_mod.Trace:
    config = trace_config(
        seed=0, duration_s=20.0, models=3, gpu_memory_bytes=24 * MIB, patience_s=2.0
    )
    return trace_mod.generate(config)


def test_the_demo_trace_becomes_a_workload_on_its_fake_gpu() -> None:
    trace = _demo_trace()
    workload = trace_workload(trace)
    assert workload.gpu == "cpu-24mib" and len(workload.models) == 3
    assert len(workload.requests) == len(trace.requests)
    assert all(spec.block_tokens == BLOCK_TOKENS for spec in workload.models)
    first, mine = trace.requests[0], workload.requests[0]
    assert (mine.arrival_s, mine.prompt_tokens, mine.prefix_tokens) == (
        first.arrival_s,
        first.prompt_tokens,
        first.prefix_tokens,
    )


def test_a_check_run_follows_every_request_where_a_capacity_run_stops_early() -> None:
    trace = _demo_trace()
    workload = trace_workload(trace)
    strict = Workload(
        workload.name,
        workload.gpu,
        workload.models,
        workload.requests,
        workload.duration_s,
        slo=Slo(ttft_p99_s=0.001),
    )
    options = check_options(trace)
    followed = run_world("static", strict, options)
    assert len(followed.records) == len(trace.requests)
    stopped = run_world("static", strict, TwinOptions(page_layout="per-layer"))
    assert stopped.verdict.stopped_early and len(stopped.records) < len(trace.requests)
    view = client_view(followed, trace.config.duration_s, trace.config.patience_s)
    assert 0 < view.served <= len(trace.requests)


def _result(records: list[RequestRecord]) -> WorldResult:
    verdict = SloVerdict(False, len(records), 0.0, 0.0, (0.0,), 0)
    return WorldResult("static", verdict, sim_s=0.0, steps=0, records=tuple(records))


def test_clients_count_as_the_demo_counts_them() -> None:
    records = [
        RequestRecord(0, 0.5, 0.01, arrival_s=1.0, last_token_s=2.0),  # served
        RequestRecord(0, 0.5, 0.01, arrival_s=8.0, last_token_s=10.5),  # done after the end
        RequestRecord(0, None, None, arrival_s=2.0),  # gave up: the patience
        RequestRecord(0, None, None, arrival_s=9.0),  # still waiting at the end: 1 s so far
        RequestRecord(0, 3.0, 0.01, arrival_s=8.5, last_token_s=12.0),  # first token after
    ]
    view = client_view(_result(records), duration_s=10.0, patience_s=5.0)
    assert (view.served, view.abandoned) == (1, 2)
    # Waits: 0.5, 0.5, 5.0, 1.0, 1.5 (the trace ended 1.5 s after it arrived).
    assert view.ttft_p50_s == 1.0 and view.ttft_p99_s == 5.0
    incomplete = WorldResult(
        "static", SloVerdict(False, 6, 0.0, 0.0, (0.0,), 0), 0.0, 0, records=tuple(records)
    )
    with pytest.raises(ValueError, match="5 of 6 requests judged"):
        client_view(incomplete, 10.0, 5.0)


def test_the_calibration_runs_the_tiny_model_as_the_demo_servers_run_it() -> None:
    # The step cost was once measured with `--dtype auto`, which runs the float32 tiny
    # model in bfloat16 on CPU: prefills took half the time of the demo servers' steps.
    def value(argv: list[str], flag: str) -> str:
        return argv[argv.index(flag) + 1]

    calibration = serve_args(Path("model"), 8000)
    servers = ServerOptions(kvshare=False, kv_cache_bytes=2**20).argv(8000)
    for flag in ("--dtype", "--block-size", "--max-num-batched-tokens"):
        assert value(calibration, flag) == value(servers, flag), flag
    assert "--enforce-eager" in calibration and "--enforce-eager" in servers
