"""Benchmark ``deviceplugin``: Allocate and GetPreferredAllocation through real gRPC.

The node agent (2 fake GPUs, device plugin on a unix socket) is registered with the
stand-in kubelet (:mod:`kvshare.deviceplugin.kubelet.kubelet_standin`), which then calls the
plugin the way the kubelet does at pod admission: ``GetPreferredAllocation`` for 2 of the
available slots, then ``Allocate`` for them. ``allocate_p50_ms`` is the median round
trip of ``Allocate`` as the kubelet sees it. ``reregister_s``: the kubelet restarts
(deleting every socket in the directory) and the plugin serves and registers again.
"""

from __future__ import annotations

import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from harness import Result, Target, percentile
from kvshare.api import names
from kvshare.deviceplugin.agent import AgentConfig, NodeAgent
from kvshare.deviceplugin.kubelet.kubelet_standin import StandInKubelet

SLOTS = names.RESOURCE_GPU


def run(quick: bool) -> Result:
    calls = 200 if quick else 1000
    logging.getLogger("kvshare").setLevel(logging.WARNING)
    directory = Path(tempfile.mkdtemp(prefix="kvd", dir="/tmp"))
    kubelet = StandInKubelet(directory / "dp")
    kubelet.start()
    agent = NodeAgent(
        AgentConfig.for_broker(
            "bench",
            directory / "run" / "broker.sock",
            admin_dir=directory / "admin",
            fake_gpus="2x80Gi",
            device_plugin_dir=directory / "dp",
            metrics_host="127.0.0.1",
            metrics_port=0,
            use_kube=False,
        )
    )
    agent.start()
    try:
        if not kubelet.wait_registered(SLOTS):
            raise RuntimeError("the device plugin did not register with the stand-in kubelet")
        available = sorted(kubelet.devices(SLOTS))
        allocate_ms, preferred_ms = [], []
        for i in range(calls + 20):
            start = time.perf_counter()
            chosen = kubelet.preferred(SLOTS, available, [], 2)
            middle = time.perf_counter()
            kubelet.allocate(SLOTS, chosen)
            end = time.perf_counter()
            if i >= 20:  # warm-up: channels, thread pools
                preferred_ms.append((middle - start) * 1e3)
                allocate_ms.append((end - middle) * 1e3)
        reregister = []
        for count in range(2, 5):
            restarted = time.monotonic()
            kubelet.restart()
            registered = kubelet.wait_registered(SLOTS, count=count) and kubelet.wait_registered(
                names.RESOURCE_GPU_MEMORY, count=count
            )
            if not registered:
                raise RuntimeError("the device plugin did not register again")
            reregister.append(max(t for _, t in kubelet.registrations) - restarted)
    finally:
        agent.stop()
        kubelet.stop()
        shutil.rmtree(directory, ignore_errors=True)
    return Result(
        name="deviceplugin",
        fields={
            "calls": calls,
            "allocate_p50_ms": round(statistics.median(allocate_ms), 3),
            "allocate_p99_ms": round(percentile(allocate_ms, 99), 3),
            "preferred_p50_ms": round(statistics.median(preferred_ms), 3),
            "reregister_s": round(max(reregister), 2),
        },
        targets=[Target("allocate_p50_ms", "<=", 2.0), Target("reregister_s", "<=", 5.0)],
        notes="stand-in kubelet and plugin in one process, gRPC over unix sockets; "
        "reregister_s is the worst of 3 kubelet restarts",
    )
