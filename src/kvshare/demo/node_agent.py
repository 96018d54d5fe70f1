"""``kvshare node`` as the demo runs it: one fake GPU, a broker socket, a metrics endpoint.

The orchestrator and the benchmarks talk to the agent only through its real interfaces:
they start the process, hand its socket path to the pools, and read its books from
``/metrics`` (:func:`broker_books`).
"""

from __future__ import annotations

import socket
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

from kvshare.api import names
from kvshare.api.quantity import format_bytes
from kvshare.demo.children import Child, DemoError, spawn, stop_all

__all__ = ["GpuBooks", "NodeAgent", "broker_books", "pick_metrics_port", "scrape"]

GIB = 2**30


def pick_metrics_port(preferred: int) -> tuple[int, bool]:
    """``preferred`` if it is free on this host, else a free port; and whether it moved.

    ``preferred`` 0 asks for any free port (not a move).
    """
    for port in dict.fromkeys((preferred, 0)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("0.0.0.0", port))
            except OSError:
                continue
            chosen: int = probe.getsockname()[1]
            return chosen, preferred not in (0, chosen)
    raise DemoError("no free TCP port for the metrics endpoint")


@dataclass
class NodeAgent:
    """``kvshare node`` with one fake GPU, its broker socket and its metrics endpoint."""

    child: Child
    broker_socket: Path
    metrics_url: str

    @classmethod
    def start(
        cls,
        run_dir: Path,
        gpu_bytes: int,
        metrics_port: int,
        env: dict[str, str],
        policy: str | None = None,
    ) -> NodeAgent:
        run_dir.mkdir(exist_ok=True)
        # The directory pods would mount (the broker socket) and the agent's own (its admin
        # socket and restart file) are apart, as the node agent requires.
        broker = run_dir / "pods" / names.BROKER_SOCKET_NAME
        # The node agent declares fake GPUs of 1 GiB or more: a smaller demo GPU (the real
        # engines' tens of MiB) is a 1 GiB one that keeps the rest back as headroom.
        declared = max(gpu_bytes, GIB)
        argv = [
            sys.executable,
            "-m",
            "kvshare.cli",
            "node",
            "--fake-gpus",
            f"1x{format_bytes(declared)}",
            # All the broker lends is KV memory: the same total as the static partitions.
            "--headroom",
            str(declared - gpu_bytes),
            "--node-name",
            "kvshare-demo",
            "--broker-socket",
            str(broker),
            "--admin-dir",
            str(run_dir / "agent"),
            "--metrics-address",
            f":{metrics_port}",
            # No cluster here: no Kubernetes API, and a kubelet directory nobody serves.
            "--no-kube",
            "--device-plugin-dir",
            str(run_dir / "device-plugins"),
            *(("--broker-policy", policy) if policy else ()),
        ]
        (run_dir / "device-plugins").mkdir(exist_ok=True)
        name = "node agent" + (f" ({policy})" if policy else "")
        child = spawn(name, argv, run_dir / "node.log", env, pipes=False)
        return cls(child, broker, f"http://127.0.0.1:{metrics_port}/metrics")

    def gpu_uuid(self) -> str:
        """The UUID of the agent's (single) fake GPU, as its metrics label it."""
        text = scrape(self.metrics_url)
        books = broker_books(text) if text is not None else []
        if not books:
            raise DemoError(f"the node agent's metrics name no GPU:\n{self.child.log_tail()}")
        return books[0].gpu

    def pool_env(
        self, pod: str, *, kv_max: int, kv_min: int = 0, extra: dict[str, str] | None = None
    ) -> dict[str, str]:
        """The ``KVSHARE_*`` environment of a pool leased by this agent's broker (what the
        operator and the device plugin give a model-server pod), plus ``extra``."""
        return (extra or {}) | {
            "KVSHARE_BROKER_SOCKET": str(self.broker_socket),
            "KVSHARE_GPU_UUIDS": self.gpu_uuid(),
            "KVSHARE_POD_NAMESPACE": "kvshare-demo",
            "KVSHARE_POD_NAME": pod,
            "KVSHARE_POD_UID": str(uuid.uuid4()),
            "KVSHARE_MODELSERVER": pod,
            "KVSHARE_KV_MIN": str(kv_min),
            "KVSHARE_KV_MAX": str(kv_max),
            "KVSHARE_KV_PRIORITY": "100",
            "KVSHARE_STATIC_BYTES": "0",
        }

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.child.process.poll() is not None:
                raise DemoError(
                    f"the node agent exited with status {self.child.process.returncode}:\n"
                    f"{self.child.log_tail()}"
                )
            text = scrape(self.metrics_url) if self.broker_socket.exists() else None
            if text is not None and broker_books(text):
                return
            time.sleep(0.1)
        raise DemoError(f"the node agent did not come up in time:\n{self.child.log_tail()}")

    def stop(self) -> None:
        """SIGTERM, then wait (and terminate or kill when it does not stop)."""
        stop_all([self.child], timeout_s=10.0)


def scrape(url: str, timeout_s: float = 2.0) -> str | None:
    """The metrics text at ``url``, or None when it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body: bytes = response.read()
            return body.decode("utf-8")
    except (urllib.error.URLError, OSError):
        return None


@dataclass(frozen=True)
class GpuBooks:
    """One GPU in the broker's books, from one scrape of its metrics."""

    gpu: str
    charged: int
    """Sum over the GPU's pools of what the broker counts as taken for each (at least the
    lease, and the old lease until a reclaim is acknowledged)."""
    budget: int
    """What the broker may lend: total - headroom - static footprints."""
    overdue: int = 0
    """Reclaims on the GPU so far that missed the broker's deadline."""


def broker_books(text: str) -> list[GpuBooks]:
    """Every GPU of the node agent's metrics text, with its pools' charges summed."""
    from prometheus_client.parser import text_string_to_metric_families

    charged: dict[str, float] = {}
    overdue: dict[str, float] = {}
    gpu_values: dict[str, dict[str, float]] = {}
    wanted = {
        "kvshare_gpu_memory_total_bytes": "total",
        "kvshare_gpu_memory_headroom_bytes": "headroom",
        "kvshare_gpu_memory_static_bytes": "static",
    }
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            gpu = sample.labels.get("gpu", "")
            if sample.name == "kvshare_pool_kv_charged_bytes":
                charged[gpu] = charged.get(gpu, 0.0) + sample.value
            elif sample.name == "kvshare_broker_reclaim_deadline_missed_total":
                overdue[gpu] = overdue.get(gpu, 0.0) + sample.value
            elif sample.name in wanted:
                gpu_values.setdefault(gpu, {})[wanted[sample.name]] = sample.value
    return [
        GpuBooks(
            gpu,
            int(charged.get(gpu, 0)),
            int(v.get("total", 0) - v.get("headroom", 0) - v.get("static", 0)),
            int(overdue.get(gpu, 0)),
        )
        for gpu, v in gpu_values.items()
    ]


# --- the run --------------------------------------------------------------------------
