"""Step ``lease_enforcement``: the node agent on NVML (no declared GPUs, no cluster) and one
worker whose pool leases from its broker. While the worker holds only its pool, the audit
finds nothing; then the worker allocates 1 GiB of device memory outside its pool, and the
agent must see it (NVML's per-process memory), count it and reclaim the excess from the
worker's lease, within a few audits.

In a dry run there is no NVML: the agent reads the test suite's fake NVML
(``tests/deviceplugin/fake_nvml``), whose per-process figures this step writes itself from
what the worker holds (its static memory and its pool's pages), then with the 1 GiB
added; everything else (the agent, its audit and enforcement, the broker, the worker's
pool) runs for real.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from gpucheck.machine import GIB, MIB, ROOT, Setup

ENTRY = ROOT / "bench" / "gpu_check.py"
#: What the worker grabs outside its pool, and what is not yet overuse.
GRAB = GIB
TOLERANCE = 128 * MIB
AUDIT_S = 0.5
#: A fake GPU for the dry run.
FAKE_GPU = {
    "uuid": "GPU-7c1e2f9a-3b4d-4e5f-8a6b-0c1d2e3f4a5b",
    "name": "dry run",
    "total": 16 * GIB,
}


def overuse_worker(backend_kind: str) -> int:
    """The worker: commands on stdin, one JSON answer a line. ``{"pool": static}`` opens
    its pool (declaring ``static`` bytes) and fills 256 MiB of it; ``{"grab": n}``
    allocates ``n`` bytes of device memory outside the pool; ``{"snapshot": true}``;
    ``{"exit": true}``. It first answers ``{"pid": ...}`` once its device is set up."""
    import torch

    from kvshare.api import env
    from kvshare.runtime.backends import open_backend
    from kvshare.runtime.geometry import KVGeometry
    from kvshare.runtime.leases import lease_from_env
    from kvshare.runtime.pool import KVPool

    device = "cuda" if backend_kind == "cuda" else "cpu"
    torch.zeros(1, device=device)  # the CUDA context: static memory, not the pool's
    out = sys.stdout
    out.write(json.dumps({"pid": os.getpid()}) + "\n")
    out.flush()
    pool: Any = None
    grabbed: list[Any] = []
    try:
        for line in sys.stdin:
            command = json.loads(line)
            if "pool" in command:
                os.environ[env.STATIC_BYTES.name] = str(int(command["pool"]))
                backend = open_backend(backend_kind, 0)  # type: ignore[arg-type]
                page = max(backend.granularity, 2 * MIB)
                geometry = KVGeometry(num_buffers=1, block_bytes=page, num_blocks=512,
                                      page_size=page)  # fmt: skip
                pool = KVPool(geometry, backend, lease_from_env(), lease_chunk_bytes=8 * page)
                _fill(pool, 256 * MIB)
            elif "grab" in command:
                grabbed.append(torch.ones(int(command["grab"]), dtype=torch.uint8, device=device))
            elif "exit" in command:
                break
            snap = pool.snapshot() if pool is not None else None
            answer = {"held": snap.held if snap else 0, "lease": snap.lease if snap else 0}
            out.write(json.dumps(answer) + "\n")
            out.flush()
    finally:
        if pool is not None:
            pool.close()
    return 0


def _fill(pool: Any, at_least: int) -> None:
    deadline = time.monotonic() + 30
    while pool.snapshot().held < at_least and time.monotonic() < deadline:
        if not isinstance(pool.alloc(8), list):
            time.sleep(0.02)


def lease_enforcement(setup: Setup) -> dict[str, Any]:
    """The step; its logs are kept (and named) only when it fails."""
    run_dir = Path(tempfile.mkdtemp(prefix="kvs-gpu-", dir="/tmp"))
    try:
        result = _enforce(setup, run_dir)
    except Exception as exc:
        raise RuntimeError(f"{exc} (logs in {run_dir})") from exc
    if result["ok"]:
        shutil.rmtree(run_dir, ignore_errors=True)
    else:
        result["logs"] = str(run_dir)
    return result


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _metric(port: int, name: str, label: str = "") -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and label in line
    )


def _gpu_uuid(setup: Setup) -> str:
    if setup.dry_run:
        return str(FAKE_GPU["uuid"])
    import pynvml

    pynvml.nvmlInit()
    uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0))
    return uuid.decode() if isinstance(uuid, bytes) else str(uuid)


def _process_memory(pid: int) -> int:
    """What NVML reports for ``pid`` on GPU 0."""
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    return sum(
        int(p.usedGpuMemory or 0)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        if p.pid == pid
    )


def _start_agent(setup: Setup, run_dir: Path, port: int, env: dict[str, str]) -> Any:
    """``kvshare node`` on NVML (the fake one in a dry run), no cluster."""
    agent_env = dict(env)
    if setup.dry_run:
        fake = ROOT / "tests" / "deviceplugin" / "fake_nvml"
        agent_env |= {"PYTHONPATH": f"{fake}{os.pathsep}{ROOT / 'src'}",
                      "KVSHARE_TEST_FAKE_NVML": str(run_dir / "nvml.json")}  # fmt: skip
        (run_dir / "nvml.json").write_text(json.dumps({"gpus": [FAKE_GPU], "processes": {}}))
    broker = run_dir / "pods" / "broker.sock"
    with (run_dir / "agent.log").open("w") as log_file:
        agent = subprocess.Popen(
            [sys.executable, "-m", "kvshare.cli", "node", "--no-kube", "--node-name", "gpu-check",
             "--broker-socket", str(broker), "--admin-dir", str(run_dir / "agent"),
             "--device-plugin-dir", str(run_dir / "dp"), "--metrics-address", f"127.0.0.1:{port}",
             "--audit-interval", str(AUDIT_S), "--overuse-tolerance", f"{TOLERANCE // MIB}Mi"],
            stdout=log_file, stderr=subprocess.STDOUT, env=agent_env, cwd=ROOT,
        )  # fmt: skip
    deadline = time.monotonic() + 60
    while not broker.exists():
        if agent.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the node agent did not start")
        time.sleep(0.1)
    return agent


class _Worker:
    """The worker process, asked one command at a time."""

    def __init__(self, setup: Setup, run_dir: Path, gpu: str, env: dict[str, str]) -> None:
        pool_env = {
            "KVSHARE_BROKER_SOCKET": str(run_dir / "pods" / "broker.sock"),
            "KVSHARE_GPU_UUIDS": gpu, "KVSHARE_POD_NAMESPACE": "gpu-check",
            "KVSHARE_POD_NAME": "worker", "KVSHARE_KV_MAX": str(GIB),
            "KVSHARE_BACKEND": setup.backend,
        }  # fmt: skip
        if not setup.dry_run:
            pool_env["CUDA_VISIBLE_DEVICES"] = gpu
        with (run_dir / "worker.log").open("w") as log_file:
            self.process = subprocess.Popen(
                [sys.executable, str(ENTRY), "--overuse-worker", setup.backend],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file, text=True,
                env={**env, **pool_env},
            )  # fmt: skip
        self.pid = int(self._answer()["pid"])

    def _answer(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("the worker exited")
        return dict(json.loads(line))

    def ask(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            assert self.process.stdin is not None
            self.process.stdin.close()
            self.process.wait(timeout=20)


def _enforce(setup: Setup, run_dir: Path) -> dict[str, Any]:
    gpu = _gpu_uuid(setup)
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHONUNBUFFERED": "1"}
    agent = _start_agent(setup, run_dir, port, env)
    worker: _Worker | None = None
    try:
        worker = _Worker(setup, run_dir, gpu, env)
        # Its static memory: what the device shows for it before its pool (the context).
        static = 256 * MIB if setup.dry_run else _process_memory(worker.pid) + 64 * MIB

        def device(extra: int, held: int) -> None:
            if setup.dry_run and worker is not None:  # what NVML would report for it
                processes = {gpu: {str(worker.pid): static + held + extra}}
                state = {"gpus": [FAKE_GPU], "processes": processes}
                (run_dir / "nvml.json").write_text(json.dumps(state))

        opened = worker.ask({"pool": static})
        device(0, opened["held"])
        time.sleep(4 * AUDIT_S)  # a few audits of a worker within its charge
        within = _metric(port, "kvshare_broker_lease_overuse_total")
        began = time.monotonic()
        device(GRAB, worker.ask({"grab": GRAB})["held"])
        detected_s = None
        while detected_s is None and time.monotonic() - began < 30:
            if _metric(port, "kvshare_broker_lease_overuse_total", 'action="reclaim"') >= 1:
                detected_s = round(time.monotonic() - began, 2)
            time.sleep(0.1)
        time.sleep(1.0)  # the reclaim reaches the worker's pool
        after = worker.ask({"snapshot": True})
        return {
            "static_bytes": static,
            "pool_held_bytes": opened["held"],
            "overuse_within_charge": within,
            "grabbed_bytes": GRAB,
            "detected_s": detected_s,
            "lease_before_bytes": opened["lease"],
            "lease_after_bytes": after["lease"],
            "ok": within == 0 and detected_s is not None and after["lease"] < opened["lease"],
        }
    finally:
        if worker is not None:
            worker.stop()
        agent.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.wait(timeout=30)
