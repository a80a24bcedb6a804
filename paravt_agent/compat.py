"""Compatibility: module paths that moved (the regrouping by concept of v0.4, the rooms of v0.5), kept importable
until :data:`REMOVED_IN`. Public: ``paravt_train`` and plugins read :data:`REMOVED_IN` and install their own tables.

``import paravt_train.grpo_trainer`` (or a YAML/pickle naming a class under it) still works: the old name is an
alias of the new module, and importing it warns with a ``DeprecationWarning`` naming the new path. The package's
``__init__`` installs :class:`MovedModules` with its table; the configs that rename keys read :data:`REMOVED_IN`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

__all__ = ["REMOVED_IN", "MovedModules"]

#: the release in which the moved module paths (and the deprecated config keys) stop working: importable until
#: then, with a DeprecationWarning naming the new path. tests/test_architecture.py fails once the package's
#: version reaches it, so the aliases cannot outlive it (CHANGELOG.md lists what goes)
REMOVED_IN = "0.6.0"


class _Alias(importlib.abc.Loader):
    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def create_module(self, spec):
        warnings.warn(f"{self.old} moved to {self.new}; the old path goes away in {REMOVED_IN}",
                      DeprecationWarning, stacklevel=4)
        module = importlib.import_module(self.new)
        self._spec = module.__spec__  # the import system writes the alias's spec over it: put back in exec_module
        return module

    def exec_module(self, module) -> None:  # the new module is already executed
        module.__spec__ = self._spec
        sys.modules[self.old] = module


class MovedModules(importlib.abc.MetaPathFinder):
    """A finder that answers the old dotted names of moved modules with their new modules."""

    def __init__(self, moved: dict[str, str]):
        self.moved = dict(moved)

    def find_spec(self, fullname, path=None, target=None):
        new = self.moved.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(fullname, new))

    @classmethod
    def install(cls, moved: dict[str, str]) -> None:
        if not any(isinstance(f, cls) and f.moved == moved for f in sys.meta_path):
            sys.meta_path.append(cls(moved))
