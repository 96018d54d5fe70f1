"""Real ``vllm serve`` processes for the serving tests, shared where tests can share them.

Every test here goes through the servers' OpenAI HTTP API, as a user's client does. The
servers are vLLM's CPU build (``make engines``) serving the generated tiny model; they
start with the quickest settings (``--enforce-eager``, one ``VLLM_CACHE_ROOT`` per run)
and are shared as long as tests use them: the plain-vLLM reference (the whole session) and
the co-located pair of ``world.py`` start when the session begins (``early.py``), a
module's own servers when the module does.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kvshare.demo.serving.client import Completion, complete
from kvshare.demo.serving.environment import DEFAULT_SERVING, tiny_model_dir
from kvshare.demo.serving.tiny_model import VOCAB
from kvshare.demo.serving.vllm_server import ServerOptions, VllmServer

if TYPE_CHECKING:
    from tests.serving.early import ServingWorld
    from tests.serving.world import Colocated

MIB = 2**20
#: KV cache of the plain-vLLM reference, and the lease of the standalone kvshare server.
REFERENCE_KV_BYTES = 16 * MIB
#: Bytes of one KV block of the tiny model: 32 tokens x 4 layers x (K+V) 2 heads x 64 x fp32.
BLOCK_BYTES = 32 * 4 * 2 * 2 * 64 * 4
#: Where the session keeps its :class:`~tests.serving.early.ServingWorld`.
WORLD = pytest.StashKey["ServingWorld"]()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.engines)


@pytest.fixture(scope="session", autouse=True)
def serving_environment() -> None:
    if not _has_servers():
        pytest.skip(f"{DEFAULT_SERVING.name} or the tiny model is not built: run `make engines`")


def _has_servers() -> bool:
    return DEFAULT_SERVING.python().exists() and (tiny_model_dir() / "config.json").exists()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the servers as soon as the session knows it runs serving tests (see
    :mod:`tests.serving.early`)."""
    here = Path(__file__).parent
    if _has_servers() and any(item.path.is_relative_to(here) for item in session.items):
        from tests.serving.early import ServingWorld

        session.config.stash[WORLD] = ServingWorld()


def pytest_sessionfinish(session: pytest.Session) -> None:
    world = session.config.stash.get(WORLD, None)
    if world is not None:
        world.close(keep_logs=session.testsfailed > 0)


@pytest.fixture(scope="session")
def serving_world(pytestconfig: pytest.Config) -> ServingWorld:
    """The session's servers, started (at the latest) now."""
    if WORLD not in pytestconfig.stash:
        from tests.serving.early import ServingWorld

        pytestconfig.stash[WORLD] = ServingWorld()
    return pytestconfig.stash[WORLD]


@pytest.fixture(scope="session")
def run_dir(serving_world: ServingWorld) -> Path:
    """Logs of every server, and the vLLM cache they share (kept when a test failed)."""
    return serving_world.run_dir


def start_servers(*servers: VllmServer) -> list[VllmServer]:
    """Start the servers together and wait until every one answers (stop all on failure)."""
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return list(servers)


#: The servers' niceness: while both decode on the two cores, the agent and the test's
#: clients still run when they have work (as on a node, where each has CPU of its own).
SERVER_NICENESS = 10


def options(run_dir: Path, *, kvshare: bool, cpu: int, **fields: object) -> ServerOptions:
    """A server's options for these tests: its own core, the run's vLLM cache, and a CPU
    priority below the node agent's and the test's own (see ``ServerOptions.niceness``)."""
    return ServerOptions(
        kvshare=kvshare,
        cpu_bind=str(cpu),
        niceness=SERVER_NICENESS,
        cache_root=run_dir / "vllm-cache",
        **fields,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="session")
def native_server(serving_world: ServingWorld) -> VllmServer:
    """Plain vLLM (no kvshare) with a KV cache of :data:`REFERENCE_KV_BYTES`, started but
    not necessarily answering yet."""
    return serving_world.native


@pytest.fixture(scope="session")
def native(native_server: VllmServer) -> VllmServer:
    """The plain-vLLM reference, answering."""
    return native_server.wait_ready()


@pytest.fixture(scope="session")
def colocated(serving_world: ServingWorld) -> Colocated:
    """Servers A and B leased by one node agent (``tests/serving/world.py``), shared by
    the modules that use them and stopped after the last of those."""
    return serving_world.colocated()


@pytest.fixture(scope="module", autouse=True)
def _stop_colocated_after_its_last_module(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    items = request.session.items
    mine = [i for i, item in enumerate(items) if item.module is request.module]  # type: ignore[attr-defined]
    later = items[mine[-1] + 1 :] if mine else []
    world = request.config.stash.get(WORLD, None)
    if world is not None and not any("colocated" in item.fixturenames for item in later):  # type: ignore[attr-defined]
        world.stop_colocated()


@dataclass(frozen=True)
class Ask:
    """One greedy request: a prompt (text or token ids) and how many tokens to generate."""

    prompt: str | tuple[int, ...]
    max_tokens: int


def token_prompt(seed: int, length: int) -> tuple[int, ...]:
    """A prompt of ``length`` token ids drawn from ``seed`` (special tokens left out)."""
    rng = random.Random(seed)
    return tuple(rng.randrange(2, VOCAB) for _ in range(length))


def long_asks(seed: int, count: int, prompt: int, output: int) -> list[Ask]:
    """``count`` requests with prompts of their own: no prefix cache hits between them."""
    return [Ask(token_prompt(seed * 1000 + i, prompt), output) for i in range(count)]


def serve_all(server: VllmServer, asks: Sequence[Ask], concurrency: int = 16) -> list[Completion]:
    """Every request at once (up to ``concurrency`` in flight); their completions in order.
    A request that fails raises its HTTP status."""
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(asks)))) as pool:
        return list(pool.map(lambda ask: complete(server.url, ask.prompt, ask.max_tokens), asks))


def tokens(completions: Sequence[Completion]) -> list[tuple[int, ...]]:
    return [c.token_ids for c in completions]
