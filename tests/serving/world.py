"""Two real ``vllm serve`` with kvshare on one fake GPU of a real node agent, shared by the
co-located tests and the fault suite (``test_colocated.py``, ``test_colocated_faults.py``).

``kvshare node --fake-gpus 1x1Gi --headroom 992Mi`` brokers 32 MiB of the GPU's memory;
servers A and B are started at the same moment, each leased by the broker (no KV size
given to vLLM: each sizes its cache for the GPU's 1 GiB, as the agent states it). The
agent is a :class:`~kvshare.demo.serving.agent_process.NodeAgentProcess`: the fault suite
kills, stops and restarts it under the same servers. Every request is checked against the
plain-vLLM reference: same greedy tokens, HTTP 200, full length.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvshare.demo.node_agent import broker_books
from kvshare.demo.serving.agent_process import NodeAgentProcess
from kvshare.demo.serving.faults import FaultWorld
from kvshare.demo.serving.steady_load import Request
from kvshare.demo.serving.vllm_server import VllmServer
from kvshare.deviceplugin.broker.views import PoolView
from tests.serving.conftest import MIB, Ask, long_asks, options, serve_all, tokens

GPU_BYTES = 1024 * MIB
#: What the broker lends: the fake GPU less its headroom (small, so that bursts contend).
BUDGET = 32 * MIB
HEADROOM = GPU_BYTES - BUDGET
EQUAL_SHARE = BUDGET // 2
KV_MIN = 4 * MIB
#: 256 KiB per layer buffer: a page id is 1 MiB of KV (8 blocks) over the 4 layers.
PAGE_SIZE = 256 * 2**10
PAGE_BYTES = 4 * PAGE_SIZE
#: The agent audits every quarter second: an alarm during an ordinary reclaim is seen.
AGENT_ARGS = ("--audit-interval", "0.25")

#: A's burst asks for more than the GPU lends (12 x 36 blocks of 128 KiB = 54 MiB); B's
#: asks for more than what A leaves it (8 x 16 blocks = 16 MiB).
BURST_A = long_asks(seed=11, count=12, prompt=128, output=1024)
BURST_B = long_asks(seed=12, count=8, prompt=128, output=384)
#: Each fits in the minimum alone (29 of its 32 blocks), four do not: after the cut they take turns.
UNDER_THE_CUT = long_asks(seed=13, count=4, prompt=128, output=800)
#: The fault suite's steady load: short requests, a few of them repeated (prefix hits).
STEADY = long_asks(seed=15, count=12, prompt=96, output=48)
#: A burst after recovery: more blocks in use than the whole budget (20 x 13 blocks of
#: 128 KiB = 32.5 MiB), short enough to be over in seconds.
AFTER_BURST = long_asks(seed=16, count=20, prompt=320, output=96)


def pool_env(agent: NodeAgentProcess, pod: str) -> dict[str, str]:
    """What the device plugin and the operator give a model-server pod, no KV size."""
    return {
        "KVSHARE_BROKER_SOCKET": str(agent.broker_socket),
        "KVSHARE_GPU_UUIDS": agent.gpu_uuid,
        "KVSHARE_POD_NAMESPACE": "serving-test",
        "KVSHARE_POD_NAME": pod,
        "KVSHARE_POD_UID": str(uuid.uuid4()),
        "KVSHARE_MODELSERVER": pod,
        "KVSHARE_KV_MIN": str(KV_MIN),
        "KVSHARE_PAGE_SIZE": str(PAGE_SIZE),
        # Growth in steps of 4 pages: the runtime's 256 MiB step is for datacenter GPUs.
        "KVSHARE_LEASE_CHUNK": str(4 * MIB),
        # One ready page ahead: the default four are a few MiB of a GPU's tens of GiB, but
        # half of a server's 8 MiB share once the budget halves (a quiet server would keep
        # asking for them, and being below its share, be given them back at once).
        "KVSHARE_RESERVE_PAGES": "1",
    }


@dataclass
class Colocated:
    agent: NodeAgentProcess
    a: VllmServer
    b: VllmServer
    reference: dict[tuple[int, ...] | str, tuple[int, ...]]
    books: list[tuple[int, int]] = field(default_factory=list)
    """(charged, budget) of the GPU at every snapshot of the agent's metrics."""
    alarms_before: int = 0
    """Over-lease warnings the agent had logged when the current fault scenario began."""
    _stop: threading.Event = field(default_factory=threading.Event)

    def pools(self) -> dict[str, PoolView]:
        """Pool name -> its view, from the agent's admin socket."""
        return {p.name: p for p in self.agent.view().pools}

    def pool(self, server: VllmServer) -> PoolView:
        return self.pools()[pool_name(self, server)]

    def expected(self, asks: Sequence[Ask]) -> list[tuple[int, ...]]:
        return [self.reference[ask.prompt] for ask in asks]

    def fault_world(self) -> FaultWorld:
        """The servers and the steady load, for the fault scenarios (the reference covers
        the load and :func:`bursts`)."""
        steady = requests(STEADY)
        reference = {tuple(a.prompt): self.reference[a.prompt] for a in (*STEADY, *AFTER_BURST)}
        return FaultWorld(
            self.agent,
            {s.name: s for s in (self.a, self.b)},
            steady,
            reference,
            page_bytes=PAGE_BYTES,
        )

    def watch_books(self) -> None:
        """Record the GPU's (charged, budget) from the agent's metrics every 0.1 s."""
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            try:
                text = self.agent.metrics()
            except OSError:
                continue  # the agent is down or restarting (the fault suite)
            self.books.extend((b.charged, b.budget) for b in broker_books(text))

    def close(self) -> None:
        self._stop.set()
        for server in (self.a, self.b):
            server.stop()
        self.agent.stop()


def requests(asks: Sequence[Ask]) -> list[Request]:
    """``asks`` (of token prompts) as the fault scenarios' requests."""
    return [Request(tuple(a.prompt), a.max_tokens) for a in asks]


def pool_name(setup: Colocated, server: VllmServer) -> str:
    (name,) = [p.name for p in setup.agent.view().pools if p.pod == server.name]
    return name


@dataclass
class Launched:
    """The agent and servers A and B, started together and not yet answering."""

    agent: NodeAgentProcess
    servers: list[VllmServer]

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
        self.agent.stop()


def launch_colocated(run_dir: Path, sockets: Path) -> Launched:
    """Start the agent, then servers A and B at the same moment (the broker's turns put
    them in order). Processes are started by the calling thread: the servers' supervisor
    ends them when the thread that started it exits (its parent-death signal)."""
    agent = NodeAgentProcess(
        sockets, run_dir / "node-agent.log", gpu_bytes=GPU_BYTES, headroom=HEADROOM,
        args=AGENT_ARGS,
    )  # fmt: skip
    agent.start()
    servers = [
        VllmServer(
            name,
            options(run_dir, kvshare=True, cpu=cpu, env=pool_env(agent, name)),
            run_dir / f"{name}.log",
        )
        for name, cpu in (("server-a", 0), ("server-b", 1))
    ]
    launched = Launched(agent, [])
    try:
        for server in servers:
            launched.servers.append(server.start())
    except BaseException:
        launched.stop()
        raise
    return launched


def finish_colocated(launched: Launched, native: VllmServer) -> Colocated:
    """The reference tokens from ``native`` while A and B start; then the world, once
    both answer (everything stopped if one does not)."""
    try:
        every = [*BURST_A, *BURST_B, *UNDER_THE_CUT, *STEADY, *AFTER_BURST]
        reference = dict(
            zip((ask.prompt for ask in every), tokens(serve_all(native, every)), strict=True)
        )
        for server in launched.servers:
            server.wait_ready()
    except BaseException:
        launched.stop()
        raise
    a, b = launched.servers
    setup = Colocated(launched.agent, a, b, reference)
    setup.watch_books()
    return setup
