"""A vLLM worker starts on a GPU another engine already shares.

vLLM's ``Worker.init_device`` refuses to start unless the GPU's free memory covers
``gpu_memory_utilization`` (0.92) of its total — never the case on a GPU kvshare shares.
Each case starts a real vLLM GPU worker the way vLLM's executor does
(``start_worker.py``), in its own process, over a stand-in device layer: an 80 GiB GPU of
which another engine holds 24 GiB. Standalone lease (``KVSHARE_KV_LIMIT``), no broker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvshare.api import env
from kvshare.runtime.engines import vllm_common
from tests.engines.vllm.fake_gpu import GIB

ROOT = Path(__file__).resolve().parents[3]
HELD_BY_OTHERS = 24 * GIB
STATIC = 12 * GIB
KV_LIMIT = 8 * GIB


def start_worker(scratch: Path, *, kvshare: bool, static: int = STATIC) -> subprocess.Popen[str]:
    environ = dict(os.environ)
    environ.update(
        {
            env.BROKER_SOCKET.name: str(scratch / "no-broker.sock"),
            env.KV_LIMIT.name: str(KV_LIMIT),
            env.STATIC_BYTES.name: str(static),
            env.BACKEND.name: "host",
        }
    )
    command = [sys.executable, "-m", "tests.engines.vllm.start_worker"]
    command += ["--held", str(HELD_BY_OTHERS), *(["--kvshare"] if kvshare else [])]
    return subprocess.Popen(command, cwd=ROOT, env=environ, stdout=subprocess.PIPE, text=True)


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


def test_a_vllm_worker_starts_beside_another_engine_with_what_kvshare_grants(
    starts: dict[str, dict[str, object]],
) -> None:
    started, refused = starts["kvshare"], starts["plain"]
    # Plain vLLM on the same device: its own check refuses (what users of a shared GPU hit).
    assert refused["started"] is False and refused["error"] == "ValueError"
    assert "less than desired GPU memory utilization (0.92" in str(refused["message"])
    # With kvshare, vLLM's check asks for this worker's grant: static footprint + lease.
    assert started == {"started": True, "requested": STATIC + KV_LIMIT}


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
