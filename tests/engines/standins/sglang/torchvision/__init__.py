"""A stand-in for torchvision in the SGLang test environment (no real part can run here).

SGLang imports ``torchvision.transforms`` at module level through its multimodal
configs, but PyPI's torchvision is built against CUDA torch and fails to load beside the
CPU torch of the test environment (``operator torchvision::nms does not exist``). The KV
cache code under test never uses it. This package imports cleanly, reports version 0.0.0
(so transformers chooses its non-torchvision paths), and raises on any real use.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0"


class _Unavailable:
    """Any attribute of the stand-in: usable as a name, raises when called."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attribute):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return _Unavailable(f"{self._name}.{attribute}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(
            f"{self._name}: torchvision is a stand-in in the engine test environment"
        )

    def __mro_entries__(self, bases):
        return (object,)


class _StandInModule(types.ModuleType):
    def __getattr__(self, attribute):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return _Unavailable(f"{self.__name__}.{attribute}")


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every ``torchvision.*`` submodule as a stand-in module."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StandInModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


sys.meta_path.append(_SubmoduleFinder())
sys.modules[__name__].__class__ = _StandInModule
