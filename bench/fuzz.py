"""Benchmark ``fuzz``: a live node agent under hostile traffic on its sockets.

A real ``kvshare node`` (fake 2 GiB GPU, host backend) and a real pool process (a KVPool
leased through the broker client, 256 MiB guaranteed and in use); then three attacker
processes run seeded conversations back to back, each on its own connection, while 100
idle connections stay open: random bytes, truncated, oversized and empty frames, text
that is not JSON, deep nesting, hostile identities (surrogates, line breaks, terminal
escapes, look-alikes, over-long names), numbers beyond 64 bits or not numbers, unknown
and repeated fields, wrong first messages, slow senders, bad start-up turn requests,
pools that are admitted and then break the protocol, and garbage on the admin socket
(``tests/deviceplugin/hostile.py``). Every 0.2 s ``/metrics`` is scraped and the books
are read over the admin socket and checked.

Targets: no crash, ``/metrics`` always 200, the books always consistent, no hostile
conversation admitted, none left hanging, the real pool keeps its lease and still grows
afterwards, and the agent logs no traceback.
"""

from __future__ import annotations

import shutil
import signal
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.deviceplugin.conftest import MIB, AgentProcess, PoolProcess  # noqa: E402
from tests.deviceplugin.hostile import campaign  # noqa: E402
from tests.polling import wait_until  # noqa: E402

from harness import Result, Target  # noqa: E402


def run(quick: bool) -> Result:
    seconds = 12.0 if quick else 60.0
    directory = Path(tempfile.mkdtemp(prefix="kvf", dir="/tmp"))
    agent = AgentProcess(directory, "1x2Gi", ["--headroom", "256Mi"])
    pool: PoolProcess | None = None
    try:
        agent.start()
        pool = PoolProcess(
            ["--socket", str(agent.broker_socket), "--gpu", agent.gpus[0].uuid, "--pod", "real",
             "--kv-min", str(256 * MIB), "--priority", "1000"]
        )  # fmt: skip
        pool.demand(256 * MIB)
        wait_until(lambda: pool is not None and pool.status()["used"] == 256 * MIB, 30, "load")
        report = campaign(agent, pool, seconds)
    finally:
        if pool is not None and pool.process.poll() is None:
            pool.kill()
        if agent.process is not None and agent.process.poll() is None:
            agent.stop(signal.SIGKILL)
        shutil.rmtree(directory, ignore_errors=True)
    fields = report.fields()
    kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(report.kinds.items()))
    return Result(
        name="fuzz",
        fields=fields,
        targets=[
            Target("crashes", "<=", 0),
            Target("metrics_failures", "<=", 0),
            Target("books_inconsistencies", "<=", 0),
            Target("hostile_admitted", "<=", 0),
            Target("left_open", "<=", 0),
            Target("pool_kept_lease", ">=", 1),
            Target("pool_grew", ">=", 1),
            Target("agent_tracebacks", "<=", 0),
        ],
        notes=f"3 attacker processes for {seconds:.0f} s against kvshare node (1 fake 2 GiB "
        f"GPU) holding a real pool and 100 idle connections; conversations tried: {kinds}",
    )
