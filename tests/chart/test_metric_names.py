"""Every metric the dashboard and the alerts query exists in the real registries of the node
agent (``kvshare.deviceplugin.admin.metrics.registry()``) and the operator
(``kvshare.operator.metrics.registry()``), under the name Prometheus stores it by."""

from __future__ import annotations

import importlib

from prometheus_client import CollectorRegistry

from tests.chart.prometheus import metric_names, rendered_rules
from tests.chart.test_dashboard import dashboard_metric_names

REGISTRIES = {
    "node agent": "kvshare.deviceplugin.admin.metrics",
    "operator": "kvshare.operator.metrics",
}
#: Series Prometheus makes itself for every target.
PROMETHEUS_OWN = {"up"}
#: Sample suffixes by metric type, as the text exposition format writes them.
_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_count", "_sum"),
    "summary": ("_count", "_sum", ""),
    "gauge": ("",),
    "info": ("_info",),
    "stateset": ("",),
    "unknown": ("",),
}


def exposed_names(registry: CollectorRegistry) -> set[str]:
    """Sample names a registry exposes, including labelled metrics with no child yet."""
    names = set()
    for family in registry.collect():
        names |= {family.name + suffix for suffix in _SUFFIXES[family.type]}
        names |= {sample.name for sample in family.samples}
    return names


def real_names() -> set[str]:
    names: set[str] = set()
    for module in REGISTRIES.values():
        names |= exposed_names(importlib.import_module(module).registry())
    return names


def test_every_dashboard_metric_exists_in_a_real_registry() -> None:
    used = dashboard_metric_names() - PROMETHEUS_OWN
    assert used
    assert used - real_names() == set()


def test_every_alert_metric_exists_in_a_real_registry() -> None:
    used: set[str] = set()
    for group in rendered_rules()["groups"]:
        for rule in group["rules"]:
            used |= metric_names(rule["expr"])
    assert used - PROMETHEUS_OWN
    assert used - PROMETHEUS_OWN - real_names() == set()


def test_name_extraction_finds_metrics_and_ignores_labels_and_functions() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, gpu) (rate(a_seconds_bucket{node=~"$node"}[5m])))'
        ' / on (gpu) group_left b_total - max(c{job="x"}) > 0'
    )
    assert metric_names(expr) == {"a_seconds_bucket", "b_total", "c"}
