"""Step tables: lookups hit the grid's points, grow with the batch, and still match a
fresh computation by AIConfigurator."""

from __future__ import annotations

import importlib.util
import json
import random
from importlib import resources

import pytest

from kvshare.demo.step_cost import StepWork
from kvshare.twin.steps import MissingTableError, StepTable, load_table, tabulated

TABLES = tabulated()


def _payload(gpu: str, arch: str, engine: str, tp: int) -> dict:  # type: ignore[type-arg]
    path = resources.files("kvshare.twin").joinpath(
        "data", "steps", gpu, f"{arch.replace('/', '--')}--{engine}--tp{tp}.json"
    )
    return json.loads(path.read_text("utf-8"))  # type: ignore[no-any-return]


def test_every_architecture_is_tabulated_on_an_h200_and_the_small_ones_everywhere() -> None:
    have = {(gpu, arch) for gpu, arch, _, _ in TABLES}
    for arch in (
        "meta-llama/Llama-3.1-8B",
        "Qwen/Qwen3-8B",
        "Qwen/Qwen3-1.7B",
        "Qwen/Qwen3-0.6B",
        "meta-llama/Llama-3.1-70B",
    ):
        assert ("h200_sxm", arch) in have
    for gpu in ("h100_sxm", "a100_sxm", "l40s", "b200_sxm"):
        for arch in ("meta-llama/Llama-3.1-8B", "Qwen/Qwen3-0.6B"):
            assert (gpu, arch) in have


@pytest.mark.parametrize("combination", TABLES, ids=lambda c: f"{c[0]}-{c[1]}-tp{c[3]}")
def test_lookups_reproduce_every_grid_point(combination: tuple[str, str, str, int]) -> None:
    table = load_table(*combination)
    payload = _payload(*combination)
    linear = payload["linear"]
    for tokens, ms in zip(linear["tokens"], linear["ms"], strict=True):
        assert table.linear_ms(tokens) == pytest.approx(ms, rel=1e-9)
    prefill = payload["prefill_attention"]
    for prompts, row in zip(prefill["prompts"], prefill["ms"], strict=True):
        for length, ms in zip(prefill["lengths"], row, strict=True):
            assert table.prefill_attention_ms(prompts * length, length) == pytest.approx(
                ms, rel=1e-6
            )
    decode = payload["decode_attention"]
    for requests, row in zip(decode["requests"], decode["ms"], strict=True):
        for context, ms in zip(decode["contexts"], row, strict=True):
            assert table.decode_attention_ms(requests, context) == pytest.approx(ms, rel=1e-6)


@pytest.mark.parametrize("combination", TABLES, ids=lambda c: f"{c[0]}-{c[1]}-tp{c[3]}")
def test_a_bigger_batch_never_takes_less_time(combination: tuple[str, str, str, int]) -> None:
    table = load_table(*combination)
    for context in (100, 1500, 9000, 50000):
        times = [table.step_ms(StepWork(0, 0, n, n * context)) for n in range(1, 1100, 3)]
        assert times == sorted(times)
    for length in (80, 700, 6000):
        times = [table.step_ms(StepWork(n, n * length, 0, 0)) for n in range(1, 20000, 37)]
        assert times == sorted(times)
    # A step that also decodes takes longer than its prefill alone.
    assert table.step_ms(StepWork(512, 512 * 512, 32, 32 * 900)) > table.step_ms(
        StepWork(512, 512 * 512, 0, 0)
    )


def test_each_table_says_where_its_numbers_come_from_and_how_far_it_interpolates() -> None:
    payload = _payload("h200_sxm", "meta-llama/Llama-3.1-8B", "vllm", 1)
    assert payload["source"]["package"] == "aiconfigurator-core==0.12.0"
    assert payload["source"]["perf_data"].startswith("systems/data/h200_sxm/")
    assert payload["source"]["op_sources"]["context_gate_ffn1_gemm"] == "silicon"
    error = payload["interpolation_error"]["whole_prompts"]
    assert error["points"] >= 1000 and error["median"] < 0.01 and error["p95"] < 0.05


def test_a_missing_combination_is_refused_with_what_is_tabulated_near_it() -> None:
    with pytest.raises(MissingTableError, match=r"tools/tabulate_steps.py.*h200_sxm/"):
        load_table("h200_sxm", "meta-llama/Llama-3.1-8B", "vllm", 3)


def test_a_malformed_table_is_refused_naming_it() -> None:
    payload = _payload("h200_sxm", "meta-llama/Llama-3.1-8B", "vllm", 1)
    del payload["decode_attention"]["contexts"]
    with pytest.raises(ValueError, match=r"table broken\.json is malformed"):
        StepTable.from_payload(payload, origin="broken.json")


@pytest.mark.skipif(
    importlib.util.find_spec("aiconfigurator_core") is None,
    reason="aiconfigurator-core (the dev extra) is not installed",
)
@pytest.mark.parametrize(
    "combination",
    [
        ("h200_sxm", "meta-llama/Llama-3.1-8B", "vllm", 1),
        ("h200_sxm", "Qwen/Qwen3-0.6B", "vllm", 1),
        ("a100_sxm", "Qwen/Qwen3-8B", "vllm", 1),
        ("h200_sxm", "meta-llama/Llama-3.1-70B", "vllm", 2),
    ],
)
def test_regenerated_points_match_aiconfigurator(combination: tuple[str, str, str, int]) -> None:
    """Random grid points computed afresh by AIConfigurator match the committed table
    within 0.1 % (the tables round to a nanosecond)."""
    from tools import tabulate_steps

    gpu, arch, _, tp = combination
    pricer = tabulate_steps.Pricer(gpu, arch, tp)
    payload = _payload(*combination)
    rng = random.Random(7)
    worst = max(tabulate_steps.regenerated_error(pricer, payload, rng) for _ in range(12))
    assert worst < 1e-3
