"""A vLLM worker starts on a GPU another engine already shares.

vLLM's ``Worker.init_device`` refuses to start unless the GPU's free memory covers
``gpu_memory_utilization`` (0.92) of its total — never the case on a GPU kvshare shares.
vLLM 0.34 turns its extensible KV cache on by default on CUDA, which defaults the
utilization to 1.0 and takes the check away: a plain 0.34 worker starts and claims the
whole GPU. Each case starts a real vLLM GPU worker the way vLLM's executor does
(``start_worker.py``), in its own process, over a stand-in device layer: an 80 GiB GPU of
which another engine holds 24 GiB. Standalone lease (``KVSHARE_KV_LIMIT``), no broker,
except where two workers share the GPU under a real node agent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvshare.api import env
from kvshare.api.engines import SupportedLine, parse_release
from kvshare.runtime.engines import vllm_common
from tests.deviceplugin.conftest import AgentProcess
from tests.engines.vllm.fake_gpu import GIB

ROOT = Path(__file__).resolve().parents[3]
HELD_BY_OTHERS = 24 * GIB
TOTAL = 80 * GIB
STATIC = 12 * GIB
KV_LIMIT = 8 * GIB
KV_MIN = 4 * GIB


def start_worker(
    scratch: Path,
    *,
    kvshare: bool,
    static: int = STATIC,
    size: bool = False,
    environ: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    child = dict(os.environ)
    child.update(
        {
            env.BROKER_SOCKET.name: str(scratch / "no-broker.sock"),
            env.KV_LIMIT.name: str(KV_LIMIT),
            env.STATIC_BYTES.name: str(static),
            env.BACKEND.name: "host",
            **(environ or {}),
        }
    )
    command = [sys.executable, "-m", "tests.engines.vllm.start_worker"]
    command += ["--held", str(HELD_BY_OTHERS), *(["--kvshare"] if kvshare else [])]
    command += ["--size"] if size else []
    return subprocess.Popen(command, cwd=ROOT, env=child, stdout=subprocess.PIPE, text=True)


def outcome(process: subprocess.Popen[str]) -> dict[str, object]:
    out, _ = process.communicate(timeout=300)
    assert process.returncode == 0, out
    result: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def starts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    """Every case's worker, started side by side (each spends its time importing vLLM)."""
    scratch = tmp_path_factory.mktemp("start")
    processes = {
        "kvshare": start_worker(scratch, kvshare=True),
        "plain": start_worker(scratch, kvshare=False),
        "too big": start_worker(scratch, kvshare=True, static=50 * GIB),
    }
    return {case: outcome(process) for case, process in processes.items()}


def _extensible_by_default(line: SupportedLine) -> bool:
    """Whether the line turns vLLM's extensible KV cache on by default on CUDA (0.34+)."""
    return parse_release(line.tested) >= (0, 34)


def test_a_vllm_worker_starts_beside_another_engine_with_what_kvshare_grants(
    starts: dict[str, dict[str, object]], line: SupportedLine
) -> None:
    started, plain = starts["kvshare"], starts["plain"]
    if _extensible_by_default(line):
        # Plain 0.34: the extensible KV cache is on, the check is gone, the whole GPU
        # is the worker's budget — what a co-located engine would then run short of.
        assert plain["started"] is True and plain["extensible"] is True
        assert plain["utilization"] == 1.0 and plain["requested"] == TOTAL
    else:
        # Plain vLLM on the same device: its own check refuses (what users of a shared
        # GPU hit).
        assert plain["started"] is False and plain["error"] == "ValueError"
        assert "less than desired GPU memory utilization (0.92" in str(plain["message"])
    # With kvshare, vLLM's check asks for this worker's grant: static footprint + lease,
    # and no extensible KV cache reserves memory of its own.
    assert started["started"] is True and started["requested"] == STATIC + KV_LIMIT
    assert started["extensible"] in (False, None)


def test_a_grant_the_gpu_cannot_hold_now_is_refused_with_kvshare_s_numbers(
    starts: dict[str, dict[str, object]],
) -> None:
    result = starts["too big"]
    assert result["started"] is False and result["error"] == "EngineConfigError"
    assert "has 56.0 GiB free, less than the 58.0 GiB kvshare grants this worker" in str(
        result["message"]
    )


def test_a_grant_above_the_device_is_refused_before_vllm_checks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from vllm.utils.mem_utils import MemorySnapshot

    monkeypatch.setenv(env.BROKER_SOCKET.name, str(tmp_path / "no-broker.sock"))
    monkeypatch.setenv(env.STATIC_BYTES.name, str(90 * GIB))
    snapshot = MemorySnapshot(
        free_memory=80 * GIB, total_memory=80 * GIB, device="cpu", auto_measure=False
    )

    def request_memory(*args: object) -> int:
        raise AssertionError("vLLM's check must not run for a grant above the device")

    with pytest.raises(vllm_common.EngineConfigError, match=r"grants this worker 90\.0 GiB"):
        vllm_common.checking_the_grant(request_memory)(snapshot, object())


@pytest.fixture
def agent(short_tmp: Path) -> Iterator[AgentProcess]:
    node = AgentProcess(short_tmp, "1x80Gi", [])
    node.start()
    try:
        yield node
    finally:
        node.stop()


def test_two_colocated_workers_size_their_kv_caches_from_kvshare_and_neither_claims_the_gpu(
    agent: AgentProcess, line: SupportedLine, short_tmp: Path
) -> None:
    if parse_release(line.tested) < (0, 33):
        pytest.skip("co-located start-up is checked on vLLM 0.33 and 0.34")
    under_agent = {
        env.BROKER_SOCKET.name: str(agent.broker_socket),
        env.GPU_UUIDS.name: agent.gpus[0].uuid,
        env.KV_MIN.name: str(KV_MIN),
        env.KV_LIMIT.name: "",
    }
    workers = [
        start_worker(short_tmp, kvshare=True, size=True, environ=under_agent) for _ in range(2)
    ]
    results = [outcome(worker) for worker in workers]
    for result in results:
        # Each asks vLLM's check for its grant only (static footprint + KV minimum, the
        # memory its start-up turn reserved), keeps no extensible KV cache of its own, and
        # sizes its KV cache for the pool's virtual size: the GPU less its static
        # footprint, not what happens to be free. Physical memory follows the lease.
        assert result["started"] is True, result
        assert result["requested"] == STATIC + KV_MIN
        assert result["extensible"] in (False, None)
        assert result["kv_bytes"] == TOTAL - STATIC
    turns = agent.view().gpus[0]
    assert turns.turn_holder == "" and turns.turn_waiting == 0  # both turns taken and given back


#: Parses flags with the line's own command-line parser (``vllm serve``'s engine flags), on
#: the stand-in device layer vLLM's defaults need; prints what the cache config says.
_PARSE = """
import json, sys
from tests.engines.vllm import fake_gpu
fake_gpu.install(fake_gpu.Gpu(total=80 * fake_gpu.GIB, held_by_others=0))
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(sys.argv[1:])
print(json.dumps({"extensible": args.enable_extensible_kv_cache}))
"""


def test_the_memory_flags_the_operator_renders_are_the_line_s_own(line: SupportedLine) -> None:
    if not line.memory_flags:
        pytest.skip(f"vLLM {line.label} needs no memory flags")
    done = subprocess.run(
        [sys.executable, "-c", _PARSE, *line.memory_flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # vLLM 0.34: the extensible KV cache is off by the operator's flag, not left to vLLM.
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"extensible": False}
