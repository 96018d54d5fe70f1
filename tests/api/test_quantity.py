"""Kubernetes quantities parse to exact bytes and print back exactly."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvshare.api.quantity import (
    QuantityError,
    format_bytes,
    format_bytes_human,
    parse_bytes,
    parse_quantity,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("40Gi", 40 * 2**30),
        ("512Mi", 512 * 2**20),
        ("1.5G", 1_500_000_000),
        ("1.5Gi", 3 * 2**29),
        ("2Ki", 2048),
        ("1e9", 10**9),
        ("1E3", 1000),
        ("123", 123),
        (123, 123),
        ("0", 0),
        (".5Ki", 512),
        ("1.Ki", 1024),
        ("+4k", 4000),
        ("1000m", 1),
        (" 40Gi ", 40 * 2**30),
    ],
)
def test_parse_bytes_accepts_kubernetes_quantities(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("40GB", "not a valid quantity"),
        ("abc", "not a valid quantity"),
        ("", "not a valid quantity"),
        ("4 Gi", "not a valid quantity"),
        ("-1Gi", "is negative"),
        ("1m", "not a whole number of bytes"),
        ("0.1", "not a whole number of bytes"),
        ("1e999", "larger than any memory size"),
        ("1e-999", "exponent -999 is out of range"),
    ],
)
def test_parse_bytes_explains_bad_input(text: str, message: str) -> None:
    with pytest.raises(QuantityError, match=message) as info:
        parse_bytes(text, field="kvCache.min")
    assert str(info.value).startswith("kvCache.min: ")


@pytest.mark.parametrize("value", [True, 1.5, None, ["1Gi"]])
def test_parse_quantity_refuses_non_quantities(value: object) -> None:
    with pytest.raises(QuantityError):
        parse_quantity(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [
        (0, "0"),
        (40 * 2**30, "40Gi"),
        (2 * 2**20, "2Mi"),
        (1_500_000_000, "1500M"),
        (3 * 2**29, "1536Mi"),
        (1000, "1k"),
        (1024, "1Ki"),
        (123, "123"),
        (2**60, "1Ei"),
    ],
)
def test_format_bytes_prints_the_shortest_exact_quantity(num_bytes: int, text: str) -> None:
    assert format_bytes(num_bytes) == text


@given(st.integers(min_value=0, max_value=2**70))
def test_format_then_parse_is_exact(num_bytes: int) -> None:
    assert parse_bytes(format_bytes(num_bytes)) == num_bytes


@given(
    st.integers(min_value=0, max_value=10**6),
    st.sampled_from(["", "k", "M", "G", "Ki", "Mi", "Gi", "Ti"]),
)
def test_parse_then_format_then_parse_is_stable(number: int, suffix: str) -> None:
    value = parse_bytes(f"{number}{suffix}")
    assert parse_bytes(format_bytes(value)) == value


def test_format_bytes_human_rounds_for_people() -> None:
    assert format_bytes_human(3 * 2**29) == "1.5Gi"
    assert format_bytes_human(512) == "512"
    assert format_bytes_human(5 * 2**40) == "5.0Ti"
