"""The alerting rules the chart renders pass `promtool check rules`, and `promtool test rules`
shows each alert firing when it should, staying quiet while its `for` has not elapsed, and
never firing for a healthy series next to the faulty one. Every alert links its runbook
section in docs/runbooks.md."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from tests.chart.helm import ROOT
from tests.chart.prometheus import promtool, rendered_rules, write_yaml

RUNBOOKS = "https://github.com/kvshare/kvshare/blob/main/docs/runbooks.md"
POOL_A_LABELS = {"node": "gpu-1", "gpu": "GPU-a", "namespace": "llm", "pod": "qwen-7b-0",
                 "modelserver": "qwen-7b", "rank": "0", "pool": "llm/qwen-7b-0"}  # fmt: skip
POOL_A = ", ".join(f'{k}="{v}"' for k, v in POOL_A_LABELS.items())
POOL_B = ('node="gpu-1", gpu="GPU-a", namespace="llm", pod="llama-0", modelserver="llama", '
          'rank="0", pool="llm/llama-0"')  # fmt: skip
OP_A = 'job="kvshare-operator", instance="10.0.0.1:8080"'
OP_B = 'job="kvshare-operator", instance="10.0.0.2:8080"'


def _alert(labels: dict[str, str], summary: str, description: str, runbook: str) -> dict[str, Any]:
    return {
        "exp_labels": labels,
        "exp_annotations": {
            "summary": summary,
            "description": description,
            "runbook_url": f"{RUNBOOKS}#{runbook}",
        },
    }


def _phases(operator: str, modelserver: str, values: dict[str, str]) -> list[tuple[str, str]]:
    """Series of ``kvshare_modelserver_status_phase`` for ModelServer llm/``modelserver``."""
    return [
        (
            f'kvshare_modelserver_status_phase{{{operator}, namespace="llm", '
            f'modelserver="{modelserver}", phase="{phase}"}}',
            series,
        )
        for phase, series in values.items()
    ]


def _case(
    series: list[tuple[str, str]], alert: str, quiet_at: str, fires_at: str, expected: Any
) -> dict[str, Any]:
    """One promtool test: ``series``; ``alert`` silent at ``quiet_at``, as expected later."""
    return {
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in series],
        "alert_rule_test": [
            {"eval_time": quiet_at, "alertname": alert, "exp_alerts": []},
            {"eval_time": fires_at, "alertname": alert, "exp_alerts": [expected]},
        ],
    }


CASES = [
    # Down from minute 2: still pending at 6m (for 5m), firing at 10m; gpu-2 stays up.
    _case(
        [
            ('up{job="kvshare-node-agent", node="gpu-1"}', "1 1 0x20"),
            ('up{job="kvshare-node-agent", node="gpu-2"}', "1x22"),
        ],
        "KVShareNodeAgentDown",
        "6m",
        "10m",
        _alert(
            {"severity": "critical", "job": "kvshare-node-agent", "node": "gpu-1"},
            "kvshare node agent on gpu-1 does not answer",
            "Prometheus cannot scrape the node agent on gpu-1: its broker, device plugin and "
            "metrics may be down, and model servers there cannot grow their KV cache.",
            "kvsharenodeagentdown",
        ),
    ),
    # NVIDIA's device plugin advertises gpu-1's GPUs from minute 2 (the agent's check finds
    # it); gpu-2 has none.
    _case(
        [
            (
                'kvshare_node_device_plugin_conflict{node="gpu-1", resource="nvidia.com/gpu"}',
                "0 0 8x10",
            ),
            (
                'kvshare_node_device_plugin_conflict{node="gpu-2", resource="nvidia.com/gpu"}',
                "0x12",
            ),
        ],
        "KVShareDevicePluginConflict",
        "1m",
        "3m",
        _alert(
            {"severity": "critical", "node": "gpu-1", "resource": "nvidia.com/gpu"},
            "another device plugin hands out the GPUs kvshare serves on gpu-1",
            "gpu-1 advertises 8 nvidia.com/gpu for GPUs kvshare also serves: a pod asking for "
            "it gets a GPU kvshare lends to other pods. Keep NVIDIA's device plugin off the node.",
            "kvsharedevicepluginconflict",
        ),
    ),
    # One denial per second on GPU-a (above 0.1/s) for 30 minutes; GPU-b denies once a
    # minute for want of room, and many times a second against a pool's own kvCache.max.
    _case(
        [
            ('kvshare_broker_denials_total{node="gpu-1", gpu="GPU-a", reason="full"}', "0+60x40"),
            ('kvshare_broker_denials_total{node="gpu-1", gpu="GPU-b", reason="full"}', "0+1x40"),
            ('kvshare_broker_denials_total{node="gpu-1", gpu="GPU-b", reason="max"}', "0+600x40"),
        ],
        "KVShareBrokerDenialsSustained",
        "12m",
        "30m",
        _alert(
            {"severity": "warning", "node": "gpu-1", "gpu": "GPU-a"},
            "GPU GPU-a on gpu-1 keeps denying KV memory",
            "The broker denied 1 requests per second for 15m: the model servers on this GPU "
            "want more KV cache than it has.",
            "kvsharebrokerdenialssustained",
        ),
    ),
    # The audit flags pool A from minute 3; pool B is never flagged.
    _case(
        [
            (f"kvshare_pool_over_lease{{{POOL_A}}}", "0 0 0 1x8"),
            (f"kvshare_pool_over_lease{{{POOL_B}}}", "0x10"),
        ],
        "KVSharePoolOverLease",
        "4m",
        "6m",
        _alert(
            {"severity": "critical", **POOL_A_LABELS},
            "pool of llm/qwen-7b-0 holds more than its lease",
            "Rank 0 of llm/qwen-7b-0 holds more GPU memory than the broker charges it (plus one "
            "page), or keeps memory a reclaim asked back past its deadline: its neighbours on "
            "GPU GPU-a can run out of memory.",
            "kvsharepooloverlease",
        ),
    ),
    # Pool A misses its deadline at minute 5 and releases at minute 9; pool B never misses.
    _case(
        [
            (f"kvshare_pool_reclaim_overdue{{{POOL_A}}}", "0x4 1x4 0x6"),
            (f"kvshare_pool_reclaim_overdue{{{POOL_B}}}", "0x15"),
        ],
        "KVShareReclaimOverdue",
        "4m",
        "7m",
        _alert(
            {"severity": "warning", **POOL_A_LABELS},
            "pool of llm/qwen-7b-0 did not give memory back in time",
            "The broker asked the pool on GPU GPU-a of gpu-1 to shrink and its deadline passed: "
            "memory another pool is waiting for is still held.",
            "kvsharereclaimoverdue",
        ),
    ),
    # ModelServer llm/big is Unschedulable from minute 1 on the active operator replica, and
    # on a second replica too from minute 3 (as during a hand-over): one alert, for it only.
    # llm/qwen stays Ready; llm/flaky is Unschedulable for 5 minutes only.
    _case(
        [
            *_phases(OP_A, "big", {"Unschedulable": "0 1x20", "Pending": "1 0x20"}),
            *_phases(OP_B, "big", {"Unschedulable": "_ _ _ 1x18"}),
            *_phases(OP_A, "qwen", {"Ready": "1x21", "Unschedulable": "0x21"}),
            *_phases(OP_A, "flaky", {"Unschedulable": "1x4 0x16", "Starting": "0x4 1x16"}),
        ],
        "KVShareModelServerUnschedulable",
        "8m",
        "12m",
        _alert(
            {"severity": "warning", "namespace": "llm", "modelserver": "big"},
            "ModelServer llm/big cannot be placed",
            "For 10m, replicas of ModelServer llm/big have found no GPUs with room for their "
            "static memory plus kvCache.min; `kubectl -n llm describe modelserver big` shows "
            "why in its Placed condition.",
            "kvsharemodelserverunschedulable",
        ),
    ),
    # llm/qwen is Starting from minute 2 and Degraded from minute 10, never Ready: the move
    # between phases does not restart the alert's `for`. llm/llama starts for 5 minutes and
    # is Ready; llm/mistral is Ready throughout.
    _case(
        [
            *_phases(
                OP_A,
                "qwen",
                {"Ready": "1 1 0x29", "Starting": "0 0 1x7 0x21", "Degraded": "0x9 1x21"},
            ),
            *_phases(OP_A, "llama", {"Starting": "1x5 0x25", "Ready": "0x5 1x25"}),
            *_phases(OP_A, "mistral", {"Ready": "1x30", "Starting": "0x30"}),
        ],
        "KVShareModelServerNotReady",
        "10m",
        "20m",
        _alert(
            {"severity": "warning", "namespace": "llm", "modelserver": "qwen"},
            "ModelServer llm/qwen is not ready",
            "For 15m, ModelServer llm/qwen has been Pending, Starting or Degraded instead of "
            "Ready; `kubectl -n llm describe modelserver qwen` shows why in its Ready and "
            "Degraded conditions.",
            "kvsharemodelservernotready",
        ),
    ),
]


def _alerts(rules: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for g in rules["groups"] for r in g["rules"] if "alert" in r]


def test_rendered_rules_pass_promtool_check(tmp_path: Path) -> None:
    rules = write_yaml(tmp_path / "kvshare.rules.yaml", rendered_rules())
    done = promtool("check", "rules", str(rules))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(_alerts(rendered_rules()))} rules found" in done.stdout


def test_every_alert_fires_when_it_should_and_only_then(tmp_path: Path) -> None:
    rules = rendered_rules()
    tested = {case["alert_rule_test"][0]["alertname"] for case in CASES}
    assert tested == {a["alert"] for a in _alerts(rules)}, "an alert has no promtool case"
    write_yaml(tmp_path / "kvshare.rules.yaml", rules)
    suite = write_yaml(
        tmp_path / "kvshare.test.yaml",
        {"rule_files": ["kvshare.rules.yaml"], "evaluation_interval": "1m", "tests": CASES},
    )
    done = promtool("test", "rules", str(suite), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_a_broken_rule_makes_the_promtool_suite_fail(tmp_path: Path) -> None:
    """The suite above can fail: with a threshold the faulty series never reaches, it does."""
    rules = rendered_rules({"monitoring.alerts.denialRate": 5})
    write_yaml(tmp_path / "kvshare.rules.yaml", rules)
    suite = write_yaml(
        tmp_path / "kvshare.test.yaml",
        {"rule_files": ["kvshare.rules.yaml"], "evaluation_interval": "1m", "tests": CASES},
    )
    done = promtool("test", "rules", str(suite), cwd=tmp_path)
    assert done.returncode != 0
    assert "KVShareBrokerDenialsSustained" in done.stdout + done.stderr


def test_every_alert_has_a_summary_and_a_runbook_section() -> None:
    runbooks = (ROOT / "docs" / "runbooks.md").read_text(encoding="utf-8")
    anchors = {h.lower() for h in re.findall(r"^## (\S+)$", runbooks, flags=re.M)}
    for alert in _alerts(rendered_rules()):
        annotations = alert["annotations"]
        assert annotations["summary"]
        url = annotations["runbook_url"]
        assert url.startswith(RUNBOOKS)
        assert url.split("#", 1)[1] in anchors, f"{alert['alert']}: no runbook section"
