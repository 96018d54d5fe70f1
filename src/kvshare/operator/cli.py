"""``kvshare operator``: place ModelServers onto shared GPUs and run their pods."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvshare.api import env, names
from kvshare.api.priorities import MAX_PRIORITY, PriorityCeilings, PriorityError
from kvshare.operator.backoff import BackoffPolicy

PULL_POLICIES = ("IfNotPresent", "Always", "Never")


def _seconds(text: str) -> float:
    """A positive number of seconds, for argparse."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The operator's flags."""
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument(
        "--kubeconfig",
        help="kubeconfig file; default: the pod's service account, else $KUBECONFIG or "
        "~/.kube/config",
    )
    cluster.add_argument("--context", help="kubeconfig context to use")
    cluster.add_argument(
        "--namespace",
        dest="namespaces",
        action="append",
        default=[],
        metavar="NAMESPACE",
        help="serve only ModelServers in this namespace (repeatable); default: all",
    )
    pods = parser.add_argument_group("model-server pods")
    pods.add_argument(
        "--image",
        help=f"kvshare image whose runtime bundle is injected; default: ${env.IMAGE.name}",
    )
    pods.add_argument("--image-pull-policy", choices=PULL_POLICIES, default="IfNotPresent")
    defaults = BackoffPolicy()
    pods.add_argument(
        "--replica-backoff",
        type=_seconds,
        default=defaults.initial,
        metavar="SECONDS",
        help="how long a replica whose pod failed waits before its next pod; doubled after "
        "each further failure in a row (default: %(default)g)",
    )
    pods.add_argument(
        "--replica-backoff-max",
        type=_seconds,
        default=defaults.maximum,
        metavar="SECONDS",
        help="the longest such wait (default: %(default)g)",
    )
    pods.add_argument(
        "--replica-backoff-reset",
        type=_seconds,
        default=defaults.reset_after,
        metavar="SECONDS",
        help="how long a replica must stay ready before its failures are forgotten "
        "(default: %(default)g)",
    )
    priorities = parser.add_argument_group(
        "KV priorities",
        "the highest kvCache.priority each namespace may use (the chart's kvPriority): a "
        "ModelServer asking for more runs at the ceiling (condition PriorityAllowed=False)",
    )
    priorities.add_argument(
        "--kv-priority-default",
        default=str(MAX_PRIORITY),
        metavar="N",
        help=f"ceiling of every namespace not named (default {MAX_PRIORITY}: none)",
    )
    priorities.add_argument(
        "--kv-priority",
        action="append",
        default=[],
        metavar="NAMESPACE=N",
        help="ceiling of one namespace (repeatable)",
    )
    peering = parser.add_argument_group("replicas (kopf peering)")
    peering.add_argument(
        "--peering",
        default=names.PEERING_NAME,
        help="ClusterKopfPeering the replicas elect through (with --namespace: a KopfPeering of "
        "that name in each namespace); it must exist",
    )
    peering.add_argument(
        "--standalone", action="store_true", help="no peering: act even if another operator runs"
    )
    peering.add_argument(
        "--identity",
        help="this replica's peering identity; default: the host name (the pod name in a "
        "cluster), so operators on one host need distinct identities",
    )
    peering.add_argument(
        "--priority", type=int, help="peering priority; default: older replicas rank higher"
    )
    peering.add_argument(
        "--peering-lifetime",
        type=int,
        default=60,
        metavar="SECONDS",
        help="how long a replica that stopped renewing its peering entry still counts as alive",
    )
    serving = parser.add_argument_group("endpoints")
    serving.add_argument(
        "--metrics-port",
        type=int,
        default=names.OPERATOR_METRICS_PORT,
        help="port of /metrics and /healthz (0: any free port, logged)",
    )
    serving.add_argument(
        "--webhook-cert-dir",
        type=Path,
        help=f"serve the runtime-injection webhook with {names.WEBHOOK_CERT_FILE} and "
        f"{names.WEBHOOK_KEY_FILE} from this folder; default: no webhook",
    )
    serving.add_argument("--webhook-port", type=int, default=names.WEBHOOK_PORT)


def run(args: argparse.Namespace) -> int:
    """Run the operator until it is stopped; exit status 2 on configuration errors."""
    from kvshare.operator.connection import NoClusterError, load_configuration
    from kvshare.operator.render import RuntimeImage
    from kvshare.operator.settings import (
        OperatorConfig,
        default_identity,
        start_time_priority,
    )

    try:
        image = args.image or env.IMAGE.read()
    except env.EnvError as exc:
        return _fail(str(exc))
    if not image:
        return _fail(
            f"the kvshare image to inject into model-server pods is not set: pass --image or "
            f"set {env.IMAGE.name} (the Helm chart sets it)"
        )
    if args.webhook_cert_dir is not None:
        missing = [
            f
            for f in (names.WEBHOOK_CERT_FILE, names.WEBHOOK_KEY_FILE)
            if not (args.webhook_cert_dir / f).is_file()
        ]
        if missing:
            return _fail(f"--webhook-cert-dir {args.webhook_cert_dir} lacks {', '.join(missing)}")
    try:
        ceilings = PriorityCeilings.parse_flags(args.kv_priority_default, args.kv_priority)
    except PriorityError as exc:
        return _fail(str(exc))
    try:
        configuration = load_configuration(args.kubeconfig, args.context)
    except NoClusterError as exc:
        return _fail(str(exc))
    config = OperatorConfig(
        runtime=RuntimeImage(image, args.image_pull_policy),
        kubeconfig=args.kubeconfig,
        context=args.context,
        namespaces=tuple(args.namespaces),
        peering=None if args.standalone else args.peering,
        identity=args.identity or default_identity(),
        priority=args.priority if args.priority is not None else start_time_priority(),
        peering_lifetime=args.peering_lifetime,
        metrics_port=args.metrics_port,
        webhook_cert_dir=args.webhook_cert_dir,
        webhook_port=args.webhook_port,
        replica_backoff=BackoffPolicy(
            initial=args.replica_backoff,
            maximum=max(args.replica_backoff, args.replica_backoff_max),
            reset_after=args.replica_backoff_reset,
        ),
        priority_ceilings=ceilings,
    )
    from kvshare.operator.app import serve

    return serve(config, configuration)


def _fail(message: str) -> int:
    sys.stderr.write(f"kvshare operator: {message}\n")
    return 2
