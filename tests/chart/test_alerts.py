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
            "Rank 0 of llm/qwen-7b-0 holds more GPU memory than the broker granted it (plus one "
            "page): its neighbours on GPU GPU-a can run out of memory.",
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
    # Two ModelServers Unschedulable from minute 1 on the active operator replica; the
    # standby replica reports zeros throughout.
    _case(
        [
            (f'kvshare_modelservers{{{OP_A}, phase="Unschedulable"}}', "0 2x20"),
            (f'kvshare_modelservers{{{OP_B}, phase="Unschedulable"}}', "0x21"),
            (f'kvshare_modelservers{{{OP_A}, phase="Ready"}}', "3x21"),
        ],
        "KVShareModelServerUnschedulable",
        "8m",
        "12m",
        _alert(
            {"severity": "warning"},
            "2 ModelServers cannot be placed",
            "For 10m, 2 ModelServers have had replicas that no GPUs have room for (static "
            "memory plus kvCache.min); `kubectl get modelservers -A` lists them and their "
            "Placed condition says why.",
            "kvsharemodelserverunschedulable",
        ),
    ),
    # One ModelServer Starting from minute 2 and never Ready; the others are Ready.
    _case(
        [
            (f'kvshare_modelservers{{{OP_A}, phase="Starting"}}', "0 0 1x28"),
            (f'kvshare_modelservers{{{OP_A}, phase="Pending"}}', "0x30"),
            (f'kvshare_modelservers{{{OP_A}, phase="Degraded"}}', "0x30"),
            (f'kvshare_modelservers{{{OP_A}, phase="Ready"}}', "4x30"),
        ],
        "KVShareModelServerNotReady",
        "10m",
        "20m",
        _alert(
            {"severity": "warning"},
            "1 ModelServers are not ready",
            "For 15m, 1 ModelServers have been Pending, Starting or Degraded instead of Ready; "
            "`kubectl get modelservers -A` lists them.",
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
