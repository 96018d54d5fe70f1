"""An agent out of open files keeps serving: connections stop at what its open-files limit
allows (with files to spare for ``/metrics``, the kubelet and the pools' pidfds), the rest
are told so, and nothing spins or floods the log. Under Kubernetes with pods as tenants,
and without it (``--no-kube``) where every process is one."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.deviceplugin.conftest import ROOT, AgentProcess
from tests.deviceplugin.trust.harness import (
    GpuNode,
    node_fixture,
    open_files_limit,
    short_directory,
    victim,
)

#: 160 open files: (160 - 64) / 2 = 48 broker connections, the rest kept for the others.
FILES = 160
CAP = (FILES - 64) // 2


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks


def _under_attack(
    agent: AgentProcess, attack: Callable[[], list[subprocess.Popen[str]]]
) -> list[str]:
    """Run ``attack`` (idle connections beyond the open-files limit) for 3 s: /metrics must
    answer, the agent must not spin; the lines it logged meanwhile."""
    assert agent.process is not None
    pid = agent.process.pid
    lines, cpu = len(agent.log), _cpu_seconds(pid)
    holders = attack()
    try:
        time.sleep(3.0)  # the attack goes on; before the fix the loop spun here
        url = f"http://127.0.0.1:{agent.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            assert response.status == 200
        assert _cpu_seconds(pid) - cpu < 2.0  # no busy loop over an unacceptable socket
    finally:
        for holder in holders:
            if holder.stdin is not None:
                holder.stdin.close()
            holder.wait(30)
    logged = agent.log[lines:]
    assert len(logged) < 40, "".join(logged[-20:])
    return logged


@pytest.fixture
def cramped_node(cgroups: Path) -> Iterator[GpuNode]:
    with short_directory() as directory:
        yield from node_fixture(directory, cgroups, agent_wrapper=open_files_limit(FILES))


def test_out_of_files_under_kubernetes_the_agent_serves_and_logs_a_bounded_number_of_lines(
    cramped_node: GpuNode,
) -> None:
    node = cramped_node
    steady = victim(node)
    before = steady.snapshot()

    def attack() -> list[subprocess.Popen[str]]:  # three pods, 60 idle connections each
        pods = [node.pod(f"hog-{index}", "team-c") for index in range(3)]
        return [p.hold("connect", str(node.agent.broker_socket), "60", "--wait", "0.5")[0]
                for p in pods]  # fmt: skip

    logged = _under_attack(node.agent, attack)
    assert any(f"serves at most {CAP} connections" in line for line in logged), logged[-5:]
    assert node.refusals("limit") >= 180 - CAP
    assert steady.snapshot() == before


IDLE = """
import socket, sys
held = []
for _ in range(int(sys.argv[2])):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(sys.argv[1])
    held.append(sock)
print("held", flush=True)
sys.stdin.read()
"""


def test_out_of_files_without_kubernetes_the_agent_serves_and_logs_a_bounded_number_of_lines(
    short_tmp: Path,
) -> None:
    agent = AgentProcess(short_tmp, "1x8Gi", [], wrapper=open_files_limit(FILES))
    agent.start()
    try:

        def attack() -> list[subprocess.Popen[str]]:  # three processes, 60 idle each
            command = [sys.executable, "-c", IDLE, str(agent.broker_socket), "60"]
            pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE}
            holders = [
                subprocess.Popen(command, cwd=ROOT, text=True, **pipes)  # type: ignore[call-overload]
                for _ in range(3)
            ]
            for holder in holders:
                assert holder.stdout is not None and holder.stdout.readline() == "held\n"
            return holders

        logged = _under_attack(agent, attack)
        assert any(f"serves at most {CAP} connections" in line for line in logged), logged[-5:]
        assert agent.view().pools == []  # and the admin socket still answers
    finally:
        agent.stop()
