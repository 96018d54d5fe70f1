"""A short fuzz run over real sockets: hostile and random conversations from three
attacker processes against a live ``kvshare node`` while a real pool holds memory."""

from __future__ import annotations

import re
from collections.abc import Callable

from .conftest import MIB, AgentProcess, PoolProcess, wait_until
from .hostile import campaign

#: Long enough to try every kind of conversation hundreds of times (~10,000 messages here).
SECONDS = 12.0


def test_a_live_agent_under_fuzz_stays_up_consistent_and_keeps_a_real_pools_lease(
    agent_factory: Callable[..., AgentProcess], pool_factory: Callable[..., PoolProcess]
) -> None:
    agent = agent_factory("1x2Gi", "--headroom", "256Mi")
    pool = pool_factory(agent, "real", kv_min=256 * MIB, priority=1000)
    pool.demand(256 * MIB)
    wait_until(lambda: pool.status()["used"] == 256 * MIB, what="the real pool's load")
    report = campaign(agent, pool, SECONDS)
    fields = report.fields()
    assert fields["crashes"] == 0, "".join(agent.log[-40:])
    assert fields["kinds_tried"] == 15 and fields["messages_sent"] > 500, fields
    assert report.hostile_admitted == [] and report.left_open == [], fields
    assert fields["metrics_failures"] == 0 and fields["scrapes"] > 10, fields
    assert report.books_problems == []
    # What the run added is counters of fixed reasons per inventoried GPU (a bounded set),
    # never a series of a pool that left or a label value an attacker chose.
    gpu_labels = {f'gpu="{agent.gpus[0].uuid}"', 'gpu=""'}
    for name in report.new_series:
        assert "pod=" not in name or 'pod="real"' in name, name
        assert not re.search(r"gpu=", name) or any(g in name for g in gpu_labels), name
    assert len(report.new_series) <= 64, report.new_series
    assert fields["pool_kept_lease"] and fields["pool_grew"], fields
    assert fields["agent_tracebacks"] == 0, "".join(agent.log[-40:])
