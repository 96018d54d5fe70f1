"""values.yaml is documented line by line and values.schema.json holds helm to it: wrong
types and unknown keys are refused by `helm template`/`install` with a message naming the
key, and every key the defaults have is in the schema."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from tests.chart.helm import CHART, helm, set_args

SCHEMA = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
VALUES_TEXT = (CHART / "values.yaml").read_text(encoding="utf-8")


def _refusal(values: dict[str, Any]) -> str:
    done = helm("template", "kvshare", str(CHART), *set_args(values))
    assert done.returncode != 0, f"helm accepted {values}"
    return done.stderr


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"operator.replicas": "two"}, "operator.replicas: Invalid type. Expected: integer"),
        ({"nodeAgent.hostPID": "yes"}, "nodeAgent.hostPID: Invalid type. Expected: boolean"),
        ({"nodeAgent.tolerations": {"key": "x"}}, "nodeAgent.tolerations: Invalid type"),
        ({"monitoring.enabled": "true"}, "monitoring.enabled: Invalid type. Expected: boolean"),
        ({"webhook.failurePolicy": "Retry"}, "webhook.failurePolicy: webhook.failurePolicy must"),
        ({"nodeAgent.fakeGpus": "80GB"}, "nodeAgent.fakeGpus: Does not match pattern"),
        ({"monitoring.alerts.denialsFor": "soon"}, "monitoring.alerts.denialsFor: Does not match"),
        ({"nodeAgent.slotPerGpu": 8}, "nodeAgent: Additional property slotPerGpu is not allowed"),
        ({"operator.replicas": 0}, "operator.replicas: Must be greater than or equal to 1"),
        ({"nodeAgent.brokerPolicy": "fifo"}, "nodeAgent.brokerPolicy: nodeAgent.brokerPolicy must"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_schema_refuses_wrong_values_naming_the_key(values: dict[str, Any], message: str) -> None:
    assert message in _refusal(values)


def _paths(schema: dict[str, Any], prefix: str = "") -> set[str]:
    found = set()
    for key, sub in schema.get("properties", {}).items():
        path = f"{prefix}{key}"
        found.add(path)
        found |= _paths(sub, f"{path}.")
    return found


def _value_paths(values: Any, prefix: str = "", schema: dict[str, Any] | None = None) -> set[str]:
    """Dotted keys of values.yaml, not descending into free-form maps (labels, selectors)."""
    found = set()
    if not isinstance(values, dict) or schema is None or "properties" not in schema:
        return found
    for key, sub in values.items():
        path = f"{prefix}{key}"
        found.add(path)
        found |= _value_paths(sub, f"{path}.", schema["properties"].get(key))
    return found


def test_every_default_value_is_in_the_schema_and_every_schema_key_has_a_default() -> None:
    defaults = yaml.safe_load(VALUES_TEXT)
    assert _value_paths(defaults, schema=SCHEMA) == _paths(SCHEMA)


def test_every_key_in_values_yaml_has_a_comment_above_it() -> None:
    """Each chart setting (a key the schema names) has its own comment line above it."""
    settings = _paths(SCHEMA)
    lines = VALUES_TEXT.splitlines()
    stack: list[tuple[int, str]] = []
    undocumented = []
    for number, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "-")) or ":" not in stripped:
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key = stripped.split(":", 1)[0].strip('"')
        stack.append((indent, key))
        path = ".".join(k for _, k in stack)
        if path in settings and not lines[number - 1].strip().startswith("#"):
            undocumented.append(f"values.yaml:{number + 1}: {stripped}")
    assert undocumented == []
    assert len(settings) > 60


def test_defaults_render_without_any_value_set() -> None:
    done = helm("template", "kvshare", str(CHART))
    assert done.returncode == 0, done.stderr
