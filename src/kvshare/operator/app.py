"""Assemble and run the operator: API client, controller, HTTP endpoint, kopf."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import kopf

from kvshare.operator.backoff import FailureBackoff
from kvshare.operator.client import KubeApi
from kvshare.operator.controller import Controller
from kvshare.operator.handlers import build_registry
from kvshare.operator.metrics import default_metrics
from kvshare.operator.server import HttpEndpoint
from kvshare.operator.settings import OperatorConfig, configure_kopf

if TYPE_CHECKING:
    from kubernetes.client import Configuration

__all__ = ["serve"]

log = logging.getLogger(__name__)


def serve(config: OperatorConfig, configuration: Configuration) -> int:
    """Run the operator until SIGTERM or SIGINT; the process exit status."""
    # kopf logs every handler call at INFO; the operator's own log says what it decided.
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    metrics = default_metrics()
    controller = Controller(
        KubeApi(configuration),
        config.runtime,
        metrics,
        config.retry_delays,
        FailureBackoff(config.replica_backoff),
        ceilings=config.priority_ceilings,
    )
    endpoint = HttpEndpoint(metrics.registry, config.metrics_port)
    registry = build_registry(config, controller, endpoint, configuration)
    settings = kopf.OperatorSettings()
    configure_kopf(settings, config)
    log.info(
        "kvshare operator %s on %s, peering %s (priority %d), injecting %s",
        config.identity,
        ", ".join(config.namespaces) or "all namespaces",
        config.peering or "off",
        config.priority,
        config.runtime.image,
    )
    kopf.run(
        registry=registry,
        settings=settings,
        identity=config.identity,  # type: ignore[arg-type]  # kopf's NewType of str
        priority=config.priority,
        peering_name=config.peering,
        standalone=config.peering is None,
        clusterwide=not config.namespaces,
        namespaces=config.namespaces,
    )
    return 0
