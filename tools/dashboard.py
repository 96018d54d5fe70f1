"""Write the kvshare Grafana dashboard (``make dashboard``) to stdout as JSON.

The chart ships the output as ``charts/kvshare/dashboards/kvshare.json``; a test keeps the
two equal, checks that every metric the queries use exists in the node agent's and the
operator's registries, and runs every query against a real Prometheus that scrapes a
running node agent. Panels are declared here compactly; Grafana's JSON is derived.

Queries use ``$node``, ``$gpu``, ``$namespace`` and ``$modelserver`` (multi-value, regex
matchers) and ``$__rate_interval``. The node agents are ``job="kvshare-node-agent"`` and
the operator ``job="kvshare-operator"`` (the chart's PodMonitor/ServiceMonitor set them).
The ModelServer variables list what the operator serves, so ModelServers that no GPU runs
yet (unschedulable ones) have their panels too. Operator series are taken with ``max``
over operator replicas: only the active one has per-ModelServer series, and a standby
one reports zero counts.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GPU = 'node=~"$node", gpu=~"$gpu"'
POOL = 'namespace=~"$namespace", modelserver=~"$modelserver"'
NODE_AGENT = 'job="kvshare-node-agent"'
MODELSERVER = f'job="kvshare-operator", {POOL}'


@dataclass(frozen=True)
class Query:
    """One PromQL query of a panel and the legend of its series."""

    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    """A panel: its kind, title, what it shows (the panel description), and its queries."""

    title: str
    description: str
    queries: tuple[Query, ...]
    kind: str = "timeseries"
    unit: str = "short"
    width: int = 12
    height: int = 8
    stacked: bool = False
    repeat: str | None = None
    repeat_direction: str = "h"
    """``h``: copies side by side; ``v``: copies stacked, beside another ``v`` panel's."""
    overrides: tuple[dict[str, Any], ...] = field(default=())


@dataclass(frozen=True)
class Row:
    """A titled row of panels."""

    title: str
    panels: tuple[Panel, ...]


ROWS: tuple[Row, ...] = (
    Row(
        "GPUs",
        (
            Panel(
                "GPU memory of $gpu",
                "Where each GPU's memory goes, stacked to its total: static footprints "
                "(weights, activations, CUDA context) of the pools on it, KV cache mapped "
                "for blocks in use, KV cache mapped but not in use (prefix-cache blocks, "
                "given back first under pressure), and memory no pool has mapped.",
                (
                    Query(
                        f"sum by (node, gpu) (kvshare_gpu_memory_static_bytes{{{GPU}}})", "static"
                    ),
                    Query(
                        f"sum by (node, gpu) (kvshare_gpu_kv_used_bytes{{{GPU}}})",
                        "KV mapped, in use",
                    ),
                    Query(
                        f"sum by (node, gpu) (kvshare_gpu_kv_mapped_bytes{{{GPU}}})"
                        f" - sum by (node, gpu) (kvshare_gpu_kv_used_bytes{{{GPU}}})",
                        "KV cached",
                    ),
                    Query(
                        f"sum by (node, gpu) (kvshare_gpu_memory_total_bytes{{{GPU}}})"
                        f" - sum by (node, gpu) (kvshare_gpu_memory_static_bytes{{{GPU}}})"
                        f" - sum by (node, gpu) (kvshare_gpu_kv_mapped_bytes{{{GPU}}})",
                        "free",
                    ),
                ),
                unit="bytes",
                stacked=True,
                repeat="gpu",
                width=8,
            ),
        ),
    ),
    Row(
        "ModelServers",
        (
            Panel(
                "KV cache of $modelserver",
                "The ModelServer's KV cache over all its workers: bytes its blocks use "
                "against its guaranteed minimum, the lease the brokers currently grant, and "
                "its cap. Used near the lease means it is growing; a lease falling toward "
                "the minimum means neighbours reclaimed memory.",
                (
                    Query(
                        f"sum by (namespace, modelserver) (kvshare_pool_kv_used_bytes{{{POOL}}})",
                        "used",
                    ),
                    Query(
                        f"sum by (namespace, modelserver) (kvshare_pool_kv_min_bytes{{{POOL}}})",
                        "min",
                    ),
                    Query(
                        f"sum by (namespace, modelserver) (kvshare_pool_kv_lease_bytes{{{POOL}}})",
                        "lease",
                    ),
                    Query(
                        f"sum by (namespace, modelserver) (kvshare_pool_kv_max_bytes{{{POOL}}})",
                        "max",
                    ),
                ),
                unit="bytes",
                repeat="modelserver",
                repeat_direction="v",
                width=16,
            ),
            Panel(
                "Replicas of $modelserver",
                "Replicas the ModelServer's spec asks for against those whose engine "
                "answers its health check. Ready below desired for longer than "
                "monitoring.alerts.notReadyFor fires KVShareModelServerNotReady; the "
                "ModelServer's Ready and Degraded conditions say why.",
                (
                    Query(
                        "max by (namespace, modelserver) "
                        f"(kvshare_modelserver_replicas{{{MODELSERVER}}})",
                        "desired",
                    ),
                    Query(
                        "max by (namespace, modelserver) "
                        f"(kvshare_modelserver_ready_replicas{{{MODELSERVER}}})",
                        "ready",
                    ),
                ),
                repeat="modelserver",
                repeat_direction="v",
                width=8,
            ),
        ),
    ),
    Row(
        "Broker",
        (
            Panel(
                "Broker decisions per second",
                "Lease requests the node brokers granted and denied, and reclaims they "
                "started, per node. Sustained denials mean the GPUs are full: lower "
                "kvCache.max or priorities, or add GPUs.",
                (
                    Query(
                        f"sum by (node) (rate(kvshare_broker_grants_total{{{GPU}}}"
                        "[$__rate_interval]))",
                        "grants {{node}}",
                    ),
                    Query(
                        f"sum by (node) (rate(kvshare_broker_denials_total{{{GPU}}}"
                        "[$__rate_interval]))",
                        "denials {{node}}",
                    ),
                    Query(
                        f"sum by (node) (rate(kvshare_broker_reclaims_total{{{GPU}}}"
                        "[$__rate_interval]))",
                        "reclaims {{node}}",
                    ),
                ),
                unit="ops",
            ),
            Panel(
                "Reclaim latency",
                "Time from the broker asking a pool to shrink until the pool has given "
                "the memory back (median and 99th percentile).",
                (
                    Query(
                        "histogram_quantile(0.5, sum by (le) (rate("
                        f"kvshare_broker_reclaim_seconds_bucket{{{GPU}}}[$__rate_interval])))",
                        "p50",
                    ),
                    Query(
                        "histogram_quantile(0.99, sum by (le) (rate("
                        f"kvshare_broker_reclaim_seconds_bucket{{{GPU}}}[$__rate_interval])))",
                        "p99",
                    ),
                ),
                unit="s",
            ),
        ),
    ),
    Row(
        "Operator",
        (
            Panel(
                "Placements per second",
                "Replica placements the operator decided, by result: placed, or "
                "unschedulable (no GPU had room for static memory plus kvCache.min).",
                (
                    Query(
                        "sum by (result) (rate(kvshare_operator_placements_total"
                        "[$__rate_interval]))",
                        "{{result}}",
                    ),
                ),
                unit="ops",
                width=8,
            ),
            Panel(
                "Unschedulable ModelServers",
                "Each ModelServer with replicas no GPU has room for (static memory plus "
                "kvCache.min), while it is so. Longer than monitoring.alerts.unschedulableFor "
                "fires KVShareModelServerUnschedulable; its Placed condition says why.",
                (
                    Query(
                        "max by (namespace, modelserver) (kvshare_modelserver_status_phase"
                        f'{{{MODELSERVER}, phase="Unschedulable"}}) == 1',
                        "{{namespace}}/{{modelserver}}",
                    ),
                ),
                kind="state-timeline",
                width=8,
            ),
            Panel(
                "ModelServers not ready",
                "Each ModelServer that is Pending, Starting or Degraded, while it is so, "
                "by phase. Longer than monitoring.alerts.notReadyFor fires "
                "KVShareModelServerNotReady; its Ready and Degraded conditions say why.",
                (
                    Query(
                        "max by (namespace, modelserver, phase) (kvshare_modelserver_status_phase"
                        f'{{{MODELSERVER}, phase=~"Pending|Starting|Degraded"}}) == 1',
                        "{{namespace}}/{{modelserver}} {{phase}}",
                    ),
                ),
                kind="state-timeline",
                width=8,
            ),
            Panel(
                "ModelServers by phase",
                "How many ModelServers are in each phase. Unschedulable ones have replicas "
                "no GPU has room for (their Placed condition says why); Starting ones wait "
                "for engines to load; Degraded ones need attention.",
                (
                    # max over operator replicas: a standby replica reports zeros.
                    Query(
                        'max by (phase) (kvshare_modelservers{job="kvshare-operator"})', "{{phase}}"
                    ),
                ),
                stacked=True,
                width=8,
            ),
            Panel(
                "Reconcile time",
                "Time the operator takes to reconcile one ModelServer, from reading its "
                "caches to the status written (median and 99th percentile).",
                (
                    Query(
                        "histogram_quantile(0.5, sum by (le) (rate("
                        "kvshare_operator_reconcile_seconds_bucket[$__rate_interval])))",
                        "p50",
                    ),
                    Query(
                        "histogram_quantile(0.99, sum by (le) (rate("
                        "kvshare_operator_reconcile_seconds_bucket[$__rate_interval])))",
                        "p99",
                    ),
                ),
                unit="s",
                width=8,
            ),
            Panel(
                "Node agents up",
                "Node agents Prometheus reaches, out of those it knows. Fewer up than "
                "known means GPU nodes whose broker and device plugin are down.",
                (
                    Query(f"sum(up{{{NODE_AGENT}}})", "up"),
                    Query(f"count(up{{{NODE_AGENT}}})", "known"),
                ),
                kind="stat",
                width=8,
            ),
        ),
    ),
)

#: Template variables: name -> (label, query over which the values are found).
VARIABLES: tuple[tuple[str, str, str], ...] = (
    ("node", "Node", "label_values(kvshare_gpu_memory_total_bytes, node)"),
    ("gpu", "GPU", 'label_values(kvshare_gpu_memory_total_bytes{node=~"$node"}, gpu)'),
    (
        "namespace",
        "Namespace",
        'label_values(kvshare_modelserver_replicas{job="kvshare-operator"}, namespace)',
    ),
    (
        "modelserver",
        "ModelServer",
        "label_values(kvshare_modelserver_replicas"
        '{job="kvshare-operator", namespace=~"$namespace"}, modelserver)',
    ),
)


def _display(panel: Panel) -> tuple[dict[str, Any], dict[str, Any]]:
    """Field defaults and options of ``panel``'s kind of visualization."""
    defaults: dict[str, Any] = {"unit": panel.unit}
    legend = {"displayMode": "list", "placement": "bottom"}
    if panel.kind == "timeseries":
        custom: dict[str, Any] = {"fillOpacity": 60 if panel.stacked else 10, "lineWidth": 1}
        if panel.stacked:
            custom["stacking"] = {"mode": "normal", "group": "A"}
        return {**defaults, "custom": custom}, {"legend": legend}
    if panel.kind == "state-timeline":
        # One row per series, filled while the series exists (its value is always 1).
        defaults["custom"] = {"fillOpacity": 80, "lineWidth": 0}
        defaults["color"] = {"mode": "fixed", "fixedColor": "orange"}
        options = {"showValue": "never", "mergeValues": True, "rowHeight": 0.8}
        return defaults, {**options, "legend": {**legend, "showLegend": False}}
    return defaults, {"reduceOptions": {"calcs": ["lastNotNull"]}, "textMode": "value_and_name"}


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    targets = [
        {"datasource": DATASOURCE, "expr": q.expr, "legendFormat": q.legend, "refId": chr(65 + i)}
        for i, q in enumerate(panel.queries)
    ]
    defaults, options = _display(panel)
    out: dict[str, Any] = {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"x": x, "y": y, "w": panel.width, "h": panel.height},
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": list(panel.overrides)},
        "options": options,
    }
    if panel.repeat:
        out["repeat"] = panel.repeat
        out["repeatDirection"] = panel.repeat_direction
        if panel.repeat_direction == "h":
            out["maxPerRow"] = 24 // panel.width
    return out


def _layout() -> Iterator[dict[str, Any]]:
    panel_id, y = 1, 0
    for row in ROWS:
        yield {"id": panel_id, "type": "row", "title": row.title, "collapsed": False,
               "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}, "panels": []}  # fmt: skip
        panel_id, y, x = panel_id + 1, y + 1, 0
        for panel in row.panels:
            if x + panel.width > 24:
                x, y = 0, y + panel.height
            yield _panel_json(panel, panel_id, x, y)
            panel_id, x = panel_id + 1, x + panel.width
        y += max(p.height for p in row.panels)


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": f"{name}-values"},
        "definition": query,
        "refresh": 2,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


def dashboard() -> dict[str, Any]:
    """The whole dashboard as Grafana's JSON model."""
    datasource_variable = {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
    }
    return {
        "uid": "kvshare",
        "title": "kvshare",
        "description": "Elastic GPU memory: GPUs, ModelServers, brokers and the operator.",
        "tags": ["kvshare", "gpu", "llm"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-3h", "to": "now"},
        "refresh": "30s",
        "timezone": "browser",
        "templating": {"list": [datasource_variable, *(_variable(*v) for v in VARIABLES)]},
        "annotations": {"list": []},
        "panels": list(_layout()),
    }


def main() -> int:
    sys.stdout.write(json.dumps(dashboard(), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
