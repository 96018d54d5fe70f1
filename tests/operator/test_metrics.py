"""The operator's per-ModelServer series: one 0/1 phase state set, replicas, ready replicas
and KV memory per ModelServer, in step with the phase counts, and gone with the ModelServer."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvshare.api.modelserver import KVUsage
from kvshare.operator.metrics import PHASES, ModelServerSample, OperatorMetrics
from tests.operator.specs import GIB


def samples(metrics: OperatorMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the registry's exposition, by name and sorted labels."""
    text = generate_latest(metrics.registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def of(metrics: OperatorMetrics, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: value for (n, labels), value in samples(metrics).items() if n == name}


QWEN = (("modelserver", "qwen"), ("namespace", "llm"))
BIG = (("modelserver", "big"), ("namespace", "team-b"))


def test_each_modelserver_has_one_phase_set_and_its_replicas_and_kv() -> None:
    metrics = OperatorMetrics()
    kv = KVUsage(min=8 * GIB, lease=20 * GIB, mapped=12 * GIB, used=6 * GIB)
    metrics.observe(("llm", "qwen"), ModelServerSample("Starting", desired=3, ready=2, kv=kv))
    metrics.observe(("team-b", "big"), ModelServerSample("Unschedulable", desired=1))

    phases = of(metrics, "kvshare_modelserver_status_phase")
    assert phases == {
        **{(*QWEN, ("phase", p)): float(p == "Starting") for p in PHASES},
        **{(*BIG, ("phase", p)): float(p == "Unschedulable") for p in PHASES},
    }
    assert of(metrics, "kvshare_modelserver_replicas") == {QWEN: 3.0, BIG: 1.0}
    assert of(metrics, "kvshare_modelserver_ready_replicas") == {QWEN: 2.0, BIG: 0.0}
    assert of(metrics, "kvshare_modelserver_kv_lease_bytes") == {QWEN: 20 * GIB, BIG: 0.0}
    assert of(metrics, "kvshare_modelserver_kv_used_bytes")[QWEN] == 6 * GIB
    counts = of(metrics, "kvshare_modelservers")
    assert counts[(("phase", "Starting"),)] == 1.0
    assert counts[(("phase", "Unschedulable"),)] == 1.0
    assert sum(counts.values()) == 2.0


def test_kv_pressure_is_demand_over_lease_and_names_a_starved_modelserver() -> None:
    metrics = OperatorMetrics()
    # qwen's workers hold 10 GiB in live blocks and ask for 30 GiB; the brokers lease 20.
    starved = KVUsage(min=8 * GIB, lease=20 * GIB, mapped=20 * GIB, used=10 * GIB, demand=30 * GIB)
    idle = KVUsage(min=4 * GIB, lease=8 * GIB, mapped=8 * GIB, used=2 * GIB, demand=4 * GIB)
    metrics.observe(("llm", "qwen"), ModelServerSample("Ready", desired=2, ready=2, kv=starved))
    metrics.observe(("team-b", "big"), ModelServerSample("Ready", desired=1, ready=1, kv=idle))
    assert of(metrics, "kvshare_modelserver_kv_demand_bytes") == {QWEN: 30 * GIB, BIG: 4 * GIB}
    assert of(metrics, "kvshare_modelserver_kv_pressure_ratio") == {QWEN: 1.5, BIG: 0.5}
    assert KVUsage().pressure() == 0.0


def test_a_new_phase_moves_the_one_and_a_failed_reconcile_keeps_the_counts() -> None:
    metrics = OperatorMetrics()
    metrics.observe(("llm", "qwen"), ModelServerSample("Starting", desired=2, ready=1))
    metrics.observe(("llm", "qwen"), ModelServerSample("Ready", desired=2, ready=2))
    phases = of(metrics, "kvshare_modelserver_status_phase")
    assert [dict(labels)["phase"] for labels, value in phases.items() if value] == ["Ready"]
    metrics.set_phase(("llm", "qwen"), "Degraded")
    assert of(metrics, "kvshare_modelserver_ready_replicas") == {QWEN: 2.0}
    assert of(metrics, "kvshare_modelservers")[(("phase", "Degraded"),)] == 1.0


def test_a_deleted_modelservers_series_go_with_it() -> None:
    metrics = OperatorMetrics()
    metrics.observe(("llm", "qwen"), ModelServerSample("Ready", desired=1, ready=1))
    metrics.observe(("team-b", "big"), ModelServerSample("Unschedulable", desired=1))
    metrics.forget(("llm", "qwen"))
    left = {name for name, labels in samples(metrics) if ("modelserver", "qwen") in labels}
    assert left == set()
    assert of(metrics, "kvshare_modelserver_replicas") == {BIG: 1.0}
    assert sum(of(metrics, "kvshare_modelservers").values()) == 1.0


def test_with_no_modelservers_only_the_zero_counts_are_exported() -> None:
    """A standby replica (or a fresh operator) names the families but has no series."""
    metrics = OperatorMetrics()
    text = generate_latest(metrics.registry).decode()
    assert "# TYPE kvshare_modelserver_status_phase gauge" in text
    assert of(metrics, "kvshare_modelserver_status_phase") == {}
    assert of(metrics, "kvshare_modelservers") == {(("phase", p),): 0.0 for p in PHASES}
