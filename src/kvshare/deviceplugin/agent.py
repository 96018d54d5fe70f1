"""The node agent: inventory, broker, metrics, audit, device plugin and KVShareNode,
wired together and started and stopped in order.

Only the inventory, the broker and the metrics endpoint are essential: without them the
agent does not start. The device plugin waits for a kubelet, and the KVShareNode
publisher and the pod watch need a Kubernetes API; each of those says once that it is
idle and the rest keeps running.

With a Kubernetes API the broker verifies every pool against the pod it runs in (the
pod watch and the kubelet's PodResources API, :mod:`.pod_directory`), and refuses what
it cannot verify. Without one (``--no-kube``, or no API configured) nothing can be
verified and pools are taken at their word, as in the demo.
"""

from __future__ import annotations

import datetime
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvshare.api import names
from kvshare.api.kube import Condition
from kvshare.api.priorities import PriorityCeilings
from kvshare.api.quantity import format_bytes_human
from kvshare.deviceplugin.admin import private_dir
from kvshare.deviceplugin.admin.metrics import MetricsServer, NodeMetrics
from kvshare.deviceplugin.broker.audit import Auditor
from kvshare.deviceplugin.broker.enforcement import EnforcementConfig, LeaseEnforcer
from kvshare.deviceplugin.broker.policy import DEFAULT_POLICY
from kvshare.deviceplugin.broker.server import Broker, BrokerConfig, BrokerLimits
from kvshare.deviceplugin.cluster.budget_checks import BudgetChecks
from kvshare.deviceplugin.inventory import GpuInfo, Inventory, open_inventory

__all__ = ["AgentConfig", "NodeAgent"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentConfig:
    """Everything ``kvshare node`` can be told."""

    node_name: str
    broker_socket: Path
    admin_dir: Path
    """The agent's own directory (admin socket, restart file): no pod mounts it."""
    fake_gpus: str | None = None
    headroom: int = 512 * 2**20
    slots_per_gpu: int = 8
    device_plugin_dir: Path = Path(names.DEVICE_PLUGIN_DIR)
    metrics_host: str = "0.0.0.0"
    metrics_port: int = names.METRICS_PORT
    cdi_kind: str | None = None
    use_kube: bool = True
    kubeconfig: str | None = None
    publish_interval_s: float = 10.0
    reclaim_deadline_s: float = 10.0
    broker_policy: str = DEFAULT_POLICY
    startup_hold_s: float = 600.0
    recovery_s: float = 10.0
    audit_interval_s: float = 2.0
    health_interval_s: float = 5.0
    node_check_interval_s: float = 300.0
    node_config: str | None = None
    """The named configuration the settings above came from (``None``: no file)."""
    node_config_problem: str = ""
    """Why the node runs the default configuration although its label names another."""
    pod_resources_socket: Path = Path(names.POD_RESOURCES_SOCKET)
    limits: BrokerLimits = field(default_factory=BrokerLimits)
    priority_ceilings: PriorityCeilings = field(default_factory=PriorityCeilings)
    """The highest KV priority each namespace may use (the chart's ``kvPriority``)."""
    enforcement: EnforcementConfig = field(default_factory=EnforcementConfig)
    """How leases are enforced where the device reports per-process memory (NVML)."""

    @property
    def admin_socket(self) -> Path:
        """``admin.sock`` in the admin directory."""
        return self.admin_dir / names.ADMIN_SOCKET_NAME

    @property
    def state_file(self) -> Path:
        """The broker's restart file in the admin directory."""
        return self.admin_dir / names.STATE_FILE_NAME

    @classmethod
    def for_broker(
        cls, node_name: str, broker_socket: Path, *, admin_dir: Path, **options: Any
    ) -> AgentConfig:
        """A config with its sockets where given (the admin directory apart from the
        broker socket's, which pods mount)."""
        return cls(node_name=node_name, broker_socket=broker_socket, admin_dir=admin_dir, **options)


def kube_api_client(kubeconfig: str | None) -> Any | None:
    """An API client from the in-cluster config or a kubeconfig, or None without one."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        try:
            config.load_kube_config(config_file=kubeconfig)  # type: ignore[no-untyped-call]
        except (config.ConfigException, OSError, TypeError) as exc:
            log.info(
                "no Kubernetes API configured (%s): KVShareNode publishing and the pending-pod "
                "lookup are off",
                str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
            )
            return None
    return client.ApiClient()


class NodeAgent:
    """``kvshare node`` as an object: :meth:`start`, then :meth:`stop`."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.metrics = NodeMetrics()
        self.inventory: Inventory | None = None
        self.broker: Broker | None = None
        self.metrics_server: MetricsServer | None = None
        self._auditor: Auditor | None = None
        self._budget: BudgetChecks | None = None
        self._plugins: Any = None
        self._watch: Any = None
        self._publisher: Any = None
        self._pods: Any = None
        self._directory: Any = None
        self._api: Any = None
        self._checks: Any = None
        self._stop = threading.Event()
        self._health_thread: threading.Thread | None = None
        self._gpus: list[GpuInfo] = []

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Start every part; raises InventoryError, BrokerError or OSError when an
        essential part cannot start (and stops what already started)."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        config = self.config
        private_dir.prepare(config.admin_dir, config.broker_socket.parent)
        self.inventory = open_inventory(config.fake_gpus, config.node_name)
        self._gpus = self.inventory.gpus()
        self._api = kube_api_client(config.kubeconfig) if config.use_kube else None
        if self._api is None:
            log.log(
                logging.WARNING if config.use_kube else logging.INFO,
                "no Kubernetes API: the broker cannot verify which pod a pool runs in and "
                "takes pools at their word (use this only outside a cluster)",
            )
        broker = Broker(
            self._gpus,
            BrokerConfig(
                socket_path=config.broker_socket,
                admin_path=config.admin_socket,
                state_path=config.state_file,
                headroom=config.headroom,
                reclaim_deadline_s=config.reclaim_deadline_s,
                policy=config.broker_policy,
                turn_hold_s=config.startup_hold_s,
                recovery_s=config.recovery_s,
                limits=config.limits,
                verify=self._api is not None,
            ),
            events=self.metrics,
        )
        self.broker = broker
        if self._api is not None:
            self._watch_pods(broker)
        broker.start()
        self.metrics.set_source(broker.view, (g.uuid for g in self._gpus))
        self.metrics_server = MetricsServer(
            config.metrics_host, config.metrics_port, self.metrics, self._healthy, self._ready
        )
        self.metrics_server.start()
        inventory = self.inventory
        enforce = None
        if inventory.backend == "cuda":  # NVML tells each process's device memory
            from kvshare.deviceplugin.lease_enforcement import OveruseHandler

            enforcer = LeaseEnforcer(config.enforcement)
            enforce = OveruseHandler(enforcer, broker, self.metrics, self._api, config.node_name)
        self._auditor = Auditor(
            broker.view,
            broker.record_audit,
            inventory.backend,
            inventory.process_memory,
            interval_s=config.audit_interval_s,
            on_findings=enforce,
        )
        self._auditor.start()
        self._budget = BudgetChecks(broker.view)
        self._budget.start()
        self._start_kube()
        self._start_device_plugin()
        self._health_thread = threading.Thread(
            target=self._poll_health, name="kvshare-health", daemon=True
        )
        self._health_thread.start()
        total = sum(g.total_bytes for g in self._gpus)
        log.info(
            "kvshare node agent on %s: %d GPU(s) (%s, %s backend), broker %s, admin %s, "
            "metrics http://%s:%d/metrics",
            config.node_name,
            len(self._gpus),
            format_bytes_human(total),
            inventory.backend,
            config.broker_socket,
            config.admin_socket,
            config.metrics_host,
            self.metrics_server.port,
        )

    def _watch_pods(self, broker: Broker) -> None:
        """The pod watch and the directory the broker verifies pools with (started, the
        watch with the other Kubernetes parts)."""
        from kvshare.deviceplugin.cluster.pods import NodePods
        from kvshare.deviceplugin.kubelet.pod_resources import PodResourcesClient
        from kvshare.deviceplugin.pod_directory import KubePodDirectory

        config = self.config
        self._pods = NodePods(self._api, config.node_name, on_pod=self._pod_changed)
        self._directory = KubePodDirectory(
            self._pods,
            PodResourcesClient(config.pod_resources_socket),
            config.priority_ceilings,
            broker.pods_changed,
            config.node_name,
        )
        broker.set_pod_directory(self._directory)
        self._directory.start()

    def _start_kube(self) -> None:
        config = self.config
        api = self._api
        if api is None:
            return
        from kvshare.deviceplugin.cluster.node_checks import NodeChecks, post_node_event, read_node
        from kvshare.deviceplugin.cluster.publisher import KVShareNodePublisher, status_from_view

        assert self.broker is not None and self.inventory is not None
        assert self._budget is not None
        broker, backend, budget = self.broker, self.inventory.backend, self._budget

        def post(reason: str, message: str) -> None:
            facts = read_node(api, config.node_name)
            if facts is not None:
                post_node_event(api, facts, reason, message)

        budget.set_post(post)
        checks = NodeChecks(
            lambda: read_node(api, config.node_name),
            lambda: len(self._gpus),
            lambda facts, reason, message: post_node_event(api, facts, reason, message),
            self.metrics.set_device_plugin_conflict,
            interval_s=config.node_check_interval_s,
            warnings=(
                (("UnknownNodeConfig", config.node_config_problem),)
                if config.node_config_problem
                else ()
            ),
        )
        self._checks = checks
        checks.start()
        config_condition = self._config_condition()

        def status() -> Any:
            return status_from_view(
                broker.view(),
                backend,
                config.slots_per_gpu,
                node_config=config.node_config,
                conditions=[*config_condition, *checks.conditions(), *budget.conditions()],
                policies=broker.pod_policy_states(),
            )

        self._publisher = KVShareNodePublisher(
            api, config.node_name, status, self.metrics, interval_s=config.publish_interval_s
        )
        self._publisher.start()
        self._pods.start()

    def _start_device_plugin(self) -> None:
        try:
            from kvshare.deviceplugin.kubelet.plugin import (
                DeviceWatch,
                GpuMemoryResource,
                GpuSlotResource,
                NodeView,
            )
            from kvshare.deviceplugin.kubelet.registration import PluginManager
        except ImportError as exc:
            # A build without the generated kubelet API stubs: the broker and the metrics
            # still serve (as without a kubelet), but say loudly what is missing.
            log.error("the device plugin is off: %s", exc)
            return

        config = self.config
        assert self.broker is not None and self.inventory is not None
        broker = self.broker

        def free_bytes() -> dict[str, int]:
            return {g.uuid: g.free for g in broker.view().gpus}

        node = NodeView(
            gpus=self.current_gpus,
            free_bytes=free_bytes,
            backend=self.inventory.backend,
            run_dir=str(config.broker_socket.parent),
            broker_socket_name=config.broker_socket.name,
            cdi_kind=config.cdi_kind,
            planned=self._pods.claim if self._pods is not None else None,
        )
        self._watch = DeviceWatch()
        self._plugins = PluginManager(
            config.device_plugin_dir,
            [
                GpuSlotResource(node, config.slots_per_gpu),
                GpuMemoryResource(node, config.headroom),
            ],
            self._watch,
            self.metrics,
        )
        self._plugins.start()

    def stop(self) -> None:
        """Stop every part that started, newest first; removes the plugin and broker
        sockets (pools keep their memory and reconnect to the next agent)."""
        self._stop.set()
        parts = (
            self._plugins,
            self._publisher,
            self._pods,
            self._directory,
            self._checks,
            self._auditor,
            self._budget,
        )
        for part in parts:
            if part is not None:
                part.stop()
        if self._health_thread is not None:
            self._health_thread.join(timeout=10)
        if self.metrics_server is not None:
            self.metrics_server.stop()
        if self.broker is not None:
            self.broker.stop()
        if self.inventory is not None:
            self.inventory.close()
        self._plugins = self._publisher = self._pods = self._checks = self._auditor = None
        self._budget = self._directory = None
        self.metrics_server = None
        self.broker = None
        self.inventory = None

    def _pod_changed(self, kind: str, pod: Any) -> None:
        """A pod of this node changed: the directory reads it again, its annotated KV
        policy (within its namespace's priority ceiling) goes to the broker."""
        from kvshare.deviceplugin.cluster.pod_policies import send_to_broker

        broker, directory = self.broker, self._directory
        if broker is None:
            return
        uid = send_to_broker(broker, kind, pod, self.config.priority_ceilings)
        if directory is not None:
            directory.forget(uid)

    def _config_condition(self) -> list[Condition]:
        """``NodeConfigApplied``, when the settings came from a configuration file."""
        config = self.config
        if config.node_config is None:
            return []
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        problem = config.node_config_problem
        return [
            Condition(
                type="NodeConfigApplied",
                status="False" if problem else "True",
                reason="UnknownConfig" if problem else "ConfigApplied",
                message=problem or f"runs node-agent configuration {config.node_config!r}",
                last_transition_time=now,
            )
        ]

    # --- state --------------------------------------------------------------------------

    def current_gpus(self) -> list[GpuInfo]:
        """The GPUs with their health as last polled."""
        return list(self._gpus)

    def plugin_registered(self) -> dict[str, bool]:
        """Resource -> registered with the kubelet."""
        return self._plugins.registered() if self._plugins is not None else {}

    def _healthy(self) -> tuple[bool, str]:
        broker = self.broker
        if broker is None or not broker.alive:
            return False, "broker loop is not running"
        return True, "ok"

    def _ready(self) -> tuple[bool, str]:
        broker = self.broker
        if broker is None or not broker.alive:
            return False, "broker loop is not running"
        if not broker.ready:
            return False, "waiting for pools to re-declare after a restart"
        return True, "ok"

    def _poll_health(self) -> None:
        while not self._stop.wait(self.config.health_interval_s):
            self.refresh_health()

    def refresh_health(self) -> None:
        """Read GPU health now and report changes to the broker and the kubelet."""
        inventory, broker = self.inventory, self.broker
        if inventory is None or broker is None:
            return
        try:
            gpus = inventory.gpus()
        except Exception:
            log.exception("reading GPU health failed")
            return
        before = {g.uuid: g.healthy for g in self._gpus}
        self._gpus = gpus
        changed = [g for g in gpus if before.get(g.uuid) != g.healthy]
        for gpu in changed:
            broker.set_health(gpu.uuid, gpu.healthy)
            log.warning(
                "GPU %d (%s) is now %s",
                gpu.index,
                gpu.uuid,
                "healthy" if gpu.healthy else "unhealthy",
            )
        if changed and self._watch is not None:
            self._watch.bump()
