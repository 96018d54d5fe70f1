"""``kvshare node``: run the node agent (broker, device plugin, metrics, KVShareNode)."""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import threading
from pathlib import Path

from kvshare.api import env, names
from kvshare.api.quantity import QuantityError, parse_bytes
from kvshare.deviceplugin.policy import DEFAULT_POLICY, POLICIES

log = logging.getLogger(__name__)


def _size(text: str) -> int:
    try:
        return parse_bytes(text, field="size")
    except QuantityError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: expected [HOST]:PORT, e.g. :9400")
    return host or "0.0.0.0", int(port)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The node agent's options."""
    gpus = parser.add_argument_group("GPUs")
    gpus.add_argument(
        "--fake-gpus",
        metavar="SPEC",
        help="declare GPUs backed by host memory instead of NVML, e.g. 2x80Gi (host backend)",
    )
    gpus.add_argument(
        "--headroom", type=_size, default=512 * 2**20, metavar="SIZE",
        help="memory kept back on every GPU (default 512Mi)",
    )  # fmt: skip
    gpus.add_argument(
        "--slots-per-gpu", type=int, default=8, metavar="N",
        help=f"{names.RESOURCE_GPU} slots each GPU advertises (default 8)",
    )  # fmt: skip
    broker = parser.add_argument_group("broker")
    broker.add_argument(
        "--broker-socket", type=Path, metavar="PATH",
        help=f"pools' socket (default ${env.BROKER_SOCKET.name} or {env.BROKER_SOCKET.default}); "
        "its directory is mounted into pods",
    )  # fmt: skip
    broker.add_argument(
        "--admin-socket", type=Path, metavar="PATH",
        help=f"socket of kvshare ctl/top (default: {names.ADMIN_SOCKET_NAME} next to the broker)",
    )  # fmt: skip
    broker.add_argument(
        "--state-file", type=Path, metavar="PATH",
        help="restart file of the broker (default: broker.state next to the broker)",
    )  # fmt: skip
    broker.add_argument(
        "--broker-policy", choices=sorted(POLICIES), default=DEFAULT_POLICY, metavar="NAME",
        help=f"who gets memory and what is reclaimed from whom: {', '.join(sorted(POLICIES))} "
        f"(default {DEFAULT_POLICY})",
    )  # fmt: skip
    broker.add_argument(
        "--reclaim-deadline", type=float, default=10.0, metavar="SECONDS",
        help="time a pool has to release reclaimed memory before it is reported (default 10)",
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
    kube.add_argument("--kubeconfig", metavar="PATH", help="kubeconfig outside a cluster")
    kube.add_argument(
        "--no-kube", action="store_true",
        help="do not use the Kubernetes API (no KVShareNode, no pending-pod lookup)",
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


def run(args: argparse.Namespace) -> int:
    """Run until SIGTERM or SIGINT; 1 when an essential part cannot start."""
    from kvshare.deviceplugin.agent import AgentConfig, NodeAgent
    from kvshare.deviceplugin.broker import BrokerError
    from kvshare.deviceplugin.inventory import InventoryError

    config = AgentConfig.for_broker(
        args.node_name or socket.gethostname(),
        args.broker_socket or Path(env.BROKER_SOCKET.require()),
        admin_socket=args.admin_socket,
        state_file=args.state_file,
        fake_gpus=args.fake_gpus,
        headroom=args.headroom,
        slots_per_gpu=args.slots_per_gpu,
        device_plugin_dir=args.device_plugin_dir,
        metrics_host=args.metrics_address[0],
        metrics_port=args.metrics_address[1],
        cdi_kind=args.cdi_kind,
        use_kube=not args.no_kube,
        kubeconfig=args.kubeconfig,
        publish_interval_s=args.publish_interval,
        reclaim_deadline_s=args.reclaim_deadline,
        broker_policy=args.broker_policy,
        startup_hold_s=args.startup_hold,
        recovery_s=args.recovery,
        audit_interval_s=args.audit_interval,
    )
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    agent = NodeAgent(config)
    try:
        agent.start()
    except (InventoryError, BrokerError, OSError, ValueError) as exc:
        log.error("kvshare node cannot start: %s", exc)
        return 1
    stop.wait()
    log.info("stopping")
    agent.stop()
    return 0
