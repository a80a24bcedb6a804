"""Extension points by name: one loader for every entry-point group (``paravt.tools``, ``paravt.policies``,
``paravt.rewards``, ``paravt.benchmarks``), and ``module:attribute`` paths.

The default tool set is not found here: the agent imports it (``tools.registry.ToolRegistry.default``), and
``tools`` builds on ``paravt_agent``'s foundation only (errors, types, protocol, video, prompts, this module).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

__all__ = ["load_entry_points", "load_object"]

log = logging.getLogger(__name__)

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
