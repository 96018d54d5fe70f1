"""Where the Kubernetes API is and how to authenticate: one place for both clients.

The operator talks to the API server through two clients: kopf's own (watches, events,
peering) and the ``kubernetes`` package (pods, services, status). Both get their
credentials from the same :class:`kubernetes.client.Configuration`, loaded here from the
pod's service account or from a kubeconfig file.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import kopf
    from kubernetes.client import Configuration

__all__ = ["NoClusterError", "connection_info", "load_configuration"]

log = logging.getLogger(__name__)


class NoClusterError(RuntimeError):
    """No Kubernetes API server is configured; the message says how to configure one."""


def load_configuration(kubeconfig: str | None, context: str | None = None) -> Configuration:
    """The API server and credentials: in-cluster, else a kubeconfig.

    Without ``kubeconfig`` the pod's service account is tried first, then the
    kubeconfig the ``kubernetes`` package finds itself (``$KUBECONFIG`` or
    ``~/.kube/config``). Raises :class:`NoClusterError` when neither exists.
    """
    from kubernetes import config
    from kubernetes.client import Configuration
    from kubernetes.config.config_exception import ConfigException

    configuration = Configuration()
    if kubeconfig is None and context is None:
        try:
            config.load_incluster_config(  # type: ignore[no-untyped-call]
                client_configuration=configuration
            )
            log.info("using the pod's service account")
            return configuration
        except ConfigException:
            pass
    try:
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=kubeconfig, context=context, client_configuration=configuration
        )
    except (ConfigException, OSError) as exc:
        where = (
            f"kubeconfig {kubeconfig}"
            if kubeconfig
            else "a kubeconfig ($KUBECONFIG or ~/.kube/config)"
        )
        raise NoClusterError(
            f"no Kubernetes API server to connect to: not running in a cluster (no service "
            f"account) and {where} could not be loaded ({exc}); pass --kubeconfig PATH, set "
            "KUBECONFIG, or run inside a cluster"
        ) from None
    log.info("using %s", f"kubeconfig {kubeconfig}" if kubeconfig else "the default kubeconfig")
    return configuration


def connection_info(configuration: Configuration) -> kopf.ConnectionInfo:
    """kopf's credentials from ``configuration`` (re-read on every login, so rotated
    service-account tokens are picked up)."""
    import kopf

    header = configuration.get_api_key_with_prefix(
        "BearerToken"
    ) or configuration.get_api_key_with_prefix("authorization")
    scheme, token = None, None
    if header:
        parts = header.split(" ", 1)
        scheme, token = (parts[0], parts[1]) if len(parts) == 2 else (None, parts[0])
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        username=configuration.username or None,
        password=configuration.password or None,
        scheme=scheme,
        token=token,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
    )
