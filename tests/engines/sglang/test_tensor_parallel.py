"""SGLang with two TP ranks: each rank owns its pool, none maps another's page 0, and
the ranks stay in step though their GPUs lend them different amounts.

The scenario of the review thread on SGLang TP ownership: SGLang builds and drives a KV
pool independently in every TP worker; a pool that turned the real TP size into
broadcasts made every peer map its already-mapped page 0 a second time. Here two real
processes join a real SGLang TP group and build their KV cache through SGLang's classes
in the configurator's order (``tp_rank.py``); each reports its map calls.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvshare.api import env

ROOT = Path(__file__).resolve().parents[3]
WORLD_SIZE = 2
TIMEOUT_S = 300


PAGE_BYTES = 4 * 64 * 2**10  # one logical page: 2 layers x K/V x 64 KiB
LEASES = (6 * PAGE_BYTES, 4 * PAGE_BYTES)  # the ranks' GPUs lend different amounts


def rank_environment(rank: int, tmp_path: Path) -> dict[str, str]:
    environ = dict(os.environ)
    environ.update(
        {
            env.BACKEND.name: "host",
            env.PAGE_SIZE.name: str(64 * 2**10),
            env.KV_LIMIT.name: str(LEASES[rank]),
            env.RESERVE_PAGES.name: "0",
            env.BROKER_SOCKET.name: str(tmp_path / "no-broker.sock"),
        }
    )
    return environ


def test_each_rank_maps_its_own_page_zero_once_and_keeps_the_real_tp_size(tmp_path: Path) -> None:
    init_method = f"file://{tmp_path / 'tp-store'}"
    ranks = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.engines.sglang.tp_rank",
                "--rank",
                str(rank),
                "--world-size",
                str(WORLD_SIZE),
                "--init-method",
                init_method,
            ],
            cwd=ROOT,
            env=rank_environment(rank, tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(WORLD_SIZE)
    ]
    reports = []
    for process in ranks:
        out, err = process.communicate(timeout=TIMEOUT_S)
        assert process.returncode == 0, err[-4000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    for rank, report in enumerate(reports):
        assert report["rank"] == rank
        assert report["world_size"] == WORLD_SIZE == report["engine_tp_size"]
        assert report["mode"] == "local"
        assert report["page0_maps"] == [1] * len(report["page0_maps"])  # once per buffer
        assert report["duplicate_maps"] == 0
        assert report["in_step_with_peers"]
        assert report["own_lease"] == LEASES[rank]
        assert report["agreed_lease"] == min(LEASES)  # both ranks hold the smaller lease
    assert reports[0]["decisions"] == reports[1]["decisions"]
    assert None in reports[0]["decisions"]  # both said "no space" at the same iteration
    assert reports[0]["mapped_pages"] == reports[1]["mapped_pages"]
    assert reports[0]["used_blocks"] == reports[1]["used_blocks"] > 0
