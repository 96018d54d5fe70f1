"""The operator's Prometheus metrics, in a registry of their own.

Operator-wide:

- ``kvshare_operator_reconcile_seconds`` (histogram): one reconcile of one ModelServer,
  from reading the caches to the status written.
- ``kvshare_operator_placements_total{result}``: placement attempts of replicas, by
  ``result`` (``placed``, ``unschedulable``).
- ``kvshare_operator_reconcile_errors_total``: reconciles that failed (and were retried).
- ``kvshare_modelservers{phase}``: ModelServers this operator serves, by phase.

Per ModelServer, in the style of kube-state-metrics (labels ``namespace`` and
``modelserver``; the series go when the ModelServer does), so alerts and panels can name it:

- ``kvshare_modelserver_status_phase{phase}``: 1 for the current phase, 0 for the others;
- ``kvshare_modelserver_replicas``: replicas the spec asks for;
- ``kvshare_modelserver_ready_replicas``: replicas whose engine answers its health check;
- ``kvshare_modelserver_kv_{min,lease,mapped,used,demand}_bytes``: KV memory over its
  workers, as the node agents report it (the status's ``kv``);
- ``kvshare_modelserver_kv_pressure_ratio``: demand over lease, the KV-pressure signal
  the autoscaling examples (``examples/autoscaling/``) scale on.

Only the active operator replica reconciles, so a standby one exports no per-ModelServer
series and zeros for ``kvshare_modelservers``.

:func:`registry` returns the registry, so the chart's tests can list the real names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvshare.api.modelserver import KVUsage, Phase
from kvshare.operator.views import ModelServerKey

__all__ = ["ModelServerSample", "OperatorMetrics", "default_metrics", "registry"]

PLACEMENT_RESULTS = ("placed", "unschedulable")
PHASES: tuple[str, ...] = get_args(Phase)
_MODELSERVER_LABELS = ("namespace", "modelserver")


@dataclass(frozen=True)
class ModelServerSample:
    """What the per-ModelServer series say about one ModelServer."""

    phase: str
    desired: int = 0
    ready: int = 0
    kv: KVUsage = field(default_factory=KVUsage)


#: Per-ModelServer gauges: name -> (help, value of the sample).
_GAUGES: dict[str, tuple[str, Callable[[ModelServerSample], float]]] = {
    "kvshare_modelserver_replicas": (
        "Replicas the ModelServer's spec asks for.",
        lambda s: s.desired,
    ),
    "kvshare_modelserver_ready_replicas": (
        "Replicas of the ModelServer whose engine answers its health check.",
        lambda s: s.ready,
    ),
    "kvshare_modelserver_kv_min_bytes": (
        "KV memory guaranteed to the ModelServer's workers (sum of their minimums).",
        lambda s: s.kv.min,
    ),
    "kvshare_modelserver_kv_lease_bytes": (
        "KV memory the node brokers currently lease to the ModelServer's workers.",
        lambda s: s.kv.lease,
    ),
    "kvshare_modelserver_kv_mapped_bytes": (
        "KV memory the ModelServer's workers have mapped.",
        lambda s: s.kv.mapped,
    ),
    "kvshare_modelserver_kv_used_bytes": (
        "KV memory holding live blocks of the ModelServer's workers.",
        lambda s: s.kv.used,
    ),
    "kvshare_modelserver_kv_demand_bytes": (
        "KV memory the ModelServer's workers need: what each asks for or holds in live "
        "blocks, whichever is more.",
        lambda s: s.kv.demand,
    ),
    "kvshare_modelserver_kv_pressure_ratio": (
        "KV demand over KV lease of the ModelServer's workers: near 1 their caches are "
        "full, above 1 they wait for memory the brokers cannot lend (scale out on it).",
        lambda s: s.kv.pressure(),
    ),
}


class _ModelServerCollector(Collector):
    """The phase counts and the per-ModelServer series, from the last sample of each.

    Samples are written by reconciles on the event loop's thread and read at scrape time
    by the metrics endpoint, which runs on the same loop: no lock is needed.
    """

    def __init__(self) -> None:
        self.samples: dict[ModelServerKey, ModelServerSample] = {}

    def describe(self) -> Iterator[Metric]:
        # The names, even with no ModelServer yet (registration checks them for clashes).
        return self._families({})

    def collect(self) -> Iterator[Metric]:
        return self._families(dict(self.samples))

    @staticmethod
    def _families(samples: dict[ModelServerKey, ModelServerSample]) -> Iterator[Metric]:
        counts = GaugeMetricFamily(
            "kvshare_modelservers",
            "ModelServers served by this operator, by phase.",
            labels=("phase",),
        )
        for phase in PHASES:
            counts.add_metric((phase,), sum(s.phase == phase for s in samples.values()))
        yield counts
        phases = GaugeMetricFamily(
            "kvshare_modelserver_status_phase",
            "1 for the ModelServer's current phase, 0 for the other phases.",
            labels=(*_MODELSERVER_LABELS, "phase"),
        )
        for (namespace, name), sample in sorted(samples.items()):
            for phase in PHASES:
                phases.add_metric((namespace, name, phase), float(sample.phase == phase))
        yield phases
        for metric, (text, value) in _GAUGES.items():
            family = GaugeMetricFamily(metric, text, labels=_MODELSERVER_LABELS)
            for key, sample in sorted(samples.items()):
                family.add_metric(key, float(value(sample)))
            yield family


class OperatorMetrics:
    """The metric objects, and the last sample of each ModelServer behind the gauges."""

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
        for result in PLACEMENT_RESULTS:
            self.placements.labels(result=result)
        self._modelservers = _ModelServerCollector()
        self.registry.register(self._modelservers)

    def observe(self, key: ModelServerKey, sample: ModelServerSample) -> None:
        """Record ModelServer ``key`` as its latest status shows it."""
        self._modelservers.samples[key] = sample

    def set_phase(self, key: ModelServerKey, phase: str) -> None:
        """Record a new phase of ModelServer ``key``, keeping the rest of its sample."""
        previous = self._modelservers.samples.get(key)
        self.observe(key, replace(previous, phase=phase) if previous else ModelServerSample(phase))

    def forget(self, key: ModelServerKey) -> None:
        """ModelServer ``key`` is gone: its series go with it."""
        self._modelservers.samples.pop(key, None)


_DEFAULT = OperatorMetrics()


def registry() -> CollectorRegistry:
    """The registry the ``kvshare operator`` process exposes on its metrics port."""
    return _DEFAULT.registry


def default_metrics() -> OperatorMetrics:
    """The metrics of the ``kvshare operator`` process."""
    return _DEFAULT
