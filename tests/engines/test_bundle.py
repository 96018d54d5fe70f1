"""The injected runtime bundle starts kvshare's engine hooks, or stays out of the way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvshare.runtime.engines import bootpath
from kvshare.runtime.engines.bootpath import BOOT_DIR
from tests.engines.suite import injected_bundle


def test_the_bundle_runs_the_engine_hooks_sitecustomize(tmp_path: Path) -> None:
    bundle = injected_bundle(tmp_path / "bundle")
    hooks = (bundle / "kvshare_engine_hooks.py").read_text(encoding="utf-8")
    assert hooks == (BOOT_DIR / "sitecustomize.py").read_text(encoding="utf-8")
    assert "kvshare_engine_hooks.py" in (bundle / "sitecustomize.py").read_text(encoding="utf-8")
    assert (bundle / "kvshare" / "runtime" / "engines" / "activation.py").is_file()
    assert (bundle / "kvshare" / "api" / "engines.py").is_file()


def test_a_disabled_bundle_imports_no_hooks(tmp_path: Path) -> None:
    bundle = injected_bundle(tmp_path / "bundle")
    environ = dict(os.environ, PYTHONPATH=str(bundle), KVSHARE_ENABLE="0")
    code = (
        "import sys, kvshare; "
        "print(kvshare.__file__, 'kvshare.runtime.engines.activation' in sys.modules, "
        "any(type(f).__name__ == 'EngineImportHook' for f in sys.meta_path))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True
    )
    location, activated, hooked = done.stdout.split()
    assert Path(location).is_relative_to(bundle)
    assert (activated, hooked) == ("False", "False")


def test_a_bad_setting_stops_the_process_instead_of_starting_without_kvshare(
    tmp_path: Path,
) -> None:
    bundle = injected_bundle(tmp_path / "bundle")
    environ = dict(os.environ, PYTHONPATH=str(bundle), KVSHARE_ENABLE="1", KVSHARE_LOG_LEVEL="LOUD")
    done = subprocess.run(
        [sys.executable, "-c", "print('engine started')"],
        check=False,
        env=environ,
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0
    assert "engine started" not in done.stdout
    assert "kvshare: cannot activate the engine hooks: KVSHARE_LOG_LEVEL='LOUD'" in done.stderr


def test_the_boot_directory_is_printed_for_pip_installs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvshare.runtime.engines.bootpath"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == str(bootpath.BOOT_DIR)
    assert (BOOT_DIR / "sitecustomize.py").is_file()
