"""The node agent's Prometheus metrics and its ``:9400`` endpoint (``/metrics``,
``/healthz``, ``/readyz``).

Gauges per GPU and per pool are read from the broker's books at scrape time (so a pool
that left disappears from the next scrape); counters and histograms are counted as
events happen. Per-pool series carry the labels ``namespace``, ``pod``, ``modelserver``,
``gpu``, ``rank`` and ``pool`` (the broker's name for it, unique on its GPU).

What a pool sends cannot break or inflate the exposition: label values come only from
identities the wire codec has validated, counters are labelled by inventoried GPUs and
fixed reasons (never by a pool or a name a peer chose), so the series are bounded by the
pools present and the GPUs of the node. A scrape that fails anyway answers 500 with the
reason and makes ``/readyz`` fail too.
:func:`registry` builds the full set without a running agent, for tools that list the
metric names (the Helm chart's alert rules and dashboard are checked against it).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from kvshare.deviceplugin.broker.books import BrokerEvents, PoolRecord
from kvshare.deviceplugin.broker.views import BooksView, GpuView, PoolView

__all__ = ["MetricsServer", "NodeMetrics", "markdown_table", "metric_names", "registry"]

log = logging.getLogger(__name__)

POOL_LABELS = ("namespace", "pod", "modelserver", "gpu", "rank", "pool")
GPU_LABELS = ("gpu", "index")
#: The pool's page layout: what one page holds and, for per-layer pages, why.
LAYOUT_INFO = "kvshare_pool_kv_layout_info"
LAYOUT_LABELS = (*POOL_LABELS, "layout", "reason")

#: Per-GPU gauges: name -> (help, value from the view).
_GPU_GAUGES: dict[str, tuple[str, Callable[[GpuView], float]]] = {
    "kvshare_gpu_memory_total_bytes": ("Device memory of the GPU.", lambda g: g.total),
    "kvshare_gpu_memory_free_bytes": (
        "Memory placement may still commit: total - headroom - static - kv min.",
        lambda g: g.free,
    ),
    "kvshare_gpu_memory_headroom_bytes": (
        "Memory the node agent keeps back from every budget.",
        lambda g: g.headroom,
    ),
    "kvshare_gpu_memory_static_bytes": (
        "Static footprints (weights, activations, context) of the pools on the GPU.",
        lambda g: g.static,
    ),
    "kvshare_gpu_kv_min_bytes": ("Guaranteed KV minimums committed.", lambda g: g.kv_min),
    "kvshare_gpu_kv_lease_bytes": ("KV leases granted.", lambda g: g.kv_lease),
    "kvshare_gpu_kv_mapped_bytes": ("KV memory mapped by the pools.", lambda g: g.kv_mapped),
    "kvshare_gpu_kv_used_bytes": ("KV memory holding live blocks.", lambda g: g.kv_used),
    "kvshare_gpu_kv_unleased_bytes": (
        "Budget not leased to any pool: grantable without a reclaim.",
        lambda g: g.unleased,
    ),
    "kvshare_gpu_kv_overcommitted_bytes": (
        "KV charges beyond the budget: above 0 after a restart with a smaller budget (raised "
        "headroom, a smaller configuration, a GPU reported smaller) until the reclaims that "
        "follow are released.",
        lambda g: g.overcommitted,
    ),
    "kvshare_gpu_kv_min_shortfall_bytes": (
        "Guaranteed KV minimums beyond the budget: above 0 the budget cannot be reached "
        "and the minimums are not all guaranteed.",
        lambda g: g.min_shortfall,
    ),
    "kvshare_gpu_pools_sized_larger": (
        "Pools whose KV caches were sized for more memory than the GPU reports now.",
        lambda g: g.pools_sized_larger,
    ),
    "kvshare_gpu_pools": ("KV pools on the GPU.", lambda g: g.pools),
    "kvshare_gpu_healthy": ("1 when the GPU is healthy.", lambda g: g.healthy),
    "kvshare_gpu_draining": ("1 while the GPU is being drained.", lambda g: g.draining),
    "kvshare_gpu_startup_queue": (
        "Engines waiting for the GPU's start-up turn.",
        lambda g: g.turn_waiting,
    ),
}

#: Per-pool gauges: name -> (help, value from the view, or None to skip the sample).
_POOL_GAUGES: dict[str, tuple[str, Callable[[PoolView], float | None]]] = {
    "kvshare_pool_kv_lease_bytes": ("KV bytes the pool may hold now.", lambda p: p.lease),
    "kvshare_pool_kv_min_bytes": ("KV bytes guaranteed to the pool.", lambda p: p.kv_min),
    "kvshare_pool_kv_max_bytes": ("Cap on the pool's KV bytes (when set).", lambda p: p.kv_max),
    "kvshare_pool_kv_mapped_bytes": ("KV bytes physically mapped.", lambda p: p.mapped),
    "kvshare_pool_kv_used_bytes": ("KV bytes holding live blocks.", lambda p: p.used),
    "kvshare_pool_kv_cached_bytes": (
        "KV bytes held only as prefix cache (evicted first on reclaim).",
        lambda p: p.cached,
    ),
    "kvshare_pool_kv_page_bytes": (
        "Physical bytes the pool maps and unmaps at a time (one logical page): its unit of "
        "growth and shrinking (0 until it reports).",
        lambda p: p.page_bytes,
    ),
    "kvshare_pool_kv_reserved_bytes": (
        "Physical pages created ahead of demand, not mapped.",
        lambda p: p.reserved,
    ),
    "kvshare_pool_kv_charged_bytes": (
        "KV bytes the broker counts as taken (lease, min, or memory being reclaimed).",
        lambda p: p.charged,
    ),
    "kvshare_pool_static_bytes": ("Static footprint the pool declared.", lambda p: p.static),
    "kvshare_pool_device_bytes": (
        "KV memory the device shows for the pool's process (audit).",
        lambda p: p.device_bytes,
    ),
    "kvshare_pool_priority": ("Reclaim priority of the pool.", lambda p: p.priority),
    "kvshare_pool_over_lease": (
        "1 when the device shows more than the pool may hold plus one page (audit): its "
        "charge (lease and memory a reclaim asked back) while the reclaim is within its "
        "deadline, its lease after that.",
        lambda p: p.over_lease,
    ),
    "kvshare_pool_reclaim_pending": (
        "1 while a reclaim sent to the pool is unacknowledged.",
        lambda p: p.reclaim_target is not None,
    ),
    "kvshare_pool_reclaim_overdue": (
        "1 when the pool missed a reclaim deadline and still holds the memory.",
        lambda p: p.reclaim_overdue,
    ),
}


def _pool_labels(pool: PoolView) -> tuple[str, ...]:
    return (pool.namespace, pool.pod, pool.modelserver, pool.gpu, str(pool.rank), pool.name)


class _BooksCollector(Collector):
    """Per-GPU and per-pool gauges, read from the books at scrape time."""

    def __init__(self, source: Callable[[], BooksView | None]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        view = self._source()
        for name, (text, value) in _GPU_GAUGES.items():
            family = GaugeMetricFamily(name, text, labels=GPU_LABELS)
            for gpu in view.gpus if view else ():
                family.add_metric((gpu.uuid, str(gpu.index)), float(value(gpu)))
            yield family
        for name, (text, pool_value) in _POOL_GAUGES.items():
            family = GaugeMetricFamily(name, text, labels=POOL_LABELS)
            for pool in view.pools if view else ():
                sample = pool_value(pool)
                if sample is not None:
                    family.add_metric(_pool_labels(pool), float(sample))
            yield family
        layouts = GaugeMetricFamily(
            LAYOUT_INFO,
            "1 for the pool's page layout (block-outer: a page holds whole blocks of every "
            "layer; per-layer: a granule of every layer) and why it keeps per-layer pages "
            "(setting, engine-setting, backend, model, connector, engine).",
            labels=LAYOUT_LABELS,
        )
        for pool in view.pools if view else ():
            if pool.layout:
                layouts.add_metric((*_pool_labels(pool), pool.layout, pool.layout_reason), 1.0)
        yield layouts
        recovering = GaugeMetricFamily(
            "kvshare_broker_recovering",
            "1 while a restarted broker waits for pools to re-declare.",
        )
        recovering.add_metric((), float(bool(view and view.recovering)))
        yield recovering


class NodeMetrics(BrokerEvents):
    """Every metric of the node agent, in its own registry; also the broker's event sink."""

    def __init__(self, source: Callable[[], BooksView | None] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._source = source
        #: Family name -> label names of the event metrics (for the table in docs/metrics.md).
        self.labelnames: dict[str, tuple[str, ...]] = {}
        self.grants = self._counter(
            "kvshare_broker_grants", "Lease grants (each Want or serve that grew a lease).", "gpu"
        )
        self.granted_bytes = self._counter(
            "kvshare_broker_granted_bytes", "Bytes of lease granted.", "gpu"
        )
        self.denials = self._counter(
            "kvshare_broker_denials",
            "Wants that got nothing right away, by reason (full, waiting, max, draining, "
            "reclaiming, recovering, unhealthy).",
            "gpu",
            "reason",
        )
        self.reclaims = self._counter("kvshare_broker_reclaims", "Reclaims sent to pools.", "gpu")
        self.reclaim_seconds = self._histogram(
            "kvshare_broker_reclaim_seconds",
            "Time from a reclaim to the pool's acknowledgement that it released the memory.",
            (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            "gpu",
        )
        self.deadline_missed = self._counter(
            "kvshare_broker_reclaim_deadline_missed",
            "Reclaims whose pool did not release the memory by the deadline (the pool: "
            "kvshare_pool_reclaim_overdue).",
            "gpu",
        )
        self.reclaims_ungranted = self._counter(
            "kvshare_broker_reclaims_ungranted",
            "Reclaims made for waiting pools that ended (released or called off) with no "
            "other pool granted memory since: at most one per pool per reclaim deadline.",
            "gpu",
        )
        self.admissions = self._counter(
            "kvshare_broker_admissions",
            "Pool hellos by result (admitted, resumed, or the refusal reason).",
            "gpu",
            "result",
        )
        self.departures = self._counter(
            "kvshare_broker_departures",
            "Pools that left, by how (bye, process exited, connection closed).",
            "gpu",
            "reason",
        )
        self.protocol_errors = self._counter(
            "kvshare_broker_protocol_errors",
            "Connections closed for breaking the protocol, by kind (frame, json, message, "
            "identity).",
            "kind",
        )
        self.trust_refusals = self._counter(
            "kvshare_broker_trust_refusals",
            "Connections refused for who they are or what they would hold, by reason: no-pod "
            "(the process runs in no pod of this node), pod-uid (another pod's UID, or none), "
            "unknown-pod, names (namespace, pod or ModelServer not the pod's), gpu (not one "
            "of the pod's slots), memory (beyond the pod's kvshare.io/gpu-memory request), "
            "limit (connections), pool-limit, deadline (no first message in time), admin (an "
            "admin request from outside the agent's container).",
            "reason",
        )
        self.lease_overuse = self._counter(
            "kvshare_broker_lease_overuse",
            "Audits that found a pool's process holding more device memory than its charge "
            "plus the tolerance (NVML), by action: reclaim (the excess is reclaimed) or evict "
            "(it kept on; the pod is evicted).",
            "gpu",
            "action",
        )
        self.plugin_registered = Gauge(
            "kvshare_deviceplugin_registered",
            "1 while the resource is registered with the kubelet.",
            ("resource",),
            registry=self.registry,
        )
        self.labelnames["kvshare_deviceplugin_registered"] = ("resource",)
        self.plugin_registrations = self._counter(
            "kvshare_deviceplugin_registrations",
            "Registrations with the kubelet, by result.",
            "resource",
            "result",
        )
        self.allocations = self._counter(
            "kvshare_deviceplugin_allocations", "Allocate calls by result.", "resource", "result"
        )
        self.allocate_seconds = self._histogram(
            "kvshare_deviceplugin_allocate_seconds",
            "Time to answer an Allocate call.",
            (0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 1),
            "resource",
        )
        self.device_plugin_conflict = Gauge(
            "kvshare_node_device_plugin_conflict",
            "GPUs (or slices) another device plugin advertises on this node for the GPUs "
            "kvshare serves, by resource (e.g. nvidia.com/gpu): above 0 they are handed "
            "out twice.",
            ("resource",),
            registry=self.registry,
        )
        self.labelnames["kvshare_node_device_plugin_conflict"] = ("resource",)
        self._conflicting: set[str] = set()  # resources the gauge has a series for
        self.kvsharenode_writes = self._counter(
            "kvshare_kvsharenode_writes",
            "KVShareNode writes to the Kubernetes API, by result.",
            "result",
        )
        self.registry.register(_BooksCollector(self._view))
        self._grant_children: dict[str, tuple[Any, Any]] = {}
        self._gpus: frozenset[str] = frozenset()

    def _counter(self, name: str, documentation: str, *labels: str) -> Counter:
        self.labelnames[name] = labels
        return Counter(name, documentation, labels, registry=self.registry)

    def _histogram(
        self, name: str, documentation: str, buckets: tuple[float, ...], *labels: str
    ) -> Histogram:
        self.labelnames[name] = labels
        return Histogram(name, documentation, labels, buckets=buckets, registry=self.registry)

    def set_device_plugin_conflict(self, found: Mapping[str, int]) -> None:
        """Set the conflict gauge: ``found`` maps resources to their count (0 elsewhere)."""
        self._conflicting |= {"nvidia.com/gpu", *found}
        for resource in self._conflicting:
            self.device_plugin_conflict.labels(resource).set(found.get(resource, 0))

    def set_source(self, source: Callable[[], BooksView | None], gpus: Iterable[str]) -> None:
        """Where the per-GPU and per-pool gauges come from (the broker's view), and the
        UUIDs of the node's GPUs: the only values the ``gpu`` label of a counter takes."""
        self._source = source
        self._gpus = frozenset(gpus)

    def _view(self) -> BooksView | None:
        return self._source() if self._source is not None else None

    # --- BrokerEvents -------------------------------------------------------------------

    def granted(self, gpu: str, nbytes: int) -> None:
        """Count a grant (on the broker's hot path: the labelled children are cached)."""
        children = self._grant_children.get(gpu)
        if children is None:
            children = self._grant_children[gpu] = (
                self.grants.labels(gpu),
                self.granted_bytes.labels(gpu),
            )
        children[0].inc()
        children[1].inc(nbytes)

    def denied(self, gpu: str, reason: str) -> None:
        """Count a denial."""
        self.denials.labels(gpu, reason).inc()

    def reclaim_issued(self, gpu: str) -> None:
        """Count a reclaim."""
        self.reclaims.labels(gpu).inc()

    def reclaim_completed(self, gpu: str, seconds: float) -> None:
        """Observe how long a reclaim took."""
        self.reclaim_seconds.labels(gpu).observe(seconds)

    def reclaim_overdue(self, pool: PoolRecord) -> None:
        """Count a missed deadline (per GPU: a pool's own series would outlive it)."""
        self.deadline_missed.labels(pool.gpu).inc()

    def reclaim_ungranted(self, gpu: str) -> None:
        """Count a reclaim for waiters that granted nothing."""
        self.reclaims_ungranted.labels(gpu).inc()

    def admitted(self, gpu: str, resumed: bool) -> None:
        """Count an admission."""
        self.admissions.labels(gpu, "resumed" if resumed else "admitted").inc()

    def refused(self, gpu: str, reason: str) -> None:
        """Count a refusal; a GPU this node does not have is counted as ``gpu=""``."""
        self.admissions.labels(gpu if gpu in self._gpus else "", f"refused-{reason}").inc()

    def removed(self, gpu: str, why: str) -> None:
        """Count a departure."""
        self.departures.labels(gpu, why).inc()

    def protocol_error(self, kind: str) -> None:
        """Count a connection closed for a protocol error of ``kind`` (a fixed set)."""
        self.protocol_errors.labels(kind).inc()

    def lease_overused(self, gpu: str, *, evicted: bool) -> None:
        """Count an audit that found a pool over its charge (and whether it is evicted)."""
        self.lease_overuse.labels(gpu, "evict" if evicted else "reclaim").inc()

    def trust_refused(self, reason: str) -> None:
        """Count a connection refused by a check of its pod or its limits (a fixed set)."""
        self.trust_refusals.labels(reason).inc()


def registry() -> CollectorRegistry:
    """A registry holding every node-agent metric (no agent needed), to list their names."""
    return NodeMetrics().registry


def metric_names() -> list[str]:
    """Names of every node-agent metric family, as Prometheus exposes them."""
    names = []
    for family in registry().collect():
        suffix = "_total" if family.type == "counter" else ""
        names.append(family.name + suffix)
    return sorted(names)


def markdown_table() -> str:
    """The table of node-agent metrics in docs/metrics.md, generated from the registry."""
    metrics = NodeMetrics()
    labels = {
        **metrics.labelnames,
        **dict.fromkeys(_GPU_GAUGES, GPU_LABELS),
        **dict.fromkeys(_POOL_GAUGES, POOL_LABELS),
        LAYOUT_INFO: LAYOUT_LABELS,
    }
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for family in metrics.registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        shown = ", ".join(labels.get(family.name, ())) or "-"
        rows.append(f"| `{name}` | {family.type} | {shown} | {family.documentation} |")
    return "\n".join(rows)


Check = Callable[[], tuple[bool, str]]


class MetricsServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` over HTTP on its own threads."""

    def __init__(self, host: str, port: int, metrics: NodeMetrics, healthy: Check, ready: Check):
        handler = _handler(metrics.registry, healthy, ready)
        try:
            self._server = _Server((host, port), handler)
        except OSError as exc:
            raise OSError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror} (choose another "
                "--metrics-address)"
            ) from None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        return int(self._server.server_address[1])

    def start(self) -> None:
        """Serve until :meth:`stop`."""
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kvshare-metrics", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # Connections the kernel queues while the agent cannot accept them (stopped, busy).
    # The default 5 is soon full: a probe beyond it has its connection attempts dropped
    # and retried only after 1, 3, 7 ... s, so it answers seconds after the agent runs again.
    request_queue_size = 128

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A scraper that hung up before its answer was written is not the agent's
        # fault; anything else is logged once, through logging (not printed to stderr).
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        log.exception("metrics: error answering %s", client_address)


def _render(registry: CollectorRegistry) -> tuple[bytes | None, str]:
    """The exposition, or ``None`` and why it cannot be made."""
    try:
        return generate_latest(registry), ""
    except Exception as exc:
        log.exception("metrics: cannot render the exposition")
        return None, f"metrics exporter cannot serve: {type(exc).__name__}: {exc}"


def _handler(registry: CollectorRegistry, healthy: Check, ready: Check) -> type[Any]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                body, problem = _render(registry)
                if body is None:
                    self._reply(500, problem.encode(errors="replace") + b"\n", "text/plain")
                else:
                    self._reply(200, body, CONTENT_TYPE_LATEST)
            elif path in ("/healthz", "/readyz"):
                ok, detail = (healthy if path == "/healthz" else ready)()
                if ok and path == "/readyz":
                    # Ready means Prometheus can read the node too.
                    body, problem = _render(registry)
                    ok, detail = body is not None, problem or detail
                text = (detail or ("ok" if ok else "not ok")).encode(errors="replace") + b"\n"
                self._reply(200 if ok else 503, text, "text/plain; charset=utf-8")
            else:
                self._reply(404, b"not found: try /metrics, /healthz or /readyz\n", "text/plain")

        def _reply(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("metrics: " + format, *args)

    return Handler
