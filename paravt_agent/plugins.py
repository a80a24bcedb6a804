"""Extension points by name: one loader for every entry-point group (``paravt.tools``, ``paravt.policies``,
``paravt.rewards``, ``paravt.benchmarks``), and ``module:attribute`` paths.

The agent's default tool set is reached here too, the way plugins are (:func:`toolset`): the ``paravt.toolsets``
entry point ``default``, which the project's own ``pyproject.toml`` points at the ``tools`` package's registry.
``tools`` builds on ``paravt_agent``'s foundation only (errors, types, protocol, video, prompts, this module), and
nothing in ``paravt_agent`` imports it: the arrow between the two packages points one way.
"""

from __future__ import annotations

import functools
import importlib
import logging
import re
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from paravt_agent.errors import ConfigError

__all__ = ["TOOLSET_GROUP", "load_entry_points", "load_object", "toolset"]

log = logging.getLogger(__name__)

#: the entry-point group of tool sets: ``name = "module:factory"``, the factory turning what a user passed as
#: ``Agent(tools=...)`` (None: the default set) into a registry
TOOLSET_GROUP = "paravt.toolsets"

def load_entry_points(group: str, into: dict[str, Any], what: str,
                      make: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """Load every entry point of ``group`` not yet in ``into`` (``make`` turns the loaded object into the
    registered one). A plugin that fails to load is logged and skipped: it never breaks the built-ins."""
    for ep in entry_points(group=group):
        if ep.name in into:
            continue
        try:
            obj = ep.load()
            into[ep.name] = make(obj) if make is not None else obj
        except Exception as exc:  # noqa: BLE001 (a broken plugin is a warning, not a crash)
            log.warning("%s plugin %s could not be loaded: %s", what, ep.name, exc)
    return into


def load_object(path: str) -> Any:
    """``package.module:attr.attr`` → the object."""
    module, _, attrs = path.partition(":")
    obj: Any = importlib.import_module(module)
    for name in filter(None, attrs.split(".")):
        obj = getattr(obj, name)
    return obj


@functools.cache
def toolset(name: str = "default") -> Callable[[Any], Any]:
    """The tool-set factory registered as ``name`` in the ``paravt.toolsets`` group: the installed packages' entry
    points, or, where the project runs from its source tree without being installed (``tests/gpu/run.py`` puts the
    tree on ``PYTHONPATH``; a checkout's metadata may predate the entry point), the group as the tree's own
    ``pyproject.toml`` declares it — the same entry point, read from where ``pip install`` would have read it."""
    found = [ep for ep in entry_points(group=TOOLSET_GROUP) if ep.name == name]
    if found:
        return found[0].load()
    path = _source_entry_points(TOOLSET_GROUP).get(name)
    if path is None:
        raise ConfigError(f"no tool set {name!r} in the {TOOLSET_GROUP!r} entry-point group: install the project "
                          "(pip install -e .) or run it from its source tree")
    return load_object(path)


def _source_entry_points(group: str) -> dict[str, str]:
    """``name -> module:attr`` of ``group`` in the ``pyproject.toml`` of the source tree this package was imported
    from, when that tree is this project's (read as text: no tomllib on Python 3.10); empty otherwise."""
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    if not pyproject.is_file():
        return {}
    text = pyproject.read_text()
    if not re.search(r'^name = "paravt"$', text, re.M):
        return {}
    section = re.search(rf'^\[project\.entry-points\."{re.escape(group)}"\]\n(.*?)(?=^\[|\Z)', text, re.M | re.S)
    return dict(re.findall(r'^([\w.-]+)\s*=\s*"([^"]+)"', section[1], re.M)) if section else {}
