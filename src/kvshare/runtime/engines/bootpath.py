"""Where kvshare's ``sitecustomize`` lives, for a pip-installed kvshare.

In pods the operator injects the runtime bundle (``tools/runtime_bundle.py`` builds it with
this ``sitecustomize`` inside). With kvshare installed by pip (editable too), put this
directory first on the engine's ``PYTHONPATH`` instead::

    PYTHONPATH=$(python -m kvshare.runtime.engines.bootpath) KVSHARE_ENABLE=1 vllm serve ...
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["BOOT_DIR"]

#: The directory of kvshare's ``sitecustomize.py`` inside the installed package.
BOOT_DIR = Path(__file__).resolve().parent / "boot"


def main() -> int:
    sys.stdout.write(f"{BOOT_DIR}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
