"""Every setting of the operator, in one place: the command line, and kopf's settings.

:class:`OperatorConfig` is what ``kvshare operator``'s flags (and ``KVSHARE_IMAGE``) say;
:func:`configure_kopf` turns it into kopf's :class:`kopf.OperatorSettings`.

Peering: kopf pauses an operator while a peer with a higher priority is alive, and pauses
*all* peers of equal priority. So each replica gets a distinct priority from its start
time unless ``--priority`` is given: the oldest replica acts, the newer ones stand by,
and one takes over when the active one exits (at once) or stops renewing its entry
(after ``--peering-lifetime`` seconds). The identity defaults to the host name, which in
a cluster is the pod name: a restarted container keeps it, and so never waits for its
own stale entry to expire.
"""

from __future__ import annotations

import logging
import random
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvshare.api import names
from kvshare.api.priorities import PriorityCeilings
from kvshare.operator.backoff import BackoffPolicy
from kvshare.operator.render import RuntimeImage

if TYPE_CHECKING:
    import kopf

__all__ = ["OperatorConfig", "configure_kopf", "default_identity", "start_time_priority"]


def start_time_priority() -> int:
    """A priority that ranks operators started earlier higher, with a random tiebreak."""
    return -(int(time.time() * 1000) * 1000 + random.randrange(1000))


def default_identity() -> str:
    """The peering identity: the host name (the pod name inside a cluster)."""
    return socket.gethostname()


@dataclass(frozen=True)
class OperatorConfig:
    """What the operator was told to do."""

    runtime: RuntimeImage
    """The kvshare image injected into model-server pods."""
    kubeconfig: str | None = None
    context: str | None = None
    namespaces: tuple[str, ...] = ()
    """Namespaces whose ModelServers are served; empty means all."""
    peering: str | None = names.PEERING_NAME
    """The (Cluster)KopfPeering to elect through; ``None`` runs standalone."""
    identity: str = field(default_factory=default_identity)
    priority: int = field(default_factory=start_time_priority)
    peering_lifetime: int = 60
    """Seconds a silent peer is still considered alive."""
    metrics_port: int = names.OPERATOR_METRICS_PORT
    """Port of /metrics and /healthz (0 picks a free one)."""
    webhook_cert_dir: Path | None = None
    """Folder with the webhook's tls.crt and tls.key; the webhook runs only when set."""
    webhook_port: int = names.WEBHOOK_PORT
    retry_delays: tuple[float, ...] = (0.5, 1, 2, 5, 10, 30)
    """Seconds between retries of a failed reconcile."""
    replica_backoff: BackoffPolicy = field(default_factory=BackoffPolicy)
    """How long a replica whose pods keep failing waits before its next pod."""
    priority_ceilings: PriorityCeilings = field(default_factory=PriorityCeilings)
    """The highest kvCache.priority each namespace may use (the chart's ``kvPriority``)."""


def configure_kopf(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    """Apply ``config`` to kopf's settings (at start-up, before any watch begins)."""
    import kopf

    # Only explicit Events reach users; kopf's per-handler log lines stay in the log.
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = names.MANAGED_BY
    settings.posting.reporting_instance = config.identity
    settings.posting.event_name_prefix = f"{names.MANAGED_BY}-"
    settings.peering.lifetime = config.peering_lifetime
    settings.peering.stealth = True
    # Only the operator's own pods are watched, filtered by the API server.
    settings.watching.label_selectors["v1", "pods"] = f"{names.LABEL_MANAGED_BY}={names.MANAGED_BY}"
    # Watches are reopened at least every 5 minutes; a silent one is dropped after 70s.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 60
    if config.webhook_cert_dir is not None:
        settings.admission.server = kopf.WebhookServer(
            addr="0.0.0.0",
            port=config.webhook_port,
            certfile=config.webhook_cert_dir / names.WEBHOOK_CERT_FILE,
            pkeyfile=config.webhook_cert_dir / names.WEBHOOK_KEY_FILE,
        )
        # The chart owns the MutatingWebhookConfiguration (and its CA bundle).
        settings.admission.managed = None
