"""kvshare's start-up hook for model-server processes (``sitecustomize``).

Python imports ``sitecustomize`` at start-up from the first ``sys.path`` entry that has
one. The operator puts the runtime bundle first on ``PYTHONPATH`` (``tools/runtime_bundle.py``
builds it; its generated ``sitecustomize`` runs this file's code); with kvshare
pip-installed, put this file's directory there (``python -m kvshare.runtime.engines.bootpath``
prints it).

With ``KVSHARE_ENABLE=1`` it installs kvshare's import hooks for vLLM and SGLang (they
import nothing until the engine is imported). Either way it then runs the
``sitecustomize`` that the image had, the next one on ``sys.path``, so the image's own
start-up code still runs. A kvshare configuration error stops the process: Python would
otherwise print one line and start the engine without kvshare.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _install_kvshare() -> None:
    from kvshare.api import env

    if not env.ENABLE.read():
        return  # kvshare stays out of the process: nothing else is imported
    from kvshare.runtime.engines.activation import install

    install()


def _chain_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.realpath(__file__))
    entries = [os.path.realpath(entry or os.getcwd()) for entry in sys.path]
    after = entries[entries.index(here) + 1 :] if here in entries else entries
    for entry in after:
        if entry == here:
            continue
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
        if spec is None or spec.loader is None or spec.origin is None:
            continue
        if os.path.realpath(spec.origin) == os.path.realpath(__file__):
            continue
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return


def _main() -> None:
    try:
        _install_kvshare()
    except Exception as exc:
        # site.py would swallow an Exception and start the engine without kvshare.
        raise SystemExit(f"kvshare: cannot activate the engine hooks: {exc}") from exc
    _chain_next_sitecustomize()


_main()
