"""vLLM's KV cache in block-outer pages: one page holds one whole block of every layer.

Each case runs ``block_outer_worker.py`` in its own process (vLLM binds its platform when
imported): vLLM's own ``resolve_kv_cache_layout`` with FLASH_ATTN's layout rules, vLLM's
planner, ``allocate_kv_cache``/``create_kv_cache_views`` over kvshare's pool on the host
backend (a stand-in CUDA device layer, ``fake_gpu.py``), and the scheduler's
``KVCacheManager`` drawing blocks from the pool. With ``KVSHARE_LAYOUT=per-layer`` the
same worker shows what vLLM chooses by itself (its preference puts ``LBNHC`` first): pages
of one granule per layer, each holding several blocks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvshare.api import env

ROOT = Path(__file__).resolve().parents[3]


def _start(layout: str) -> subprocess.Popen[str]:
    child = dict(os.environ)
    child[env.LAYOUT.name] = layout
    command = [sys.executable, "-m", "tests.engines.vllm.block_outer_worker"]
    return subprocess.Popen(command, cwd=ROOT, env=child, stdout=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, object]]:
    """Both settings' workers, started side by side (each spends its time importing vLLM)."""
    processes = {layout: _start(layout) for layout in ("auto", "per-layer")}
    results = {}
    for layout, process in processes.items():
        out, _ = process.communicate(timeout=300)
        assert process.returncode == 0, out
        results[layout] = json.loads(out.strip().splitlines()[-1])
    return results


def test_kvshare_asks_vllm_for_a_block_outer_layout_and_pages_it_by_the_block(
    runs: dict[str, dict[str, object]],
) -> None:
    result = runs["auto"]
    # vLLM's own resolution, with the block-outer layouts first, picks one FLASH_ATTN
    # supports; the pool is one buffer of whole blocks, one block per page.
    assert result["layout"] == "BLNHC"
    assert result["paging"] == ["block-outer", ""]
    assert result["rank_buffers"] == 1 and result["blocks_per_page"] == [1, 1, 1]
    assert result["owner_page_bytes"] == result["page_bytes"]  # scheduler and worker agree
    # Every layer's view of a block (vLLM's create_kv_cache_views over the pool) lies in
    # that block's page, and each of the three blocks has a page of its own.
    blocks = result["blocks"]
    assert isinstance(blocks, list) and len(blocks) == 3
    pages = [result["granules"][str(block)] for block in blocks]  # type: ignore[index]
    assert all(len(spans) == 1 and spans[0][0] == spans[0][1] for spans in pages)
    assert len({spans[0][0] for spans in pages}) == 3


def test_a_freed_block_s_page_is_unmapped_while_its_neighbours_stay_in_use(
    runs: dict[str, dict[str, object]],
) -> None:
    result = runs["auto"]
    first, _, last = result["blocks"]  # type: ignore[misc]
    assert result["middle_page"] not in result["mapped"]  # type: ignore[operator]
    assert result["granules"][str(first)][0][0] in result["mapped"]  # type: ignore[index]
    assert result["granules"][str(last)][0][0] in result["mapped"]  # type: ignore[index]
    # The other requests' KV bytes, written through every layer's view, are untouched.
    assert result["intact"] == {str(first): [10, 11], str(last): [30, 31]}


def test_per_layer_pages_hold_several_blocks_and_stay_mapped_for_any_of_them(
    runs: dict[str, dict[str, object]],
) -> None:
    # What vLLM resolves without kvshare's request: a layer-outer layout. A page is one
    # granule of each layer and holds two of these blocks, so freeing the middle request
    # unmaps nothing: its page still holds the last request's block.
    result = runs["per-layer"]
    assert result["layout"] == "LBNHC"
    assert result["paging"] == ["per-layer", "setting"]
    assert result["rank_buffers"] == 2 and result["blocks_per_page"] == [2, 2, 2]
    assert result["middle_page"] in result["mapped"]  # type: ignore[operator]
    _, _, last = result["blocks"]  # type: ignore[misc]
    assert result["intact"][str(last)] == [30, 31]  # type: ignore[index]
