"""A node agent stopped (SIGSTOP: a node hiccup, a debugger, a frozen cgroup) while admin
requests and readiness probes queue on it answers them all within a second of running
again (SIGCONT), and any new one at once. The real agent process, real sockets."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from kvshare.deviceplugin.admin.client import AdminClient
from kvshare.deviceplugin.broker.connections.admin_requests import AdminRequest
from kvshare.deviceplugin.broker.server import Broker, BrokerConfig
from kvshare.deviceplugin.inventory import GpuInfo
from tests.deviceplugin.conftest import AgentProcess

GPU = GpuInfo(uuid="GPU-stop-0", index=0, name="test", total_bytes=2**31)

STOPPED_S = 6.0  # longer than the 5 s the broker loop may go without turning
QUEUED = 16


def test_requests_queued_while_the_agent_is_stopped_are_answered_within_a_second(
    agent_factory: Callable[..., AgentProcess],
) -> None:
    agent = agent_factory("1x2Gi")
    assert agent.process is not None
    answered: dict[str, float] = {}
    lock = threading.Lock()

    def admin(key: str) -> None:
        AdminClient(str(agent.admin_socket), timeout=60).request(AdminRequest(op="list"))
        with lock:
            answered[key] = time.monotonic()

    def ready(key: str) -> None:
        url = f"http://127.0.0.1:{agent.metrics_port}/readyz"
        with urllib.request.urlopen(url, timeout=60) as response:
            assert response.status == 200
        with lock:
            answered[key] = time.monotonic()

    os.kill(agent.process.pid, signal.SIGSTOP)
    try:
        threads = [
            threading.Thread(target=call, args=(f"{call.__name__}-{i}",))
            for i in range(QUEUED)
            for call in (admin, ready)
        ]
        for thread in threads:  # all of them wait on the stopped agent from its start
            thread.start()
        time.sleep(STOPPED_S)
    finally:
        resumed = time.monotonic()
        os.kill(agent.process.pid, signal.SIGCONT)
    admin("fresh-admin")
    ready("fresh-ready")
    for thread in threads:
        thread.join(60)
    assert len(answered) == 2 * QUEUED + 2
    late = {key: round(at - resumed, 2) for key, at in answered.items() if at - resumed > 1.0}
    assert late == {}, f"answered more than a second after SIGCONT: {late}"


def test_a_broker_whose_every_thread_was_stopped_is_alive_as_soon_as_its_loop_turns(
    short_tmp: Path,
) -> None:
    """After SIGCONT every thread of the agent finds the broker loop's last turn as old as
    the stop; a readiness probe answered before the loop turned once must not say the
    loop is stuck. The real broker, its loop on its thread; the stop is its clock."""
    broker = Broker([GPU], BrokerConfig(socket_path=short_tmp / "broker.sock"))
    broker.start()
    try:
        broker._beat -= 6.0  # as if every thread had been stopped for 6 s
        assert broker.alive and broker.ready
    finally:
        broker.stop()
    assert not broker.alive
