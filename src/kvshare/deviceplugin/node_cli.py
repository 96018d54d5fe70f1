"""``kvshare node``: run the node agent (broker, device plugin, metrics, KVShareNode)."""

from __future__ import annotations

import argparse
import logging
import signal
import socket
from pathlib import Path
from typing import Any

from kvshare.api import env, names
from kvshare.api.priorities import MAX_PRIORITY, PriorityCeilings, PriorityError
from kvshare.api.quantity import QuantityError, parse_bytes
from kvshare.deviceplugin.broker.connections.gate import BrokerLimits
from kvshare.deviceplugin.broker.enforcement import EnforcementConfig
from kvshare.deviceplugin.broker.policy import DEFAULT_POLICY, POLICIES
from kvshare.deviceplugin.cluster.node_checks import NodeFacts
from kvshare.deviceplugin.cluster.node_config import (
    DEFAULT_CONFIG,
    DEFAULT_LABEL,
    NodeConfigError,
    NodeSettings,
    SelectedConfig,
    load_config_file,
    select,
)
from kvshare.deviceplugin.stop_signals import StopSignals

log = logging.getLogger(__name__)


def _size(text: str) -> int:
    try:
        return parse_bytes(text, field="size")
    except QuantityError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number >= 1")
    return int(text)


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: expected [HOST]:PORT, e.g. :9400")
    return host or "0.0.0.0", int(port)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The node agent's options."""
    config = parser.add_argument_group(
        "per-node configuration",
        "settings marked (*) may come from a named configuration chosen by a Node label; "
        "a flag given on the command line wins over it",
    )
    config.add_argument(
        "--config", type=Path, metavar="FILE",
        help="YAML file of configurations: default, and configs by name (the chart's "
        "nodeAgent.configs); read once at start",
    )  # fmt: skip
    config.add_argument(
        "--config-label", default=DEFAULT_LABEL, metavar="KEY",
        help=f"Node label naming this node's configuration (default {DEFAULT_LABEL})",
    )  # fmt: skip
    gpus = parser.add_argument_group("GPUs")
    gpus.add_argument(
        "--fake-gpus",
        metavar="SPEC",
        help="(*) declare GPUs backed by host memory instead of NVML, e.g. 2x80Gi (host backend)",
    )
    gpus.add_argument(
        "--headroom", type=_size, metavar="SIZE",
        help="(*) memory kept back on every GPU (default 512Mi)",
    )  # fmt: skip
    gpus.add_argument(
        "--slots-per-gpu", type=int, metavar="N",
        help=f"(*) {names.RESOURCE_GPU} slots each GPU advertises (default 8)",
    )  # fmt: skip
    broker = parser.add_argument_group("broker")
    broker.add_argument(
        "--broker-socket", type=Path, metavar="PATH",
        help=f"pools' socket (default ${env.BROKER_SOCKET.name} or {env.BROKER_SOCKET.default}); "
        "its directory is mounted into pods",
    )  # fmt: skip
    broker.add_argument(
        "--admin-dir", type=Path, default=Path(names.ADMIN_DIR), metavar="DIR",
        help=f"the agent's own directory, which no pod mounts: {names.ADMIN_SOCKET_NAME} (kvshare "
        f"ctl/top) and {names.STATE_FILE_NAME} (the broker's restart file); made 0700 "
        f"(default {names.ADMIN_DIR})",
    )  # fmt: skip
    broker.add_argument(
        "--broker-policy", choices=sorted(POLICIES), default=DEFAULT_POLICY, metavar="NAME",
        help=f"who gets memory and what is reclaimed from whom: {', '.join(sorted(POLICIES))} "
        f"(default {DEFAULT_POLICY})",
    )  # fmt: skip
    broker.add_argument(
        "--reclaim-deadline", type=float, metavar="SECONDS",
        help="(*) time a pool has to release reclaimed memory before it is reported "
        "(default 10)",
    )  # fmt: skip
    broker.add_argument(
        "--startup-hold", type=float, default=600.0, metavar="SECONDS",
        help="longest an engine may hold its GPU's start-up turn (default 600)",
    )  # fmt: skip
    broker.add_argument(
        "--recovery", type=float, default=10.0, metavar="SECONDS",
        help="after a restart, how long to wait for pools to re-declare (default 10)",
    )  # fmt: skip
    broker.add_argument(
        "--audit-interval", type=float, default=2.0, metavar="SECONDS",
        help="how often pools are checked against the device (default 2)",
    )  # fmt: skip
    enforcement = parser.add_argument_group(
        "lease enforcement",
        "on GPUs, a pool's process holding more device memory (NVML) than its charge plus the "
        "tolerance gets a Warning Event, a metric and a reclaim; one that keeps on is evicted",
    )
    enforcement.add_argument(
        "--overuse-tolerance", type=_size, default=EnforcementConfig().tolerance, metavar="SIZE",
        help="device memory above the charge that is not yet overuse (default 256Mi)",
    )  # fmt: skip
    enforcement.add_argument(
        "--overuse-evict-after", type=int, default=EnforcementConfig().evict_after, metavar="N",
        help="audits in a row over before the pod is evicted; 0: never (default "
        f"{EnforcementConfig().evict_after})",
    )  # fmt: skip
    limits = parser.add_argument_group(
        "limits", "what one pod, and all of them, may hold open (a pod's processes count as one)"
    )
    defaults = BrokerLimits()
    limits.add_argument(
        "--max-connections", type=_positive, default=defaults.max_connections, metavar="N",
        help="broker connections in all (also bounded by the open-files limit; default "
        f"{defaults.max_connections})",
    )  # fmt: skip
    limits.add_argument(
        "--max-connections-per-pod", type=_positive, default=defaults.max_connections_per_pod,
        metavar="N",
        help=f"broker connections per pod (default {defaults.max_connections_per_pod})",
    )  # fmt: skip
    limits.add_argument(
        "--max-pools-per-pod", type=_positive, default=defaults.max_pools_per_pod, metavar="N",
        help=f"KV pools per pod (default {defaults.max_pools_per_pod})",
    )  # fmt: skip
    limits.add_argument(
        "--hello-deadline", type=float, default=defaults.hello_deadline_s, metavar="SECONDS",
        help="time a new connection has to say what it is for (default "
        f"{defaults.hello_deadline_s:g})",
    )  # fmt: skip
    priorities = parser.add_argument_group(
        "KV priorities", "the highest kvCache.priority each namespace may use (the chart's "
        "kvPriority); a pool asking for more runs at its namespace's ceiling",
    )  # fmt: skip
    priorities.add_argument(
        "--kv-priority-default", default=str(MAX_PRIORITY), metavar="N",
        help=f"ceiling of every namespace not named (default {MAX_PRIORITY}: none)",
    )  # fmt: skip
    priorities.add_argument(
        "--kv-priority", action="append", default=[], metavar="NAMESPACE=N",
        help="ceiling of one namespace (repeatable)",
    )  # fmt: skip
    kube = parser.add_argument_group("Kubernetes")
    kube.add_argument(
        "--node-name", default=None, metavar="NAME",
        help="this node's name (default: the host name); the chart passes spec.nodeName",
    )  # fmt: skip
    kube.add_argument(
        "--device-plugin-dir", type=Path, default=Path(names.DEVICE_PLUGIN_DIR), metavar="DIR",
        help=f"the kubelet's device-plugin directory (default {names.DEVICE_PLUGIN_DIR})",
    )  # fmt: skip
    kube.add_argument(
        "--cdi-kind", metavar="VENDOR/CLASS",
        help="answer Allocate with CDI devices of this kind (e.g. nvidia.com/gpu) instead of "
        "NVIDIA_VISIBLE_DEVICES",
    )  # fmt: skip
    kube.add_argument(
        "--pod-resources-socket", type=Path, default=Path(names.POD_RESOURCES_SOCKET),
        metavar="PATH",
        help="the kubelet's PodResources API, which says which slots each pod got (default "
        f"{names.POD_RESOURCES_SOCKET})",
    )  # fmt: skip
    kube.add_argument("--kubeconfig", metavar="PATH", help="kubeconfig outside a cluster")
    kube.add_argument(
        "--no-kube", action="store_true",
        help="do not use the Kubernetes API (no KVShareNode, no pod watch): pools cannot be "
        "verified and are taken at their word; outside a cluster only",
    )  # fmt: skip
    kube.add_argument(
        "--publish-interval", type=float, default=10.0, metavar="SECONDS",
        help="how often the KVShareNode status may be written (default 10)",
    )  # fmt: skip
    parser.add_argument(
        "--metrics-address", type=_address, default=("0.0.0.0", names.METRICS_PORT),
        metavar="[HOST]:PORT",
        help=f"metrics, /healthz and /readyz (default :{names.METRICS_PORT})",
    )  # fmt: skip


#: Longest wait between two reads of a Node that cannot be read.
_NODE_RETRY_MAX_S = 30.0


def _wait_for_node(
    api: Any, node_name: str, signals: StopSignals, address: tuple[str, int]
) -> NodeFacts | None:
    """The Node, read again with back-off until it can be (None: stopped meanwhile).

    Which configuration the node runs (slots, headroom, fake GPUs) is on its label: rather
    than run the default and advertise slots the node may not have, the agent advertises
    nothing until it knows. Meanwhile its endpoint answers the probes: alive, not ready,
    and why.
    """
    from kvshare.deviceplugin.admin.metrics import MetricsServer, NodeMetrics
    from kvshare.deviceplugin.cluster.node_checks import read_node

    facts = read_node(api, node_name)
    if facts is not None:
        return facts
    waiting = f"waiting to read Node {node_name} for its configuration (its label)"
    server = MetricsServer(
        address[0], address[1], NodeMetrics(), lambda: (True, waiting), lambda: (False, waiting)
    )
    server.start()
    log.warning(
        "%s: no GPU slot is advertised until then; /readyz answers 503 on %s:%d",
        waiting,
        address[0],
        server.port,
    )
    delay = 1.0
    try:
        while facts is None:
            if signals.wait_for(delay) is not None:
                return None
            facts = read_node(api, node_name)
            delay = min(delay * 2, _NODE_RETRY_MAX_S)
        log.info("read Node %s", node_name)
        return facts
    finally:
        server.stop()


class _StoppedError(Exception):
    """A stop signal arrived before the agent started."""


def _settings(
    args: argparse.Namespace, node_name: str, signals: StopSignals
) -> tuple[dict[str, Any], SelectedConfig]:
    """AgentConfig fields from the flags over the node's configuration (if any), and the
    configuration chosen. Raises NodeConfigError for a file that cannot be used, and
    :class:`_StoppedError` when stopped while waiting to read the Node."""
    from kvshare.deviceplugin.agent import kube_api_client

    selected = SelectedConfig(DEFAULT_CONFIG, NodeSettings())
    if args.config is not None:
        file = load_config_file(args.config)
        api = kube_api_client(args.kubeconfig) if not args.no_kube else None
        facts = None
        if api is not None:
            facts = _wait_for_node(api, node_name, signals, args.metrics_address)
            if facts is None:
                raise _StoppedError
        selected = select(file, dict(facts.labels) if facts else None, args.config_label)
        if selected.problem:
            log.error("%s", selected.problem)
        log.info("node configuration %r from %s", selected.name, args.config)
    # Flags are checked where they are used (the inventory names --fake-gpus itself).
    flags = NodeSettings.model_construct(
        slots_per_gpu=args.slots_per_gpu,
        headroom=args.headroom,
        reclaim_deadline_seconds=args.reclaim_deadline,
        fake_gpus=args.fake_gpus,
    )
    settings = flags.over(selected.settings)
    fields = {
        "slots_per_gpu": settings.slots_per_gpu,
        "headroom": settings.headroom,
        "reclaim_deadline_s": settings.reclaim_deadline_seconds,
        "fake_gpus": settings.fake_gpus or None,
    }
    return {k: v for k, v in fields.items() if v is not None}, selected


def run(args: argparse.Namespace) -> int:
    """Run until SIGTERM or SIGINT; 1 when an essential part cannot start."""
    from kvshare.deviceplugin.agent import AgentConfig, NodeAgent
    from kvshare.deviceplugin.broker.server import BrokerError
    from kvshare.deviceplugin.inventory import InventoryError

    node_name = args.node_name or socket.gethostname()
    signals = StopSignals()
    try:
        settings, selected = _settings(args, node_name, signals)
        ceilings = PriorityCeilings.parse_flags(args.kv_priority_default, args.kv_priority)
    except (NodeConfigError, PriorityError) as exc:
        log.error("kvshare node cannot start: %s", exc)
        return 1
    except _StoppedError:
        return 0
    config = AgentConfig.for_broker(
        node_name,
        args.broker_socket or Path(env.BROKER_SOCKET.require()),
        admin_dir=args.admin_dir,
        node_config=selected.name if args.config is not None else None,
        node_config_problem=selected.problem,
        **settings,
        device_plugin_dir=args.device_plugin_dir,
        metrics_host=args.metrics_address[0],
        metrics_port=args.metrics_address[1],
        cdi_kind=args.cdi_kind,
        use_kube=not args.no_kube,
        kubeconfig=args.kubeconfig,
        publish_interval_s=args.publish_interval,
        broker_policy=args.broker_policy,
        startup_hold_s=args.startup_hold,
        recovery_s=args.recovery,
        audit_interval_s=args.audit_interval,
        pod_resources_socket=args.pod_resources_socket,
        limits=BrokerLimits(
            max_connections=args.max_connections,
            max_connections_per_pod=args.max_connections_per_pod,
            max_pools_per_pod=args.max_pools_per_pod,
            hello_deadline_s=args.hello_deadline,
        ),
        priority_ceilings=ceilings,
        enforcement=EnforcementConfig(
            tolerance=args.overuse_tolerance, evict_after=max(args.overuse_evict_after, 0)
        ),
    )
    agent = NodeAgent(config)
    try:
        agent.start()
    except (InventoryError, BrokerError, OSError, ValueError) as exc:  # PrivateDirError too
        log.error("kvshare node cannot start: %s", exc)
        return 1
    log.info("stopping on %s", signal.Signals(signals.wait()).name)
    agent.stop()
    return 0
