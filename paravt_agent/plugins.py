"""Extension points by name: entry-point plugins (one loader for every group) and the default tool set.

``paravt_agent`` never imports the top-level ``tools`` package: the agent reaches tools only through the
registry it is given, and when it is given none, through :func:`default_registry`, which names the tool set
by ``module:attribute`` (:data:`DEFAULT_TOOLSET`, overridable with ``PARAVT_TOOLSET``) as ``langgraph.json``
names a graph. ``tools`` in turn may import ``paravt_agent``'s video, protocol and types layers.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

__all__ = ["DEFAULT_TOOLSET", "default_registry", "load_entry_points", "load_object", "tool_registry"]

log = logging.getLogger(__name__)

#: the factory of the default tool registry (the built-ins plus every ``paravt.tools`` plugin)
DEFAULT_TOOLSET = "tools.registry:ToolRegistry.default"


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


def default_registry():
    """The default tool registry, from :data:`DEFAULT_TOOLSET` (or ``PARAVT_TOOLSET``)."""
    return load_object(os.environ.get("PARAVT_TOOLSET") or DEFAULT_TOOLSET)()


def tool_registry(tools: Any):
    """A registry from what a user passed: None (the default), a registry, or tool instances."""
    from paravt_agent.errors import ConfigError

    if tools is None:
        return default_registry()
    if hasattr(tools, "prepare") and hasattr(tools, "subset"):
        return tools
    tools = list(tools)
    bad = [t for t in tools if not (hasattr(t, "run") and hasattr(t, "schema") and hasattr(t, "name"))]
    if bad:
        raise ConfigError(f"tools must be paravt Tool instances, got {bad[0]!r}")
    return type(default_registry())(tools)
