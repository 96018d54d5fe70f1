"""What the node agent learns from its Node object: its labels (which configuration it
runs, see :mod:`.node_config`) and whether another device plugin hands out its GPUs.

On nodes where NVIDIA's GPU Operator (or NVIDIA's device plugin alone) also runs its
device plugin, the Node advertises ``nvidia.com/gpu`` (or MIG slices, or shared
``nvidia.com/gpu.shared`` replicas) for the same GPUs kvshare serves: a pod asking for
``nvidia.com/gpu`` would get a GPU kvshare's broker lends to others, and neither would
know. :func:`device_plugin_conflict` tells it from the Node's allocatable;
:class:`NodeChecks` reports it as the KVShareNode's ``NvidiaDevicePluginConflict``
condition, a Warning Event on the Node and the ``kvshare_node_device_plugin_conflict``
gauge, at start and then every ``interval_s`` (the other plugin may start later). The
fix is on the cluster side (docs: "Beside NVIDIA's GPU Operator"): keep NVIDIA's device
plugin off the nodes kvshare serves, and its driver, toolkit and feature discovery on.
"""

from __future__ import annotations

import datetime
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvshare.api.kube import Condition
from kvshare.api.quantity import QuantityError, parse_quantity

__all__ = ["NodeChecks", "NodeFacts", "device_plugin_conflict", "post_node_event", "read_node"]

log = logging.getLogger(__name__)

#: Resources NVIDIA's device plugin advertises: whole GPUs, time-sliced or MPS replicas,
#: and MIG slices in the "mixed" strategy.
_NVIDIA_RESOURCES = re.compile(r"^nvidia\.com/(gpu|gpu\.shared|mig-[0-9a-z.]+)$")
CONFLICT_CONDITION = "NvidiaDevicePluginConflict"
_COMPONENT = "kvshare-node-agent"
#: Seconds (connect, read) a read of the Node may take: the agent starts without it.
_TIMEOUT = (5.0, 10.0)


@dataclass(frozen=True)
class NodeFacts:
    """The parts of the Node object the agent acts on."""

    name: str
    uid: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    allocatable: Mapping[str, str] = field(default_factory=dict)


def read_node(api_client: Any, name: str) -> NodeFacts | None:
    """The Node ``name`` from the API, or ``None`` (logged) when it cannot be read."""
    from kubernetes import client

    try:
        node = client.CoreV1Api(api_client).read_node(name, _request_timeout=_TIMEOUT)
    except Exception as exc:  # the API being away must never stop the agent
        log.warning("cannot read Node %s (%s): node checks and labels are skipped", name, exc)
        return None
    meta, status = node.metadata, node.status
    allocatable = (status.allocatable if status else None) or {}
    return NodeFacts(
        name=name,
        uid=str(meta.uid or "") if meta else "",
        labels=dict(meta.labels or {}) if meta else {},
        allocatable={k: str(v) for k, v in allocatable.items()},
    )


def post_node_event(api_client: Any, facts: NodeFacts, reason: str, message: str) -> None:
    """A Warning Event about the Node (``kubectl describe node`` shows it); logged on failure."""
    from kubernetes import client

    now = _now()
    body: Any = {
        "apiVersion": "v1",
        "kind": "Event",
        # Named as client-go's event recorder names them: the object, then the time.
        "metadata": {"name": f"{facts.name}.{time.time_ns():x}", "namespace": "default"},
        "involvedObject": {
            "apiVersion": "v1",
            "kind": "Node",
            "name": facts.name,
            "uid": facts.uid,
        },
        "reason": reason,
        "message": message[:1024],
        "type": "Warning",
        "source": {"component": _COMPONENT, "host": facts.name},
        "reportingComponent": _COMPONENT,
        "reportingInstance": facts.name,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    try:
        client.CoreV1Api(api_client).create_namespaced_event(
            "default", body, _request_timeout=_TIMEOUT
        )
    except Exception as exc:  # an Event is best effort
        log.warning("cannot post Event %s about Node %s: %s", reason, facts.name, exc)


def device_plugin_conflict(allocatable: Mapping[str, str], gpus: int) -> dict[str, int]:
    """NVIDIA device-plugin resources the Node advertises while kvshare serves ``gpus``
    GPUs on it: resource -> count (empty: no conflict)."""
    if gpus <= 0:
        return {}
    found = {}
    for resource, amount in allocatable.items():
        if not _NVIDIA_RESOURCES.match(resource):
            continue
        try:
            count = int(parse_quantity(amount))
        except QuantityError:
            continue
        if count > 0:
            found[resource] = count
    return found


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _conflict_message(found: Mapping[str, int], gpus: int) -> str:
    listed = ", ".join(f"{resource}: {count}" for resource, count in sorted(found.items()))
    return (
        f"the Node also advertises {listed} for the {gpus} GPU(s) kvshare serves here: a pod "
        "asking for it gets a GPU kvshare lends to other pods. Keep NVIDIA's device plugin off "
        "this node (label it nvidia.com/gpu.deploy.device-plugin=false under the GPU "
        "Operator) or keep kvshare's node agent off it"
    )


class NodeChecks:
    """Checks the Node for a device-plugin conflict and reports what it finds.

    ``post_event(facts, reason, message)`` posts a Warning about the Node;
    ``set_gauge(found)`` sets the metric; ``warnings`` (reason, message) are posted once,
    with the first check that reads the Node. :meth:`conditions` is read by the
    KVShareNode publisher.
    """

    def __init__(
        self,
        read: Callable[[], NodeFacts | None],
        gpus: Callable[[], int],
        post_event: Callable[[NodeFacts, str, str], None],
        set_gauge: Callable[[Mapping[str, int]], None],
        *,
        interval_s: float = 300.0,
        warnings: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self._warnings = warnings
        self._read = read
        self._gpus = gpus
        self._post_event = post_event
        self._set_gauge = set_gauge
        self._interval = interval_s
        self._lock = threading.Lock()  # guards _condition
        self._condition: Condition | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Check now and every ``interval_s``, on a thread (``kvshare-node-checks``)."""
        self._thread = threading.Thread(target=self._run, name="kvshare-node-checks", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def conditions(self) -> list[Condition]:
        """The KVShareNode conditions from the last check."""
        with self._lock:
            return [self._condition] if self._condition is not None else []

    def check(self) -> None:
        """Read the Node and report a conflict when one appears (an Event when it starts)."""
        facts = self._read()
        if facts is None:
            return
        warnings, self._warnings = self._warnings, ()
        for reason, message in warnings:
            self._post_event(facts, reason, message)
        gpus = self._gpus()
        found = device_plugin_conflict(facts.allocatable, gpus)
        status = "True" if found else "False"
        message = _conflict_message(found, gpus) if found else "no other device plugin here"
        with self._lock:
            before = self._condition
            if before is None or (before.status, before.message) != (status, message):
                since = before.last_transition_time if before and before.status == status else None
                self._condition = Condition(
                    type=CONFLICT_CONDITION,
                    status=status,
                    reason="NvidiaDevicePlugin" if found else "NoConflict",
                    message=message,
                    last_transition_time=since or _now(),
                )
        self._set_gauge(found)
        if found and (before is None or before.status != "True"):
            log.error("GPUs handed out twice on %s: %s", facts.name, message)
            self._post_event(facts, CONFLICT_CONDITION, message)

    def _run(self) -> None:
        self.check()
        while not self._stop.wait(self._interval):
            self.check()
