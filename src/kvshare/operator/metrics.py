"""The operator's Prometheus metrics, in a registry of their own.

- ``kvshare_operator_reconcile_seconds`` (histogram): one reconcile of one ModelServer,
  from reading the caches to the status written.
- ``kvshare_operator_placements_total{result}``: placement attempts of replicas, by
  ``result`` (``placed``, ``unschedulable``).
- ``kvshare_operator_reconcile_errors_total``: reconciles that failed (and were retried).
- ``kvshare_modelservers{phase}``: ModelServers this operator serves, by phase.

:func:`registry` returns the registry, so the chart's tests can list the real names.
"""

from __future__ import annotations

from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvshare.api.modelserver import Phase
from kvshare.operator.views import ModelServerKey

__all__ = ["OperatorMetrics", "registry"]

PLACEMENT_RESULTS = ("placed", "unschedulable")


class OperatorMetrics:
    """The metric objects, and the phase of each ModelServer behind the phase gauge."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.reconcile_seconds = Histogram(
            "kvshare_operator_reconcile_seconds",
            "Time to reconcile one ModelServer: read, plan, create/delete, write status.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.placements = Counter(
            "kvshare_operator_placements",
            "Placement attempts of ModelServer replicas, by result.",
            ["result"],
            registry=self.registry,
        )
        self.reconcile_errors = Counter(
            "kvshare_operator_reconcile_errors",
            "Reconciles that failed and were retried.",
            registry=self.registry,
        )
        self.modelservers = Gauge(
            "kvshare_modelservers",
            "ModelServers served by this operator, by phase.",
            ["phase"],
            registry=self.registry,
        )
        for result in PLACEMENT_RESULTS:
            self.placements.labels(result=result)
        self._phases: dict[ModelServerKey, str] = {}
        self._publish_phases()

    def set_phase(self, key: ModelServerKey, phase: str) -> None:
        """Record ModelServer ``key``'s current phase."""
        if self._phases.get(key) != phase:
            self._phases[key] = phase
            self._publish_phases()

    def forget(self, key: ModelServerKey) -> None:
        """ModelServer ``key`` is gone."""
        if self._phases.pop(key, None) is not None:
            self._publish_phases()

    def _publish_phases(self) -> None:
        counts = dict.fromkeys(get_args(Phase), 0)
        for phase in self._phases.values():
            counts[phase] = counts.get(phase, 0) + 1
        for phase, count in counts.items():
            self.modelservers.labels(phase=phase).set(count)


_DEFAULT = OperatorMetrics()


def registry() -> CollectorRegistry:
    """The registry the ``kvshare operator`` process exposes on its metrics port."""
    return _DEFAULT.registry


def default_metrics() -> OperatorMetrics:
    """The metrics of the ``kvshare operator`` process."""
    return _DEFAULT
