"""kvshare on against kvshare off: the same tokens from a real ``vllm serve``, and a clean exit.

The kvshare server has a standalone fixed lease (``KVSHARE_KV_LIMIT``, no node agent) of
the reference's KV cache size, but a pool four times as large (``KVSHARE_KV_MAX``): vLLM
sizes its block table for the pool, and it is the lease that makes it preempt. The
reference is plain vLLM given that KV cache size.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvshare.demo.serving.client import labels_of, post, scrape, total
from kvshare.demo.serving.vllm_server import VllmServer, alive
from tests.serving.conftest import (
    BLOCK_BYTES,
    REFERENCE_KV_BYTES,
    Ask,
    long_asks,
    options,
    serve_all,
    start_servers,
    token_prompt,
    tokens,
)

#: Prompts of several lengths, text and token ids; most hold full blocks to cache.
PROMPT_SET = [
    Ask("The quick brown fox jumps over the lazy dog.", 48),
    Ask("def forward(self, input):\n    return self.linear(input)\n", 48),
    *(Ask(token_prompt(seed, length), 48) for seed, length in enumerate((64, 100, 160, 230, 300))),
    Ask(token_prompt(99, 500), 64),
]


@pytest.fixture(scope="module")
def kvshare_tmp(run_dir: Path) -> Path:
    path = run_dir / "tmp-kvshare"
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def standalone(run_dir: Path, kvshare_tmp: Path, native_server: VllmServer) -> Iterator[VllmServer]:
    """kvshare with a fixed 16 MiB lease and a 64 MiB pool, its temporary files apart."""
    env = {
        "KVSHARE_KV_LIMIT": str(REFERENCE_KV_BYTES),
        "KVSHARE_KV_MAX": str(4 * REFERENCE_KV_BYTES),
        "KVSHARE_BROKER_SOCKET": str(run_dir / "no-node-agent.sock"),
        "TMPDIR": str(kvshare_tmp),
    }
    server = VllmServer(
        "kvshare-standalone",
        options(run_dir, kvshare=True, cpu=0, env=env),
        run_dir / "kvshare-standalone.log",
    )
    start_servers(server)  # while the reference starts too
    try:
        yield server
    finally:
        server.stop()


def metric(server: VllmServer, name: str) -> float:
    return total(scrape(f"{server.url}/metrics"), name)


def test_the_engine_runs_kvshares_pool_sized_from_it(standalone: VllmServer) -> None:
    log = standalone.log_path.read_text(encoding="utf-8", errors="replace")
    assert "kvshare patched vllm 0.32.0+cpu" in log
    assert "CPU worker" in log and "KV pool ready" in log
    # vLLM was given no KV size: its block table is the pool's 64 MiB.
    info = labels_of(scrape(f"{standalone.url}/metrics"), "vllm:cache_config_info")
    assert int(info["num_gpu_blocks"]) * BLOCK_BYTES == 4 * REFERENCE_KV_BYTES


def test_greedy_tokens_match_plain_vllm_and_the_second_round_comes_from_the_prefix_cache(
    native: VllmServer, standalone: VllmServer
) -> None:
    hits_before = [metric(s, "vllm:prefix_cache_hits_total") for s in (native, standalone)]
    first = [tokens(serve_all(s, PROMPT_SET)) for s in (native, standalone)]
    second = [tokens(serve_all(s, PROMPT_SET)) for s in (native, standalone)]
    hits = [
        metric(s, "vllm:prefix_cache_hits_total") - before
        for s, before in zip((native, standalone), hits_before, strict=True)
    ]
    assert first[1] == first[0]
    assert second[1] == second[0] == first[0]
    assert all(len(t) == ask.max_tokens for t, ask in zip(first[0], PROMPT_SET, strict=True))
    assert hits[0] > 0, "the reference served nothing from its prefix cache"
    assert hits[1] == hits[0], "kvshare's server hit its prefix cache differently"


def test_a_lease_that_forces_preemption_gives_the_tokens_of_plain_vllm(
    native: VllmServer, standalone: VllmServer
) -> None:
    asks = long_asks(seed=7, count=8, prompt=500, output=500)  # 256 blocks, 127 fit
    for server in (native, standalone):
        post(server.url, "/reset_prefix_cache")
    before = [metric(s, "vllm:num_preemptions_total") for s in (native, standalone)]
    done = [serve_all(s, asks) for s in (native, standalone)]
    preempted = [
        metric(s, "vllm:num_preemptions_total") - b
        for s, b in zip((native, standalone), before, strict=True)
    ]
    assert all(c.status == 200 and len(c.token_ids) == 500 for run in done for c in run)
    assert tokens(done[1]) == tokens(done[0])
    assert preempted[0] > 0, "the reference's KV cache did not run out: no preemption"
    assert preempted[1] > 0, "kvshare's lease did not make the server preempt"


def _unix_sockets() -> dict[str, str]:
    """Inode -> name of every bound unix socket on this machine (abstract ones with @)."""
    found: dict[str, str] = {}
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) == 8:
            found[fields[6]] = fields[7]
    return found


def _held_by(pids: list[int]) -> tuple[set[str], set[str], set[str]]:
    """What the processes hold: unix socket names, memfds, /dev/shm files."""
    sockets = _unix_sockets()
    names: set[str] = set()
    memfds: set[str] = set()
    shm: set[str] = set()
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        try:
            links = [os.readlink(fd) for fd in fd_dir.iterdir()]
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:
            continue
        for link in links:
            if link.startswith("socket:["):
                name = sockets.get(link[8:-1])
                if name:
                    names.add(name)
            elif link.startswith("/memfd:"):
                memfds.add(link)
            elif link.startswith("/dev/shm/"):
                shm.add(link)
        shm.update(line.split()[-1] for line in maps if " /dev/shm/" in line)
    return names, memfds, shm


def test_sigterm_exits_cleanly_and_leaves_no_socket_memfd_or_shm(
    standalone: VllmServer, kvshare_tmp: Path
) -> None:
    tree = standalone.tree()
    sockets, memfds, shm = _held_by(tree)
    ours = {name for name in sockets if "kvshare" in name}
    assert ours, f"the server's pool serves no rank socket ({sorted(sockets)})"
    assert any("kvshare" in memfd for memfd in memfds), "no pool memory (memfd) was seen"
    standalone.terminate()
    assert standalone.wait_exited(60), f"still running after SIGTERM: {standalone.tree()}"
    assert standalone.process is not None and standalone.process.returncode == 0, (
        standalone.log_tail()
    )
    assert not [pid for pid in tree if alive(pid)], "a process of the tree is left"
    assert not ours & set(_unix_sockets().values()), "a kvshare socket is still bound"
    assert not [p.name for p in kvshare_tmp.iterdir() if p.name.startswith("kvshare")]
    assert not [path for path in shm if Path(path).exists()], "shared memory left behind"
