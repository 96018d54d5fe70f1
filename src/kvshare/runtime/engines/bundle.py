"""The runtime bundle the operator injects into engine pods.

A bundle is a directory with ``sitecustomize.py`` and the part of the ``kvshare`` package
an engine process needs (``kvshare.runtime`` and the stdlib-only modules of
``kvshare.api``). Put on ``PYTHONPATH`` with ``KVSHARE_ENABLE=1``, it patches the engine at
start-up. ``python -m kvshare.runtime.engines.bundle DEST`` writes one (the image build
does, into ``names.RUNTIME_BUNDLE_DIR``); ``--boot-dir`` prints the directory holding
``sitecustomize.py`` for a pip-installed kvshare.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

__all__ = ["API_MODULES", "BOOT_DIR", "write_bundle"]

#: The directory of the bundle's ``sitecustomize.py`` inside the installed package.
BOOT_DIR = Path(__file__).resolve().parent / "boot"
_PACKAGE = Path(__file__).resolve().parents[2]
#: The ``kvshare.api`` modules the runtime imports; all of them stdlib-only.
API_MODULES = ("__init__.py", "names.py", "env.py", "quantity.py", "wire.py", "engines.py")


def _ignore(directory: str, names: list[str]) -> set[str]:
    del directory
    return {name for name in names if name == "__pycache__" or name.endswith(".pyc")}


def write_bundle(dest: Path) -> Path:
    """Write a bundle into ``dest`` (created; an existing bundle there is replaced)."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(BOOT_DIR / "sitecustomize.py", dest / "sitecustomize.py")
    package = dest / "kvshare"
    if package.exists():
        shutil.rmtree(package)
    package.mkdir()
    for name in ("__init__.py", "py.typed"):
        shutil.copy2(_PACKAGE / name, package / name)
    (package / "api").mkdir()
    for name in API_MODULES:
        source = _PACKAGE / "api" / name
        if source.exists():
            shutil.copy2(source, package / "api" / name)
    shutil.copytree(_PACKAGE / "runtime", package / "runtime", ignore=_ignore)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvshare.runtime.engines.bundle")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("dest", nargs="?", type=Path, help="directory to write the bundle to")
    group.add_argument("--boot-dir", action="store_true", help="print the sitecustomize dir")
    args = parser.parse_args(argv)
    if args.boot_dir:
        sys.stdout.write(f"{BOOT_DIR}\n")
        return 0
    write_bundle(args.dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
