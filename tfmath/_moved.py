"""Dotted paths of tfmath 0.1's flat layout stay importable after the move into subpackages.

``import tfmath.layers`` gives the very module object that
``import tfmath.training.layers`` gives (not a copy), so attributes,
monkeypatching and ``isinstance`` checks behave the same under both names.
"""

import importlib
import importlib.abc
import importlib.util
import sys

#: Old dotted path -> where the module lives now.
MOVED_MODULES = {
    "tfmath.params": "tfmath.training.params",
    "tfmath.layers": "tfmath.training.layers",
    "tfmath.models": "tfmath.training.models",
    "tfmath.optim": "tfmath.training.optim",
    "tfmath.sweep": "tfmath.training.sweep",
    "tfmath.synthetic": "tfmath.training.synthetic",
    "tfmath.scaling": "tfmath.formulas.scaling",
    "tfmath.accounting": "tfmath.formulas.accounting",
    "tfmath.cli": "tfmath.tools.cli",
    "tfmath.bench": "tfmath.tools.bench",
    "tfmath.worked_examples": "tfmath.analysis.worked_examples",
}


class _MovedModuleLoader(importlib.abc.Loader):
    def __init__(self, new_name):
        self._new_name = new_name

    def create_module(self, spec):
        module = importlib.import_module(self._new_name)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module):
        # The module already ran under its new name; the import system has just
        # given it the old name's spec, which would misname it to importlib.
        module.__spec__ = self._own_spec


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        new_name = MOVED_MODULES.get(name)
        if new_name is None:
            return None
        return importlib.util.spec_from_loader(name, _MovedModuleLoader(new_name))


def module_getattr(attribute):
    """``tfmath.<attribute>`` for an old module name (tfmath's module ``__getattr__``)."""
    if f"tfmath.{attribute}" not in MOVED_MODULES:
        raise AttributeError(f"module 'tfmath' has no attribute {attribute!r}")
    return importlib.import_module(f"tfmath.{attribute}")


# Importing this module (tfmath's __init__ does) lets the old dotted paths import.
if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())
