"""Lease enforcement carried out: what the node agent does with the enforcer's verdicts
(:mod:`kvshare.deviceplugin.broker.enforcement`) after every audit: count them, have the
broker reclaim the excess, and, with a Kubernetes API, warn on the pod and evict it when
it keeps on. Runs on the audit's thread.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvshare.api.quantity import format_bytes_human
from kvshare.deviceplugin.admin.metrics import NodeMetrics
from kvshare.deviceplugin.broker.audit import Finding
from kvshare.deviceplugin.broker.enforcement import LeaseEnforcer, Overuse
from kvshare.deviceplugin.broker.server import Broker
from kvshare.deviceplugin.broker.views import BooksView

__all__ = ["OveruseHandler"]

log = logging.getLogger(__name__)


class OveruseHandler:
    """``on_findings`` of the auditor: judge, reclaim, warn, evict."""

    def __init__(
        self,
        enforcer: LeaseEnforcer,
        broker: Broker,
        metrics: NodeMetrics,
        api_client: Any | None,
        node: str,
    ) -> None:
        self._enforcer = enforcer
        self._broker = broker
        self._metrics = metrics
        self._api = api_client
        self._node = node

    def __call__(self, view: BooksView, findings: Sequence[Finding]) -> None:
        for overuse in self._enforcer.judge(view, findings):
            self._metrics.lease_overused(overuse.pool.gpu, evicted=overuse.evict)
            self._broker.reclaim_overuse(overuse.pool.id, overuse.excess)
            if overuse.first:
                self._warn(overuse)
            if overuse.evict:
                self._evict(overuse)

    def _message(self, overuse: Overuse) -> str:
        pool = overuse.pool
        return (
            f"pool {pool.name} (pid {pool.pid}) holds {format_bytes_human(overuse.device_bytes)} "
            f"of KV memory on GPU {pool.gpu}, {format_bytes_human(overuse.excess)} more than "
            f"its charge and the tolerance ({format_bytes_human(overuse.allowed_bytes)})"
        )

    def _warn(self, overuse: Overuse) -> None:
        message = self._message(overuse) + ": its lease is reclaimed by the excess"
        log.warning("lease overused: %s", message)
        pod = self._pod(overuse)
        if pod is not None and self._api is not None:
            from kvshare.deviceplugin.cluster.pod_actions import post_pod_event

            post_pod_event(self._api, pod, self._node, "KVLeaseOverused", message)

    def _evict(self, overuse: Overuse) -> None:
        message = (
            f"{self._message(overuse)} for {overuse.strikes} audits in a row: evicting the pod"
        )
        log.error("lease overused: %s", message)
        pod = self._pod(overuse)
        if pod is None or self._api is None:
            return
        from kvshare.deviceplugin.cluster.pod_actions import evict_pod, post_pod_event

        post_pod_event(self._api, pod, self._node, "KVLeaseEvicted", message)
        evict_pod(self._api, pod)

    @staticmethod
    def _pod(overuse: Overuse) -> Any | None:
        from kvshare.deviceplugin.cluster.pod_actions import PodRef

        pool = overuse.pool
        if not (pool.namespace and pool.pod and pool.pod_uid):
            return None
        return PodRef(pool.namespace, pool.pod, pool.pod_uid)
