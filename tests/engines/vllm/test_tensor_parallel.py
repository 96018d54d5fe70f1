"""vLLM with two TP workers: the scheduler's block pool decides, both workers map its pages.

Two real worker processes build their KV cache through vLLM's ``allocate_kv_cache``
(``tp_worker.py``); this process builds vLLM's ``KVCacheManager`` as the scheduler does,
whose pool owns the group. Requests scheduled here make both workers map the same pages.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from kvshare.api import env
from kvshare.api.engines import SUPPORTED
from kvshare.runtime.engines import pools, vllm_blocks, vllm_common
from kvshare.runtime.engines.activation import activate
from tests.engines.suite import installed_line
from tests.engines.vllm.kv_setup import (
    BLOCK_TOKENS,
    LAYERS,
    LEASE_PAGES,
    PAGE,
    VIRTUAL,
    kv_cache_config,
)
from tests.engines.vllm.test_block_pool import prompt, request

ROOT = Path(__file__).resolve().parents[3]
WORLD_SIZE = 2
_groups = itertools.count()


class Worker:
    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process

    def ask(self, command: str) -> Any:
        stdin: IO[str] = self.process.stdin  # type: ignore[assignment]
        stdout: IO[str] = self.process.stdout  # type: ignore[assignment]
        stdin.write(command + "\n")
        stdin.flush()
        return json.loads(stdout.readline())


@pytest.fixture
def workers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[str, list[Worker]]]:
    if installed_line("vllm") != next(line for line in SUPPORTED if line.engine == "vllm"):
        pytest.skip("the coordinated group is line-neutral: checked on the newest vLLM line")
    settings = {
        env.BACKEND.name: "host",
        env.PAGE_SIZE.name: str(PAGE),
        env.KV_LIMIT.name: str(LEASE_PAGES * len(LAYERS) * PAGE),
        env.RESERVE_PAGES.name: "0",
        env.BROKER_SOCKET.name: str(tmp_path / "no-broker.sock"),
    }
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    group = f"tp{os.getpid()}-{next(_groups)}"
    started = [
        Worker(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.engines.vllm.tp_worker",
                    "--group",
                    group,
                    "--rank",
                    str(rank),
                    "--world-size",
                    str(WORLD_SIZE),
                ],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
        for rank in range(WORLD_SIZE)
    ]
    try:
        for worker in started:
            stdout: IO[str] = worker.process.stdout  # type: ignore[assignment]
            assert stdout.readline().strip() == "ready", "a worker did not start"
        yield group, started
    finally:
        pools.forget_pools()
        for worker in started:
            if worker.process.poll() is None:
                worker.process.communicate("exit\n", timeout=60)


def test_both_workers_map_the_pages_of_the_blocks_the_scheduler_hands_out(
    workers: tuple[str, list[Worker]],
) -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    group, ranks = workers
    activate("vllm")
    config, _, cache_config = kv_cache_config(VIRTUAL)
    with vllm_common.scheduler_context(vllm_common.Group(group, WORLD_SIZE), cache_config):
        manager = KVCacheManager(
            config,
            max_model_len=1024,
            scheduler_block_size=BLOCK_TOKENS,
            hash_block_size=BLOCK_TOKENS,
            enable_caching=True,
        )
    queue = vllm_blocks.queue_of(manager.block_pool)
    assert queue is not None
    assert queue.pool.ownership.mode == "coordinated"
    req = request(prompt(3, 12))
    computed, num_computed, *_ = manager.get_computed_blocks(req)
    assert manager.allocate_slots(req, req.num_tokens, num_computed, computed) is not None
    ids = manager.get_block_ids(req.request_id)[0]
    pages = {queue.pool.geometry.page_of(block) for block in ids} | {0}
    states = [set(worker.ask("state")) for worker in ranks]
    assert states[0] == states[1] == set(queue.pool.mapped_pages())
    assert pages <= states[0]
    for rank, worker in enumerate(ranks):  # each rank's own memory behind the same block
        assert worker.ask(f"write {ids[-1]} {10 + rank}") == "ok"
    assert [worker.ask(f"read {ids[-1]}") for worker in ranks] == [10, 11]
