"""Prometheus and promtool from Debian's `prometheus` package, and PromQL helpers."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.chart.helm import PROMETHEUS_OPERATOR, template

_MISSING = (
    "{tool} is not installed and could not be: `make prometheus` installs Debian's "
    "`prometheus` package with apt-get, which needs root"
)


def tool(name: str) -> str:
    """Path of ``promtool`` or ``prometheus``; skips the test with the reason when absent."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(_MISSING.format(tool=name))
    return path


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("promtool"), *args], capture_output=True, text=True, check=False, cwd=cwd,
        timeout=120,
    )  # fmt: skip


def rendered_rules(values: dict[str, Any] | None = None) -> dict[str, Any]:
    """The chart's PrometheusRule as a Prometheus rule file (``{"groups": [...]}``)."""
    rendered = template({"monitoring.enabled": True, **(values or {})}, PROMETHEUS_OPERATOR)
    return {"groups": rendered.one("PrometheusRule")["spec"]["groups"]}


def write_yaml(path: Path, data: Any) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False, width=1000), encoding="utf-8")
    return path


# PromQL words that are not metric names.
_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "inf", "nan", "le",
}  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (label matchers, grouping lists, strings,
    durations and function names removed first)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    names = set()
    for match in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        word = match.group(0)
        following = text[match.end() :].lstrip()
        if following.startswith("(") or word.lower() in _KEYWORDS:
            continue
        names.add(word)
    return names


def label_values_metric(query: str) -> str:
    """The metric of a Grafana ``label_values(metric{...}, label)`` variable query."""
    match = re.fullmatch(r"label_values\((.+),\s*[a-zA-Z_]+\)", query.strip())
    assert match, f"not a label_values query: {query}"
    return match.group(1)
