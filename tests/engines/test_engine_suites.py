"""Each supported engine line passes its suite against the real engine package.

The suites start side by side in subprocesses (their time is mostly importing the
engines), each with one environment on ``PYTHONPATH``; a failure shows the suite's own
pytest report.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tools import engine_env

from kvshare.api.engines import SUPPORTED, SupportedLine
from tests.engines.conftest import SUITE_VARIABLE

ROOT = Path(__file__).resolve().parents[2]
SUITE_TIMEOUT_S = 900
#: Lines of a failed suite's output shown in the failure.
REPORT_LINES = 120


@dataclass
class Suite:
    line: SupportedLine
    process: subprocess.Popen[bytes] | None
    log: Path

    def wait(self) -> tuple[int, str]:
        assert self.process is not None
        try:
            code = self.process.wait(timeout=SUITE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            code = -9
        return code, self.log.read_text(encoding="utf-8", errors="replace")


def suite_environment(line: SupportedLine, scratch: Path) -> dict[str, str]:
    """The environment of one suite: its engine on ``PYTHONPATH``, caches in ``scratch``."""
    environ = dict(os.environ)
    paths = [str(path) for path in engine_env.python_path(line)]
    if environ.get("PYTHONPATH"):
        paths.append(environ["PYTHONPATH"])
    environ.update(
        {
            "PYTHONPATH": os.pathsep.join([*paths, str(ROOT)]),
            SUITE_VARIABLE: line.environment,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "SGLANG_CACHE_DIR": str(scratch / "sglang"),
            "VLLM_CACHE_ROOT": str(scratch / "vllm"),
            "VLLM_CONFIG_ROOT": str(scratch / "vllm-config"),
            "XDG_CACHE_HOME": str(scratch / "cache"),
            "TRITON_CACHE_DIR": str(scratch / "triton"),
            "PYTHONWARNINGS": "ignore",
            # vLLM's usage report forks a process (to read the device's properties) that
            # outlives a worker's os._exit and holds its stdout open: the test reading the
            # worker's result would wait for it. Tests report no usage.
            "VLLM_NO_USAGE_STATS": "1",
        }
    )
    environ.pop("KVSHARE_ENABLE", None)
    return environ


@pytest.fixture(scope="session")
def suites() -> Iterator[dict[str, Suite]]:
    started: dict[str, Suite] = {}
    with tempfile.TemporaryDirectory(prefix="kvs-eng-") as scratch_dir:
        scratch = Path(scratch_dir)
        for line in SUPPORTED:
            log = scratch / f"{line.environment}.log"
            if not engine_env.is_built(line):
                started[line.environment] = Suite(line, None, log)
                continue
            with log.open("wb") as out:
                process = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "pytest",
                        str(ROOT / "tests" / "engines" / line.engine),
                        "-p",
                        "no:cacheprovider",
                        "-q",
                        "-rfEs",
                        "--color=no",
                        "--durations=5",
                    ],
                    cwd=ROOT,
                    env=suite_environment(line, scratch / line.environment),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            started[line.environment] = Suite(line, process, log)
        try:
            yield started
        finally:
            for suite in started.values():
                if suite.process is not None and suite.process.poll() is None:
                    suite.process.kill()
                    suite.process.wait()


@pytest.mark.engines
@pytest.mark.timeout(SUITE_TIMEOUT_S + 60)  # each waits for its suite, up to the suite's own
@pytest.mark.parametrize("line", SUPPORTED, ids=lambda line: line.environment)
def test_engine_line_passes_its_suite_on_the_real_engine(
    line: SupportedLine, suites: dict[str, Suite]
) -> None:
    suite = suites[line.environment]
    if suite.process is None:
        pytest.skip(f"{line.environment} is not installed: run `make engines`")
    code, output = suite.wait()
    report = "\n".join(output.splitlines()[-REPORT_LINES:])
    assert code == 0, f"{line.environment} suite failed (exit {code}):\n{report}"
    assert " passed" in output, f"{line.environment} suite ran no test:\n{report}"
