"""The outer run's side of the engine suites: each supported line's suite in a subprocess
with that line's environment on ``PYTHONPATH``, all started together (their time is mostly
importing the engines) and run beside the rest of the session."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tools import engine_env

from kvshare.api.engines import SUPPORTED, SupportedLine

SUITE_VARIABLE = "KVSHARE_ENGINE_SUITE"
ROOT = Path(__file__).resolve().parents[2]
SUITE_TIMEOUT_S = 900


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


#: The suites' CPU niceness: they start with the session and run beside the rest of it,
#: taking the cores the other tests leave idle (most of those wait on sockets and
#: processes) without slowing the ones that measure how soon something answers.
SUITE_NICENESS = 10


class EngineSuites:
    """The suite of every supported line, each in its own subprocess, started at once."""

    def __init__(self) -> None:
        self._scratch = tempfile.TemporaryDirectory(prefix="kvs-eng-")
        self.started: dict[str, Suite] = {}
        for line in SUPPORTED:
            self.started[line.environment] = self._start(line, Path(self._scratch.name))

    def _start(self, line: SupportedLine, scratch: Path) -> Suite:
        log = scratch / f"{line.environment}.log"
        if not engine_env.is_built(line):
            return Suite(line, None, log)
        with log.open("wb") as out:
            process = subprocess.Popen(
                [
                    *("nice", "-n", str(SUITE_NICENESS)),
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
        return Suite(line, process, log)

    def close(self) -> None:
        """End the suites still running and remove their scratch folder."""
        for suite in self.started.values():
            if suite.process is not None and suite.process.poll() is None:
                suite.process.kill()
                suite.process.wait()
        self._scratch.cleanup()
