"""vLLM's own KV-cache manager, block pool and scheduler tests, from this line's source
distribution, pass on kvshare's pools (block-outer and per-layer pages).

``make engines`` unpacks the tests (``tools/peer_tests.py``); they run in a pytest of their
own (vLLM's ``tests`` package cannot share a process with this one), with the plugin
``peer/kvshare_peer.py`` standing in for vLLM's conftest and a GPU and putting a kvshare
pool under every block pool the tests build. The run must pass, run enough tests, and
the pools must have served blocks.

Each test below is left out because it cannot pass on kvshare's pool by design; every
other difference from plain vLLM was a defect and is fixed (a pool emptied during a step
counted fewer free blocks than vLLM had freed: ``tests/runtime/test_pages_in_flight.py``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tools import engine_env, peer_tests

from kvshare.api.engines import SUPPORTED, SupportedLine
from tests.engines.suite import installed_line

PEER = Path(__file__).resolve().parent / "peer"

#: Test name -> why it cannot pass on kvshare's pool. Names a line lacks are ignored.
BY_DESIGN = {
    **dict.fromkeys(
        ("test_prefill", "test_prefill_plp", "test_evict"),
        "asserts the order of vLLM's free list (get_all_free_blocks): with kvshare it holds "
        "only the blocks vLLM keeps at reference count 0 (prefix-cached); the other free "
        "blocks are free in the pool, where their pages can be unmapped",
    ),
    "test_swa_free_split_keeps_cached_tail_ahead_of_scratch": (
        "asserts that scratch blocks come before retained ones in vLLM's free list: with "
        "kvshare the scratch blocks go back to the pool (handed out first) and only the "
        "retained ones are in the list"
    ),
    **dict.fromkeys(
        (
            "test_cache_hit_local_and_external",
            "test_cache_hit_local_and_external_three_groups",
            "test_cache_hit_local_and_external_three_groups_preempt_and_reallocate",
            "test_cache_hit_local_and_external_two_groups_preempt_and_reallocate",
        ),
        "takes blocks from the head of vLLM's linked free list (fake_free_list_head) to "
        "stand in for evictable cached blocks: kvshare's queue has no such list",
    ),
    "test_hisparse_teardown_with_live_request_frees_pools": (
        "asserts the block pool is garbage as soon as its manager is: kvshare's pool holds "
        "it (its evictor) until the engine shuts down (pools.forget_pools)"
    ),
    **dict.fromkeys(
        (
            "test_async_scheduling_pp_allows_rescheduling_with_output_placeholders",
            "test_diffusion_read_deferral_keeps_a_longer_pp_wait",
            "test_max_loras_counts_running_request_awaiting_output",
        ),
        "builds a scheduler with pipeline parallelism: kvshare serves pipeline-parallel "
        "size 1 and says so at start-up",
    ),
}
#: What runs per page layout: every file on block-outer pages (the default); on per-layer
#: pages the KV cache manager's and the preemption tests, on the newest line only (the
#: pool's side of per-layer pages is the same on every line, and each run costs 15-60 s).
RUNS = {
    "block-outer": ("tests/v1/core",),
    "per-layer": (
        "tests/v1/core/test_prefix_caching.py",
        "tests/v1/core/test_single_type_kv_cache_manager.py",
        "tests/v1/core/test_priority_preemption_bug.py",
    ),
}
#: Fewest tests each run must pass (300 on the oldest line's block-outer run, 173 there on
#: per-layer pages).
LEAST_PASSED = {"block-outer": 280, "per-layer": 160}


def _hub_cache(directory: Path) -> Path:
    """A Hugging Face cache holding the configs (only) of the models the tests name."""
    models = json.loads((PEER / "hub_models.json").read_text(encoding="utf-8"))
    for name, config in models.items():
        repository = directory / "hub" / f"models--{name.replace('/', '--')}"
        (repository / "refs").mkdir(parents=True)
        (repository / "refs" / "main").write_text("local", encoding="utf-8")
        snapshot = repository / "snapshots" / "local"
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


NEWEST = next(line for line in SUPPORTED if line.engine == "vllm")
LAYOUTS = list(RUNS) if installed_line("vllm") == NEWEST else ["block-outer"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_vllms_own_kv_cache_and_scheduler_tests_pass_on_kvshare_pools(
    line: SupportedLine, layout: str, tmp_path: Path
) -> None:
    root = peer_tests.directory(engine_env.ENGINES_DIR, line)
    if not peer_tests.is_fetched(engine_env.ENGINES_DIR, line):
        pytest.skip(
            f"vLLM's own tests of {line.environment} are not unpacked (make engines fetches "
            "them from PyPI and said why it could not)"
        )
    report = tmp_path / "report.json"
    paths = [*map(str, engine_env.python_path(line)), str(PEER), str(root)]
    environ = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(paths),  # not this repository: its tests are vLLM's
        "HF_HOME": str(_hub_cache(tmp_path / "hf")),
        "KVSHARE_BACKEND": "host",
        "KVSHARE_PAGE_SIZE": "4Ki",
        "KVSHARE_KV_LIMIT": "64Gi",  # the pools never refuse what vLLM's tests count on
        "KVSHARE_RESERVE_PAGES": "0",  # every emptied page is unmapped at once
        "KVSHARE_BROKER_SOCKET": str(tmp_path / "no-broker.sock"),
        "KVSHARE_LAYOUT": layout,
        "KVSHARE_PEER_REPORT": str(report),
        "KVSHARE_PEER_BY_DESIGN": ",".join(BY_DESIGN),
    }
    command = [
        *(sys.executable, "-m", "pytest", "-c", str(PEER / "pytest.ini"), "--rootdir", "."),
        *("-p", "kvshare_peer", "-p", "no:cacheprovider", "-q", "-rfEs", "--color=no"),
        *RUNS[layout],
    ]
    done = subprocess.run(
        command, check=False, cwd=root, env=environ, capture_output=True, text=True, timeout=600
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    passed = re.search(r"(\d+) passed", output)
    assert passed and int(passed.group(1)) >= LEAST_PASSED[layout], output[-3000:]
    skipped = re.findall(r"^SKIPPED \[\d+\] .*$", output, re.MULTILINE)
    assert all("not in the offline hub cache" in skip for skip in skipped), skipped
    served = json.loads(report.read_text(encoding="utf-8"))
    assert served["pools"] >= 100 and served["blocks"] >= 1000, served
