"""The runtime bundle holds sitecustomize and a runtime that imports from the bundle alone."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from kvshare.runtime.engines.bundle import API_MODULES, BOOT_DIR, main, write_bundle


def test_bundle_holds_sitecustomize_the_runtime_and_the_stdlib_api(tmp_path: Path) -> None:
    bundle = write_bundle(tmp_path / "bundle")
    assert (bundle / "sitecustomize.py").read_bytes() == (
        BOOT_DIR / "sitecustomize.py"
    ).read_bytes()
    assert (bundle / "kvshare" / "runtime" / "pool.py").is_file()
    assert (bundle / "kvshare" / "runtime" / "engines" / "registry.py").is_file()
    assert (bundle / "kvshare" / "api" / "env.py").is_file()
    assert not (bundle / "kvshare" / "api" / "modelserver.py").exists()  # pydantic stays out
    assert not list(bundle.rglob("__pycache__"))


def test_bundle_sitecustomize_without_enable_imports_no_runtime(tmp_path: Path) -> None:
    bundle = write_bundle(tmp_path / "bundle")
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
    bundle = write_bundle(tmp_path / "bundle")
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


def test_boot_dir_is_printed_for_pip_installs(capsys: object) -> None:
    assert main(["--boot-dir"]) == 0
    assert capsys.readouterr().out.strip() == str(BOOT_DIR)  # type: ignore[attr-defined]


def test_every_api_module_the_runtime_imports_is_in_the_bundle() -> None:
    runtime = Path(__file__).resolve().parents[2] / "src" / "kvshare" / "runtime"
    pattern = re.compile(r"from kvshare\.api(?:\.(\w+))? import (\w+)")
    needed = set()
    for path in runtime.rglob("*.py"):
        for module, name in pattern.findall(path.read_text(encoding="utf-8")):
            needed.add(f"{module or name}.py")
    assert needed <= set(API_MODULES), sorted(needed - set(API_MODULES))
