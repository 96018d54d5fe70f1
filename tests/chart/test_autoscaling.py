"""The autoscaling examples (``examples/autoscaling/``) are valid for the APIs they are
written for and scale what kvshare serves on the signal the operator exports:

- the HorizontalPodAutoscaler against Kubernetes' own autoscaling/v2 schema
  (``kubernetes-validate``, strict), KEDA's ScaledObject against KEDA's CRD schema
  (vendored in ``schemas/``, with unknown fields refused as ``kubectl apply
  --validate=strict`` refuses them);
- both target a ModelServer through its scale subresource and name a metric the
  operator really exports, with labels it really has; the Prometheus adapter's rule
  serves that metric.

``test_live.py`` runs the same queries against a real Prometheus scraping the operator.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvshare.api import names
from kvshare.api.crds import all_crds
from kvshare.operator.metrics import ModelServerSample, OperatorMetrics

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "autoscaling"
KEDA_SCHEMA = Path(__file__).parent / "schemas" / "keda-scaledobject-v2.20.2.yaml"
PRESSURE = "kvshare_modelserver_kv_pressure_ratio"


def load(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((EXAMPLES / name).read_text(encoding="utf-8")))


def target_modelserver() -> dict[str, Any]:
    return dict(yaml.safe_load((ROOT / "examples" / "qwen-7b-vllm.yaml").read_text()))


def strict(schema: Any) -> Any:
    """``schema`` with unknown fields refused wherever it lists the known ones."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def keda_problems(obj: dict[str, Any]) -> list[str]:
    schema = strict(yaml.safe_load(KEDA_SCHEMA.read_text(encoding="utf-8")))
    validator = jsonschema.Draft7Validator(schema)
    return [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)
    ]


def pressure_labels() -> set[str]:
    """The labels of the operator's KV-pressure series."""
    metrics = OperatorMetrics()
    metrics.observe(("llm", "qwen-7b"), ModelServerSample("Ready"))
    (family,) = [m for m in metrics.registry.collect() if m.name == PRESSURE]
    (sample,) = family.samples
    return set(sample.labels)


def assert_targets_the_example_modelserver(obj: dict[str, Any]) -> None:
    target = target_modelserver()
    ref = obj["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"]) == (names.API_VERSION, names.MODELSERVER_KIND)
    assert ref["name"] == target["metadata"]["name"]
    assert obj["metadata"]["namespace"] == target["metadata"]["namespace"]
    (crd, _) = all_crds()
    assert crd["spec"]["names"]["kind"] == ref["kind"]
    assert "scale" in crd["spec"]["versions"][0]["subresources"]


@pytest.mark.parametrize("version", ["1.30", "1.31", "1.32", "1.33", "1.34"])
def test_the_hpa_example_is_a_valid_autoscaling_v2_object(version: str) -> None:
    kubernetes_validate.validate(load("hpa-kv-pressure.yaml"), version, strict=True)


def test_the_validation_catches_a_broken_hpa() -> None:
    broken = load("hpa-kv-pressure.yaml")
    broken["spec"]["metrics"][0]["external"]["target"]["averageUtilisation"] = 90
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.32", strict=True)


def test_the_hpa_scales_a_modelserver_on_the_operators_kv_pressure() -> None:
    hpa = load("hpa-kv-pressure.yaml")
    assert_targets_the_example_modelserver(hpa)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"]["name"] == PRESSURE
    assert metric["external"]["metric"]["selector"]["matchLabels"] == {
        "modelserver": target_modelserver()["metadata"]["name"]
    }
    assert set(metric["external"]["metric"]["selector"]["matchLabels"]) <= pressure_labels()
    assert hpa["spec"]["minReplicas"] <= target_modelserver()["spec"]["replicas"]


def test_the_prometheus_adapter_rule_serves_the_metric_the_hpa_asks_for() -> None:
    (rule,) = load("prometheus-adapter-values.yaml")["rules"]["external"]
    series = re.match(r"^([a-z_:]+)\{", rule["seriesQuery"])
    assert series is not None and series.group(1) == PRESSURE
    assert rule["name"]["as"] == PRESSURE
    assert set(rule["resources"]["overrides"]) <= pressure_labels()
    assert "<<.LabelMatchers>>" in rule["metricsQuery"]


def test_the_keda_example_is_a_valid_scaledobject() -> None:
    assert keda_problems(load("keda-scaledobject.yaml")) == []


def test_the_keda_validation_catches_a_broken_scaledobject() -> None:
    broken = load("keda-scaledobject.yaml")
    broken["spec"]["minReplicas"] = 2  # the HPA's spelling, not KEDA's
    del broken["spec"]["triggers"][0]["type"]
    problems = keda_problems(broken)
    assert any("minReplicas" in p for p in problems), problems
    assert any("'type' is a required property" in p for p in problems), problems


def test_the_scaledobject_queries_the_kv_pressure_of_its_target() -> None:
    scaled = load("keda-scaledobject.yaml")
    assert_targets_the_example_modelserver(scaled)
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    query = trigger["metadata"]["query"]
    target = target_modelserver()["metadata"]
    assert PRESSURE in query
    assert f'modelserver="{target["name"]}"' in query
    assert f'namespace="{target["namespace"]}"' in query
    assert float(trigger["metadata"]["threshold"]) == pytest.approx(0.9)


def queries_for(namespace: str, modelserver: str) -> list[str]:
    """The examples' PromQL, aimed at another ModelServer (for a live Prometheus)."""
    target = target_modelserver()["metadata"]
    keda = load("keda-scaledobject.yaml")["spec"]["triggers"][0]["metadata"]["query"]
    (rule,) = load("prometheus-adapter-values.yaml")["rules"]["external"]
    adapter = (
        rule["metricsQuery"]
        .replace("<<.Series>>", PRESSURE)
        .replace("<<.LabelMatchers>>", f'namespace="{namespace}",modelserver="{modelserver}"')
        .replace("<<.GroupBy>>", "namespace")
    )
    keda = keda.replace(f'namespace="{target["namespace"]}"', f'namespace="{namespace}"')
    keda = keda.replace(f'modelserver="{target["name"]}"', f'modelserver="{modelserver}"')
    return [keda, adapter]
