"""``sitecustomize`` activation, proven in fresh interpreters (imported into each suite).

Each check starts the engine environment's Python with the runtime bundle (or the
boot directory of the installed kvshare) first on ``PYTHONPATH`` and imports the engine
the way a server does, then reports what it found as JSON. The unsupported-version check
puts a metadata-only stand-in (``<engine>-0.0.1.dist-info``) before the real engine, so
the real package imports but announces a version outside the table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvshare.api import env
from kvshare.api.engines import SUPPORTED, SupportedLine, supported_labels
from kvshare.runtime.engines.bootpath import BOOT_DIR
from tests.engines.suite import injected_bundle

CHILD_TIMEOUT_S = 300

_PROBE = """
import json, sys
import {engine}
activation_loaded = "kvshare.runtime.engines.activation" in sys.modules
import importlib, kvshare
from kvshare.runtime.engines.activation import activated_lines
from kvshare.runtime.engines.patching import is_patched
patches = importlib.import_module("kvshare.runtime.engines.{patch_module}").PATCHES
def resolve(target):
    owner = importlib.import_module(target.module)
    for part in target.attribute.split("."):
        owner = getattr(owner, part)
    return owner
patched = [is_patched(resolve(t)) for t in patches.targets]
# Deferred sets wait for the engine to import their trigger; import it as the engine would.
triggers_loaded = [d.trigger in sys.modules for d in patches.deferred]
for deferred in patches.deferred:
    importlib.import_module(deferred.trigger)
print(json.dumps({{
    "kvshare": kvshare.__file__,
    "activation_loaded": activation_loaded,
    "activated": sorted(activated_lines()),
    "patched": patched,
    "triggers_loaded": triggers_loaded,
    "deferred": [is_patched(resolve(t)) for d in patches.deferred for t in d.patches.targets],
    "chained": __import__("os").environ.get("CHAINED_SITECUSTOMIZE"),
}}))
"""

_CHAINED = """
import os
os.environ["CHAINED_SITECUSTOMIZE"] = "ran"
"""


def newest(line: SupportedLine, engine: str | None = None) -> bool:
    """Whether ``line`` is the newest line of its engine (of ``engine`` only, when given).

    Every line proves that the bundle activates it; the checks that do not depend on the
    line run once per engine, or once, to keep the engine suites short.
    """
    if engine is not None and line.engine != engine:
        return False
    return next(item for item in SUPPORTED if item.engine == line.engine) == line


def run_probe(
    line: SupportedLine, first: list[Path], *, enable: bool
) -> subprocess.CompletedProcess[str]:
    environ = dict(os.environ)
    environ["PYTHONPATH"] = os.pathsep.join(
        [*(str(path) for path in first), environ.get("PYTHONPATH", "")]
    )
    environ[env.ENABLE.name] = "1" if enable else "0"
    environ.update({env.BACKEND.name: "host", env.KV_LIMIT.name: "64Mi", env.KV_MAX.name: "256Mi"})
    code = _PROBE.format(engine=line.engine, patch_module=line.patch_module)
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
        env=environ,
    )


def report(done: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_enabled_bundle_on_pythonpath_patches_the_engine_and_chains_the_image_hook(
    line: SupportedLine, tmp_path: Path
) -> None:
    bundle = injected_bundle(tmp_path / "bundle")
    image_site = tmp_path / "image-site"
    image_site.mkdir()
    (image_site / "sitecustomize.py").write_text(_CHAINED, encoding="utf-8")
    found = report(run_probe(line, [bundle, image_site], enable=True))
    assert Path(str(found["kvshare"])).is_relative_to(bundle), "kvshare came from elsewhere"
    assert found["activated"] == [line.engine]
    assert found["patched"] and all(found["patched"])  # type: ignore[arg-type]
    assert found["chained"] == "ran"
    # kvshare itself never imports a deferred set's module; the engine's import patches it.
    assert not any(found["triggers_loaded"])  # type: ignore[arg-type]
    assert all(found["deferred"])  # type: ignore[arg-type]
    if line.engine == "vllm":
        assert found["deferred"], "every vLLM line patches its CPU worker"


def test_disabled_bundle_touches_nothing(line: SupportedLine, tmp_path: Path) -> None:
    if not newest(line, "vllm"):
        pytest.skip("checked once, on the newest vLLM line (nothing engine-specific runs)")
    bundle = injected_bundle(tmp_path / "bundle")
    found = report(run_probe(line, [bundle], enable=False))
    assert found["activation_loaded"] is False
    assert found["activated"] == []
    assert not any(found["patched"])  # type: ignore[arg-type]


def test_installed_kvshare_activates_from_its_boot_directory(
    line: SupportedLine, tmp_path: Path
) -> None:
    if not newest(line, "vllm"):
        pytest.skip("checked once, on the newest vLLM line")
    found = report(run_probe(line, [BOOT_DIR], enable=True))
    assert not Path(str(found["kvshare"])).is_relative_to(tmp_path)
    assert found["activated"] == [line.engine]
    assert all(found["patched"])  # type: ignore[arg-type]


def test_unsupported_version_is_refused_with_the_supported_list(
    line: SupportedLine, tmp_path: Path
) -> None:
    if not newest(line, "vllm"):
        pytest.skip("checked once, on the newest vLLM line (the refusal is engine-neutral)")
    bundle = injected_bundle(tmp_path / "bundle")
    metadata = tmp_path / "old-metadata" / f"{line.engine}-0.0.1.dist-info"
    metadata.mkdir(parents=True)
    (metadata / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {line.engine}\nVersion: 0.0.1\n", encoding="utf-8"
    )
    done = run_probe(line, [bundle, metadata.parent], enable=True)
    assert done.returncode != 0
    assert f"{line.engine} 0.0.1 is not supported by kvshare" in done.stderr
    assert supported_labels(line.engine) in done.stderr
