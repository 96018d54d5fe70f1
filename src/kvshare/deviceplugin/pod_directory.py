"""The broker's pod directory under Kubernetes: what each pod of this node is, and what
it was given, from the two sources that know.

- the API server (the per-node pod watch, :class:`~.cluster.pods.NodePods`): the pod's
  namespace, name, ModelServer label and ``kvshare.io/gpu-memory`` request;
- the kubelet (its PodResources API, :mod:`~.kubelet.pod_resources`): the
  ``kvshare.io/gpu`` slot ids the pod's containers got, hence its GPUs;

and the priority ceiling an administrator granted the pod's namespace. The broker asks
from its loop thread and must not wait: :meth:`KubePodDirectory.grant` answers from
memory and, for a pod it does not know yet, has its own thread (``kvshare-pod-directory``)
look it up and wake the broker when it has. A pod's entry is dropped when the pod watch
reports a change of it, so a label changed later is read again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvshare.api import names
from kvshare.api.priorities import PriorityCeilings
from kvshare.deviceplugin.broker.identity import PodGrant
from kvshare.deviceplugin.cluster.pods import NodePods
from kvshare.deviceplugin.kubelet.pod_resources import PodResourcesClient, PodResourcesError
from kvshare.deviceplugin.kubelet.slots import AllocationError, split_id

__all__ = ["KubePodDirectory"]

log = logging.getLogger(__name__)

#: Least time between two look-ups of one pod that is not known yet.
_RETRY_S = 0.2


class KubePodDirectory:
    """Pods of this node for the broker (see the module doc)."""

    def __init__(
        self,
        pods: NodePods,
        resources: PodResourcesClient,
        ceilings: PriorityCeilings,
        on_change: Callable[[], None],
        node: str,
    ) -> None:
        """``on_change()`` is called (from the directory's thread) when it learnt a pod."""
        self._pods = pods
        self._resources = resources
        self._ceilings = ceilings
        self._on_change = on_change
        self._node = node
        self._lock = threading.Lock()  # guards _grants, _why, _wanted and _tried
        self._grants: dict[str, PodGrant] = {}
        self._why: dict[str, str] = {}
        self._wanted: set[str] = set()
        self._tried: dict[str, float] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- the broker's side (its loop thread) --------------------------------------------

    def grant(self, uid: str) -> PodGrant | None:
        """The pod ``uid`` if known; else None, and it is looked up."""
        with self._lock:
            found = self._grants.get(uid)
            if found is None:
                self._wanted.add(uid)
        if found is None:
            self._wake.set()
        return found

    def unknown(self, uid: str) -> str:
        """Why pod ``uid`` is not known."""
        with self._lock:
            return self._why.get(uid, "the node agent is still looking it up")

    # --- the cluster's side -------------------------------------------------------------

    def forget(self, uid: str) -> None:
        """Pod ``uid`` changed or is gone: read it again when it is next asked about."""
        with self._lock:
            self._grants.pop(uid, None)

    def start(self) -> None:
        """Look pods up on a thread of its own."""
        self._thread = threading.Thread(target=self._run, name="kvshare-pod-directory", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop looking up."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._resources.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(_RETRY_S)
            self._wake.clear()
            now = time.monotonic()
            with self._lock:
                due = [u for u in self._wanted if now - self._tried.get(u, -_RETRY_S) >= _RETRY_S]
                for uid in due:
                    self._tried[uid] = now
            learnt = False
            for uid in due:
                try:
                    found, why = self._look_up(uid)
                except Exception as exc:  # a lookup's failure must not stop the directory
                    log.exception("looking up pod %s failed", uid)
                    found, why = None, f"looking it up failed ({type(exc).__name__})"
                with self._lock:
                    if found is not None:
                        self._grants[uid] = found
                        self._wanted.discard(uid)
                        self._tried.pop(uid, None)
                        self._why.pop(uid, None)
                        learnt = True
                    else:
                        self._why[uid] = why
                        learnt = True
            if learnt:
                self._on_change()
            if due:
                with self._lock:
                    # Pods nobody asks about any more (their hello was refused) are dropped.
                    stale = [u for u, t in self._tried.items() if now - t > 30.0]
                    for uid in stale:
                        self._wanted.discard(uid)
                        self._tried.pop(uid, None)
                        self._why.pop(uid, None)

    def _look_up(self, uid: str) -> tuple[PodGrant | None, str]:
        facts = self._pods.facts(uid)
        if facts is None:
            if not self._pods.listed:
                return None, "the node agent has not listed its node's pods yet"
            return None, f"no pod with this UID runs on node {self._node} (per the API server)"
        try:
            devices = self._resources.devices(facts.namespace, facts.name, (names.RESOURCE_GPU,))
        except PodResourcesError as exc:
            return None, str(exc)
        if devices is None:
            return None, (
                f"the kubelet lists no devices for pod {facts.namespace}/{facts.name} "
                "(its PodResources API)"
            )
        gpus = set()
        for device_id in devices.get(names.RESOURCE_GPU, ()):
            try:
                gpus.add(split_id(device_id)[0])
            except AllocationError:
                continue  # not one of ours
        return (
            PodGrant(
                uid=uid,
                namespace=facts.namespace,
                name=facts.name,
                modelserver=facts.modelserver,
                gpus=frozenset(gpus),
                memory_bytes=facts.gpu_memory_bytes,
                priority_ceiling=self._ceilings.ceiling(facts.namespace),
            ),
            "",
        )
