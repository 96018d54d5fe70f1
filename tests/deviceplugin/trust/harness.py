"""A GPU node with tenants, for the hostile-tenant suite: a live ``kvshare node`` under
Kubernetes, with processes standing in for the pods of several teams.

What is real: the node agent (``kvshare node`` as a subprocess, as the DaemonSet runs it);
its device plugin registered with a kubelet over real gRPC; the kubelet's PodResources
API served over real gRPC (:class:`StandInKubelet`, which records the slots it allocated
to each pod as a kubelet does); the Kubernetes API over real HTTP (kmock's emulator,
:class:`~tests.operator.kube.KubeCluster`); and the pods' processes: each runs in a real
cgroup named as the kubelet names a pod's (``kubepods/besteffort/pod<uid>``) and in a
mount namespace of its own, as a container does. What stands in: the container runtime
(the harness makes the cgroup and the namespace itself) and the kubelet's pod lifecycle
(the harness posts each pod as Running and allocates its slots through the agent's own
device plugin). Making cgroups needs root and a writable cgroup hierarchy: without them
the suite skips and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import kmock

from kvshare.api import names
from kvshare.deviceplugin.broker.views import PoolView
from kvshare.deviceplugin.inventory import GpuInfo
from kvshare.deviceplugin.kubelet.kubelet_standin import StandInKubelet
from kvshare.deviceplugin.kubelet.slots import split_id
from tests.deviceplugin.conftest import ROOT, AgentProcess, PoolProcess
from tests.operator.harness import write_kubeconfig
from tests.operator.kube import ApiCall, KubeCluster, declare_resources
from tests.polling import wait_until

NODE = "gpu-node-1"
GIB = 2**30
MIB = 2**20
_CLONE_NEWNS = 0x00020000


def _cgroup_mounts() -> list[Path]:
    """Mount points of the cgroup hierarchies, the unified one first."""
    found: list[tuple[int, Path]] = []
    with open("/proc/self/mountinfo", encoding="utf-8") as mounts:
        for line in mounts:
            fields = line.split()
            fstype = fields[fields.index("-") + 1]
            if fstype == "cgroup2":
                found.append((0, Path(fields[4])))
            elif fstype == "cgroup" and "pids" in fields[-1].split(","):
                found.append((1, Path(fields[4])))
    return [path for _, path in sorted(found)]


def pod_cgroup_root() -> Path | None:
    """A cgroup hierarchy where pod cgroups can be made (and processes moved), or None."""
    if os.geteuid() != 0:
        return None
    for mount in _cgroup_mounts():
        probe = mount / "kubepods" / "besteffort" / f"pod{uuid.uuid4()}"
        try:
            probe.mkdir(parents=True)
            probe.rmdir()
        except OSError:
            continue
        return mount / "kubepods" / "besteffort"
    return None


def _unshare_mount_namespace() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")


def entering(cgroup: Path) -> Callable[[], None]:
    """A preexec function: the child joins the pod cgroup ``cgroup`` and takes a mount
    namespace of its own, as a container's process does."""

    def enter() -> None:
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))
        _unshare_mount_namespace()

    return enter


@attrs.define(kw_only=True)
class NodeCluster(KubeCluster):
    """The emulated API, with the Eviction API a node agent uses: an eviction (no
    PodDisruptionBudget here) deletes the pod, as the API server does."""

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if request.subresource == "eviction" and request.method == kmock.method.POST:
            call = ApiCall("create", "", "pods/eviction", request.namespace, request.name,
                           request.headers.get("User-Agent", ""), time.monotonic())  # fmt: skip
            self.api_calls.append(call)
            deletion = attrs.evolve(
                request, method=kmock.method.DELETE, action=kmock.action.DELETE,
                subresource=None, data=None,
            )  # fmt: skip
            await super()._handle(deletion)
            return aiohttp.web.json_response(
                {"apiVersion": "v1", "kind": "Status", "status": "Success"}, status=201
            )
        return await super()._handle(request)


class Cluster:
    """kmock's emulator over HTTP on a thread of its own."""

    def __init__(self) -> None:
        self.kube = NodeCluster()
        declare_resources(self.kube)
        self.url = ""
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._stopped: asyncio.Event | None = None
        self._thread = threading.Thread(
            target=self._loop.run_until_complete, args=(self._serve(),), daemon=True
        )

    async def _serve(self) -> None:
        self._stopped = asyncio.Event()
        async with self.kube, kmock.Server(self.kube) as server:
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stopped.wait()

    def start(self) -> None:
        self._thread.start()
        assert self._ready.wait(30)

    def stop(self) -> None:
        if self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
        self._thread.join(30)

    def request(self, method: str, path: str, body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/merge-patch+json" if method == "PATCH"
                   else "application/json"}  # fmt: skip
        request = urllib.request.Request(self.url + path, data, headers, method=method)
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read() or b"null")

    def events(self) -> list[dict[str, Any]]:
        return [
            obj.raw
            for (res, _, _), obj in list(self.kube.objects.items())
            if res == kmock.resource("v1/events") and not obj.deleted
        ]


@dataclass
class Pod:
    """A pod of a tenant: its object in the API, its slots, its cgroup."""

    node: GpuNode
    namespace: str
    name: str
    uid: str
    gpus: list[str]
    cgroup: Path

    def enter(self) -> None:
        """Run in a child process before it starts: join the pod's cgroup and take a
        mount namespace of its own, as a container's process does."""
        entering(self.cgroup)()

    def run(self, *args: str) -> subprocess.Popen[str]:
        """A process of this pod: ``python -m tests.deviceplugin.trust.tenant ARGS``."""
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.deviceplugin.trust.tenant", *args],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, preexec_fn=self.enter,  # noqa: PLW1509 - cgroup and namespace only
        )  # fmt: skip
        self.node.processes.append(process)
        return process

    def ask(self, *args: str, timeout: float = 60.0) -> dict[str, Any]:
        """Run a tenant command that answers with one JSON line and exits."""
        process = self.run(*args)
        out, err = process.communicate(timeout=timeout)
        lines = out.strip().splitlines()
        assert lines, f"tenant {args[0]} printed nothing: {err}"
        return dict(json.loads(lines[-1]))

    def hold(self, *args: str, timeout: float = 60.0) -> tuple[subprocess.Popen[str], Any]:
        """Run a tenant command that answers with one JSON line and holds what it opened
        until the test ends."""
        process = self.run(*args)
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line, f"tenant {args[0]} died: {process.stderr.read() if process.stderr else ''}"
        return process, json.loads(line)

    @staticmethod
    def release(process: subprocess.Popen[str]) -> None:
        """End a held command and every process it forked (they wait for stdin's end)."""
        if process.stdin is not None:
            process.stdin.close()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)

    def frames(self, *bodies: dict[str, Any], wait: float = 5.0) -> dict[str, Any]:
        """Send ``bodies`` on one connection to the broker; the replies."""
        return self.ask("frames", str(self.node.agent.broker_socket), json.dumps(bodies),
                        "--wait", str(wait))  # fmt: skip

    def hello(self, **fields: Any) -> dict[str, Any]:
        """A hello's body as this pod's runtime would send it, with ``fields`` replaced."""
        body = {
            "type": "hello", "version": 1, "gpu": self.gpus[0], "page_size": 2 * MIB,
            "kv_min": 0, "kv_max": None, "priority": 100, "static": 0,
            "namespace": self.namespace, "pod": self.name, "pod_uid": self.uid,
            "modelserver": "", "rank": 0, "tp_size": 1, "engine": "vllm",
        }  # fmt: skip
        return {**body, **fields}

    def pool(self, **options: Any) -> PoolProcess:
        """A real KV pool (host backend) in this pod, leased from the agent."""
        args = [
            "--socket", str(self.node.agent.broker_socket), "--gpu", self.gpus[0],
            "--pod", self.name, "--pod-uid", self.uid, "--namespace", self.namespace,
        ]  # fmt: skip
        for key, value in options.items():
            args += [f"--{key.replace('_', '-')}", str(value)]
        pool = PoolProcess(args, preexec_fn=self.enter)
        self.node.pools.append(pool)
        return pool


class GpuNode:
    """The node: the API, the kubelet, the agent, and the pods made on it."""

    def __init__(
        self,
        directory: Path,
        cgroups: Path,
        agent_flags: list[str],
        *,
        agent_wrapper: Sequence[str] = (),
        fake_gpus: str = "2x8Gi",
        nvml: list[GpuInfo] | None = None,
    ) -> None:
        """``nvml``: the GPUs of a fake NVML the agent reads instead of ``fake_gpus``
        (:mod:`tests.deviceplugin.fake_nvml.pynvml`); :meth:`set_device_memory` sets what
        it reports per process."""
        self.directory = directory
        self.cgroups = cgroups
        self.cluster = Cluster()
        self.kubelet = StandInKubelet(
            directory / "dp", pod_resources_socket=directory / "pr" / "kubelet.sock"
        )
        self._flags = agent_flags
        self._wrapper = agent_wrapper
        self._fake_gpus = fake_gpus
        self._nvml = nvml
        self._nvml_state = directory / "nvml.json"
        self.agent: AgentProcess
        self.pods: list[Pod] = []
        self.processes: list[subprocess.Popen[str]] = []
        self.pools: list[PoolProcess] = []
        self._allocated: set[str] = set()

    def start(self) -> None:
        self.cluster.start()
        self.cluster.request("POST", "/api/v1/nodes", {"metadata": {"name": NODE}})
        self.kubelet.start()
        kubeconfig = write_kubeconfig(self.directory / "kubeconfig", self.cluster.url)
        environment = None
        if self._nvml is not None:
            self.set_device_memory({})
            fake = str(Path(__file__).resolve().parents[1] / "fake_nvml")
            path = os.pathsep.join([fake, os.environ.get("PYTHONPATH", "")])
            environment = {
                **os.environ,
                "KVSHARE_TEST_FAKE_NVML": str(self._nvml_state),
                "PYTHONPATH": path,
            }
        self.agent = AgentProcess(
            self.directory,
            None if self._nvml is not None else self._fake_gpus,
            ["--device-plugin-dir", str(self.directory / "dp"),
             "--pod-resources-socket", str(self.directory / "pr" / "kubelet.sock"),
             "--publish-interval", "0.5", *self._flags],
            node_name=NODE,
            kubeconfig=kubeconfig,
            wrapper=self._wrapper,
            env=environment,
        )  # fmt: skip
        if self._nvml is not None:
            self.agent.gpus = list(self._nvml)
        self.agent.start()
        assert self.kubelet.wait_registered(names.RESOURCE_GPU, timeout=60)

    def set_device_memory(self, held: dict[tuple[str, int], int]) -> None:
        """What the fake NVML reports: device bytes by (GPU UUID, pid)."""
        assert self._nvml is not None
        processes: dict[str, dict[str, int]] = {}
        for (gpu, pid), nbytes in held.items():
            processes.setdefault(gpu, {})[str(pid)] = nbytes
        state = {
            "gpus": [{"uuid": g.uuid, "name": g.name, "total": g.total_bytes} for g in self._nvml],
            "processes": processes,
        }
        temporary = self._nvml_state.with_suffix(".tmp")
        temporary.write_text(json.dumps(state), encoding="utf-8")
        os.replace(temporary, self._nvml_state)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait(30)
        for pool in self.pools:
            if pool.process.poll() is None:
                pool.process.kill()
                pool.process.wait(30)
        if self.agent.process is not None and self.agent.process.poll() is None:
            self.agent.stop()
        self.kubelet.stop()
        self.cluster.stop()
        for pod in self.pods:
            with contextlib.suppress(OSError):
                pod.cgroup.rmdir()

    def pod(self, name: str, namespace: str = "team-a", *, gpus: int = 1,
            memory_gib: int = 4, modelserver: str = "") -> Pod:  # fmt: skip
        """A Running pod of this node with ``gpus`` slots (on distinct GPUs) and
        ``memory_gib`` units of ``kvshare.io/gpu-memory``, known to the agent."""
        amounts = {names.RESOURCE_GPU: str(gpus), names.RESOURCE_GPU_MEMORY: str(memory_gib)}
        labels = {names.LABEL_MODELSERVER: modelserver} if modelserver else {}
        body = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "spec": {"nodeName": NODE, "containers": [{
                "name": "engine", "image": "engine:1",
                "resources": {"requests": amounts, "limits": amounts},
            }]},
            "status": {"phase": "Running"},
        }  # fmt: skip
        created = self.cluster.request("POST", f"/api/v1/namespaces/{namespace}/pods", body)
        uid = created["metadata"]["uid"]
        free = sorted(set(self.kubelet.healthy(names.RESOURCE_GPU)) - self._allocated)
        slots = self.kubelet.preferred(names.RESOURCE_GPU, free, [], gpus)
        self.kubelet.allocate(names.RESOURCE_GPU, slots, pod=(namespace, name, "engine"))
        self._allocated.update(slots)
        cgroup = self.cgroups / f"pod{uid}"
        cgroup.mkdir(parents=True)
        pod = Pod(self, namespace, name, uid, [split_id(s)[0] for s in slots], cgroup)
        self.pods.append(pod)
        return pod

    # --- what the tests look at -------------------------------------------------------

    def pool_view(self, name: str) -> PoolView:
        pools = self.agent.pools()
        assert name in pools, f"no pool {name}: {sorted(pools)}"
        return pools[name]

    def metric_lines(self, needle: str) -> list[str]:
        return sorted(line for line in self.agent.metrics().splitlines() if needle in line)

    def refusals(self, reason: str) -> float:
        """``kvshare_broker_trust_refusals_total{reason}``."""
        prefix = f'kvshare_broker_trust_refusals_total{{reason="{reason}"}}'
        lines = [line for line in self.agent.metrics().splitlines() if line.startswith(prefix)]
        return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


@dataclass(frozen=True)
class Victim:
    """Another tenant's pool whose lease, metrics and status must not move."""

    node: GpuNode
    pod: Pod
    pool: PoolProcess

    def snapshot(self) -> tuple[Any, ...]:
        view = self.node.pool_view(self.pool.name)
        shown = (view.namespace, view.pod, view.pod_uid, view.modelserver, view.priority,
                 view.kv_min, view.kv_max, view.lease, view.static, view.gpu)  # fmt: skip
        series = [line.rsplit(" ", 1)[0] + " " + line.rsplit(" ", 1)[1]
                  for line in self.node.metric_lines(f'pod="{self.pod.name}"')
                  if "_age" not in line]  # fmt: skip
        return shown, tuple(series), self._published()

    def _published(self) -> Any:
        """The victim's entry in the KVShareNode the agent publishes."""
        try:
            node = self.node.cluster.request(
                "GET", f"/apis/{names.GROUP}/{names.VERSION}/kvsharenodes/{NODE}"
            )
        except urllib.error.HTTPError:
            return None
        for gpu in (node.get("status") or {}).get("gpus", []):
            for pool in gpu.get("pools", []):
                if pool.get("pod") == self.pod.name:
                    return {k: v for k, v in pool.items() if k not in ("age", "mapped", "used")}
        return None


def victim(node: GpuNode, memory_gib: int = 4) -> Victim:
    """Team B's pool that every test watches for side effects: its lease is its minimum
    and its cap (nothing lends it more or takes any back), half of it in use."""
    pod = node.pod("victim", "team-b", memory_gib=memory_gib, modelserver="steady")
    pool = pod.pool(kv_min=GIB, kv_max=GIB, static=GIB, modelserver="steady")
    assert pool.error is None, pool.error
    pool.demand(GIB // 2)
    steady = Victim(node, pod, pool)
    wait_until(lambda: pool.status()["used"] == GIB // 2, what="the victim's blocks")
    wait_until(lambda: steady._published() is not None, what="its status")
    audited = lambda: node.pool_view(pool.name).device_bytes is not None  # noqa: E731
    wait_until(audited, what="the victim's first audit")
    last: list[Any] = [None]

    def settled() -> bool:  # two audits (and scrapes) in a row see the same
        now, last[0] = last[0], steady.snapshot()
        return now == last[0]

    wait_until(settled, what="the victim to settle")
    return steady


def open_files_limit(limit: int) -> list[str]:
    """A command prefix that runs a program with its open-files limit at ``limit`` (set by
    ``prlimit`` after the fork: Python code between fork and exec is unsafe in a process
    whose other threads serve gRPC, and once aborted an agent starting here)."""
    return ["prlimit", f"--nofile={limit}:{limit}", "--"]


@contextlib.contextmanager
def short_directory() -> Iterator[Path]:
    """A short directory for the node's unix sockets (paths stay under 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="kvt", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def node_fixture(directory: Path, cgroups: Path, *flags: str, **options: Any) -> Iterator[GpuNode]:
    """Start a node with the agent's ``flags``; stop it afterwards."""
    node = GpuNode(directory, cgroups, list(flags), **options)
    try:
        node.start()
        yield node
    finally:
        node.stop()
