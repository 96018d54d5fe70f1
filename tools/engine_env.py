"""The engine test environments (``make engines``): real vLLM and SGLang, pinned, no GPU.

Each supported engine line (:data:`kvshare.runtime.engines.registry.SUPPORTED`) gets its
tested release installed ``--no-deps`` into ``.engines/<engine>-<version>/``, plus the
pure-Python packages its KV-cache, scheduler and worker modules import
(``requirements/engines/<engine>.txt``, and ``<engine>-<version>.txt`` where a line pins
older ones). Everything else (torch CPU, numpy, pydantic, ...) comes from ``.venv``. The
engines' compiled extensions (``*.so``) are deleted: the modules under test do not load
them on CPU, and vLLM shrinks from 878 to 245 MB.

One folder per layer, each with a stamp of what it holds: a layer is reinstalled only when
its requirements change, so a second ``make engines`` takes about a second.

    python -m tools.engine_env build            # install what is missing or stale
    python -m tools.engine_env path vllm-0.33.0 # the PYTHONPATH entries of one environment
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvshare.api.engines import SUPPORTED, SupportedLine
from tools import peer_tests

ROOT = Path(__file__).resolve().parents[1]
ENGINES_DIR = ROOT / ".engines"
REQUIREMENTS_DIR = ROOT / "requirements" / "engines"
#: Stand-ins for packages that cannot work beside the CPU torch (see its docstring).
STANDINS_DIR = ROOT / "tests" / "engines" / "standins"
STAMP = ".kvshare-stamp"
#: Installs run side by side: most of their time is download and unpacking.
JOBS = 4


@dataclass(frozen=True)
class Layer:
    """One folder of packages under ``.engines``."""

    name: str
    requirements: tuple[str, ...]
    strip_shared_objects: bool = False

    @property
    def path(self) -> Path:
        return ENGINES_DIR / self.name

    def stamp(self) -> str:
        """What the folder must hold: the Python version and the requirement lines."""
        text = "\n".join(
            (sys.version.split()[0], str(self.strip_shared_objects), *self.requirements)
        )
        return hashlib.sha256(text.encode()).hexdigest()

    def is_current(self) -> bool:
        stamp = self.path / STAMP
        return stamp.is_file() and stamp.read_text(encoding="utf-8").strip() == self.stamp()


def _requirement_lines(path: Path) -> tuple[str, ...]:
    lines = (
        line.split("#", 1)[0].strip() for line in path.read_text(encoding="utf-8").splitlines()
    )
    return tuple(line for line in lines if line)


def layers(line: SupportedLine) -> list[Layer]:
    """The layers of one environment, in ``sys.path`` order."""
    found = [Layer(line.environment, (f"{line.engine}=={line.tested}",), strip_shared_objects=True)]
    overlay = REQUIREMENTS_DIR / f"{line.environment}.txt"
    if overlay.exists():
        found.append(Layer(f"deps-{line.environment}", _requirement_lines(overlay)))
    found.append(
        Layer(f"deps-{line.engine}", _requirement_lines(REQUIREMENTS_DIR / f"{line.engine}.txt"))
    )
    return found


def python_path(line: SupportedLine) -> list[Path]:
    """``PYTHONPATH`` entries of one environment: engine, stand-ins, overlay, dependencies."""
    paths = [layer.path for layer in layers(line)]
    standins = STANDINS_DIR / line.engine
    if standins.is_dir():
        paths.insert(1, standins)
    return paths


def is_built(line: SupportedLine) -> bool:
    """Whether every layer of ``line``'s environment is installed and current."""
    return all(layer.is_current() for layer in layers(line))


def _install(layer: Layer) -> float:
    """Install one layer into a fresh folder and swap it in; seconds taken."""
    started = time.monotonic()
    staging = ENGINES_DIR / f".staging-{layer.name}"
    shutil.rmtree(staging, ignore_errors=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "--no-deps",
        "--target",
        str(staging),
        *layer.requirements,
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise SystemExit(
            f"installing {layer.name} failed ({' '.join(command)}):\n{done.stdout}{done.stderr}"
        )
    if layer.strip_shared_objects:
        for library in staging.rglob("*.so"):
            library.unlink()
    (staging / STAMP).write_text(layer.stamp() + "\n", encoding="utf-8")
    shutil.rmtree(layer.path, ignore_errors=True)
    staging.rename(layer.path)
    return time.monotonic() - started


def build(lines: Sequence[SupportedLine] = SUPPORTED) -> int:
    """Install every missing or stale layer of ``lines``' environments."""
    ENGINES_DIR.mkdir(exist_ok=True)
    wanted: dict[str, Layer] = {}
    for line in lines:
        for layer in layers(line):
            wanted.setdefault(layer.name, layer)
    for line in lines:
        if line.engine == "vllm":
            _fetch_peer_tests(line)
    stale = [layer for layer in wanted.values() if not layer.is_current()]
    if not stale:
        print(f"engine environments up to date in {ENGINES_DIR.relative_to(ROOT)}/")
        return 0
    started = time.monotonic()
    print(f"installing {', '.join(layer.name for layer in stale)} into .engines/ ...", flush=True)
    with ThreadPoolExecutor(max_workers=JOBS) as pool:
        for layer, seconds in zip(stale, pool.map(_install, stale), strict=True):
            print(f"  {layer.name}: {seconds:.0f} s", flush=True)
    print(f"engine environments built in {time.monotonic() - started:.0f} s")
    return 0


def _fetch_peer_tests(line: SupportedLine) -> None:
    """Unpack vLLM's own tests of ``line``; a failure only leaves their peer suite out (it
    says so when it runs), the engine environments are built all the same."""
    try:
        if peer_tests.fetch(ENGINES_DIR, line):
            print(f"  vLLM's own tests of {line.environment}: fetched", flush=True)
    except (peer_tests.PeerTestsError, OSError, tarfile.TarError) as exc:
        print(f"  vLLM's own tests of {line.environment} not fetched: {exc}", flush=True)


def _line(environment: str) -> SupportedLine:
    for line in SUPPORTED:
        if line.environment == environment:
            return line
    names = ", ".join(line.environment for line in SUPPORTED)
    raise SystemExit(f"no engine environment {environment!r}; there are {names}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="install what is missing or stale")
    path = sub.add_parser("path", help="print the PYTHONPATH of one environment")
    path.add_argument("environment", help="e.g. vllm-0.33.0")
    args = parser.parse_args(argv)
    if args.command == "build":
        return build()
    print(":".join(str(entry) for entry in python_path(_line(args.environment))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
