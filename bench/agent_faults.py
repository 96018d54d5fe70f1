"""Benchmark ``agent-faults``: the node agent's faults under two real ``vllm serve``.

One fake GPU (``kvshare node --fake-gpus 1x1Gi --headroom 992Mi``: 32 MiB to lend), two
servers of the CPU build of vLLM with the generated tiny model leased by the agent, and a
steady load on both (two requests in flight on each, 96 prompt + 48 output tokens, every
answer checked against plain vLLM's tokens). First a quiet minute of that load (the
*baseline*: reclaims made under steady load, the longest request without a fault); then,
each under the same load (:mod:`kvshare.demo.serving.faults`):

- ``killed``: the agent SIGKILLed and started again at once;
- ``stopped``: SIGSTOP for 5 s with admin requests and ``/readyz`` probes queued, SIGCONT;
- ``down``: SIGKILLed and started again 7 s later (longer than the pools' 5 s reports);
- ``smaller``: stopped (SIGTERM) and started on a GPU reported at half its size, with half
  the budget (16 MiB under pools that held up to 32).

Before ``smaller`` both servers serve a burst, so that they hold more than the halved
budget (``smaller_held_mib``). Fields: ``<fault>_recovery_s`` from the fault to every pool
back in the books and the agent ready, ``<fault>_redeclare_s`` the part of it after the
restarted agent answered (the rest is the agent's own start); ``smaller_converge_s`` from
recovery to the charges within the new budget;
``<fault>_longest_request_s`` the longest request in flight during the fault, against
``baseline_longest_request_s``; ``stopped_admin_s`` / ``stopped_ready_s`` from SIGCONT to
an answer; ``ungranted_reclaims`` over the whole run and ``baseline_reclaims`` in the quiet
minute; ``problems`` every request that failed, came back short or differed from plain
vLLM (target 0).
"""

from __future__ import annotations

import random
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

from harness import Result, Target
from kvshare.demo.serving.agent_process import NodeAgentProcess
from kvshare.demo.serving.client import complete
from kvshare.demo.serving.environment import DEFAULT_SERVING
from kvshare.demo.serving.faults import (
    FaultRun,
    FaultWorld,
    agent_frozen,
    agent_restarted,
    fill,
    under_load,
)
from kvshare.demo.serving.steady_load import Request
from kvshare.demo.serving.tiny_model import VOCAB
from kvshare.demo.serving.vllm_server import ServerOptions, VllmServer

MIB = 2**20
GPU_BYTES = 1024 * MIB
HEADROOM = GPU_BYTES - 32 * MIB
PAGE_SIZE = 256 * 2**10
LOGS = Path(__file__).resolve().parents[1] / "out" / "bench" / "agent-faults"


def _requests(seed: int, count: int, prompt: int, output: int) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(tuple(rng.randrange(2, VOCAB) for _ in range(prompt)), output) for _ in range(count)
    ]


def _pool_env(agent: NodeAgentProcess, pod: str) -> dict[str, str]:
    """As ``tests/serving/world.py`` gives its servers (one ready page: see there)."""
    return {
        "KVSHARE_BROKER_SOCKET": str(agent.broker_socket),
        "KVSHARE_GPU_UUIDS": agent.gpu_uuid,
        "KVSHARE_POD_NAMESPACE": "bench",
        "KVSHARE_POD_NAME": pod,
        "KVSHARE_POD_UID": str(uuid.uuid4()),
        "KVSHARE_MODELSERVER": pod,
        "KVSHARE_KV_MIN": str(4 * MIB),
        "KVSHARE_PAGE_SIZE": str(PAGE_SIZE),
        "KVSHARE_LEASE_CHUNK": str(4 * MIB),
        "KVSHARE_RESERVE_PAGES": "1",
    }


def _reference(requests: list[Request], cache: Path) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Plain vLLM's tokens for every request (its own server, stopped before the others)."""
    native = VllmServer(
        "native",
        ServerOptions(kvshare=False, kv_cache_bytes=16 * MIB, cpu_bind="1", cache_root=cache),
        LOGS / "native.log",
    )
    with native:
        native.wait_ready()
        return {r.prompt: complete(native.url, r.prompt, r.max_tokens).token_ids for r in requests}


def _baseline(world: FaultWorld, seconds: float) -> FaultRun:
    """The load alone for ``seconds``: what a fault is compared with."""
    with under_load(world, "baseline") as (_, _, run):
        run.fault_at = time.monotonic()
        time.sleep(seconds)
        run.recovered_at = run.converged_at = time.monotonic()
    return run


def _reclaims(agent: NodeAgentProcess) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in agent.metrics().splitlines()
        if line.startswith("kvshare_broker_reclaims_total{")
    )


def run(quick: bool) -> Result:
    quiet_s = 20.0 if quick else 60.0
    LOGS.mkdir(parents=True, exist_ok=True)
    requests = _requests(15, count=12, prompt=96, output=48)
    # Before `smaller`, both servers grow into the GPU with these (more than its budget).
    bursts = _requests(16, count=20, prompt=320, output=96)
    reference = _reference([*requests, *bursts], LOGS / "vllm-cache")
    sockets = Path(tempfile.mkdtemp(prefix="kvs", dir="/tmp"))  # short unix socket paths
    agent = NodeAgentProcess(
        sockets, LOGS / "node-agent.log", gpu_bytes=GPU_BYTES, headroom=HEADROOM,
        args=["--audit-interval", "0.25"],
    )  # fmt: skip
    servers: dict[str, VllmServer] = {}
    started = time.monotonic()
    try:
        agent.start()
        for name, cpu in (("server-a", 0), ("server-b", 1)):
            options = ServerOptions(
                kvshare=True,
                cpu_bind=str(cpu),
                cache_root=LOGS / "vllm-cache",
                env=_pool_env(agent, name),
            )
            servers[name] = VllmServer(name, options, LOGS / f"{name}.log").start()
        for server in servers.values():
            server.wait_ready()
        world = FaultWorld(agent, servers, requests, reference, page_bytes=4 * PAGE_SIZE)
        problems = fill(world, requests)  # warm: the first requests of a server are slower
        reclaims_before = _reclaims(agent)
        baseline = _baseline(world, quiet_s)
        baseline_reclaims = _reclaims(agent) - reclaims_before
        print(f"  baseline: {baseline_reclaims:.0f} reclaims in {quiet_s:.0f} s", file=sys.stderr)
        killed = agent_restarted(world, "killed", kill=True)
        stopped = agent_frozen(world, stopped_s=5.0)
        down = agent_restarted(world, "down", kill=True, down_s=7.0)
        problems += fill(world, bursts)
        smaller = agent_restarted(
            world, "smaller", kill=False, gpu_bytes=GPU_BYTES // 2, headroom=496 * MIB
        )
        runs: dict[str, FaultRun] = {
            "killed": killed,
            "stopped": stopped,
            "down": down,
            "smaller": smaller,
        }
    finally:
        for server in servers.values():
            server.stop()
        agent.stop()
        shutil.rmtree(sockets, ignore_errors=True)
    fields: dict[str, float | int | str] = {
        "baseline_reclaims": int(baseline_reclaims),
        "baseline_longest_request_s": round(baseline.longest_request_s, 2),
    }
    ungranted = 0.0
    for name, fault in runs.items():
        fields[f"{name}_recovery_s"] = round(fault.recovery_s, 2)
        if name != "stopped":
            fields[f"{name}_redeclare_s"] = round(fault.redeclare_s, 2)
        fields[f"{name}_longest_request_s"] = round(fault.longest_request_s, 2)
        ungranted += fault.ungranted  # each agent counts from its own start
    fields["stopped_admin_s"] = round(stopped.admin_after_s, 3)
    fields["stopped_ready_s"] = round(stopped.ready_after_s, 3)
    fields["stopped_usual_s"] = round(stopped.usual_s, 3)
    fields["smaller_held_mib"] = sum(smaller.leases_at_fault.values()) // MIB
    fields["smaller_converge_s"] = round(smaller.converge_s, 2)
    fields["ungranted_reclaims"] = int(ungranted)
    fields["over_lease_alarms"] = sum(len(f.over_lease()) for f in runs.values())
    fields["problems"] = len(problems) + sum(len(f.problems) for f in (baseline, *runs.values()))
    fields["requests"] = sum(len(f.answers) for f in (baseline, *runs.values()))
    return Result(
        name="agent-faults",
        fields=fields,
        targets=[
            Target("problems", "<=", 0),
            Target("over_lease_alarms", "<=", 0),
            Target("stopped_admin_s", "<=", 1.0),
            Target("stopped_ready_s", "<=", 1.0),
            Target("smaller_converge_s", "<=", 10.0),
        ],
        notes=(
            f"{DEFAULT_SERVING.package} {DEFAULT_SERVING.version}, the tiny Llama, two servers "
            "on one fake GPU lending 32 MiB (16 MiB after `smaller`), two requests of 96 + 48 "
            f"tokens in flight on each; a quiet {quiet_s:.0f} s of that load, then each fault "
            f"under it; wall time {time.monotonic() - started:.0f} s. Logs: out/bench/agent-faults."
        ),
    )
