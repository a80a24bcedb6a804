"""The tool registry and the one place tool calls are validated.

Built-ins register themselves; third-party tools register through the
``paravt.tools`` entry-point group (an entry point names a :class:`~tools.base.Tool`
subclass or instance)::
    [project.entry-points."paravt.tools"]
    ocr_frame = "my_pkg.tools:OcrFrame"
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ValidationError

from paravt_agent.errors import ConfigError, ToolError
from paravt_agent.plugins import load_entry_points
from paravt_agent.protocol import CallError, ToolCall
from tools.base import Tool, ToolContext
from tools.builtin import BUILTINS
from tools.perception import PERCEPTION

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "paravt.tools"
_PLACEHOLDER_PATHS = {"", "...", "video", "video.mp4", "<video>", "<video_path>", "video_path", "path/to/video.mp4"}


@dataclass
class PreparedCall:
    """A call after validation: ready to run (``tool`` and ``args``), or an ``error`` for its slot."""

    index: int
    call: ToolCall | CallError
    tool: Tool | None = None
    args: BaseModel | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def label(self) -> str:
        if self.tool is not None and self.args is not None:
            return self.tool.describe_call(self.args)
        return getattr(self.call, "name", "invalid call")


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "arguments"
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


class ToolRegistry:
    """Tools by name."""

    def __init__(self, tools: Iterable[Tool] = ()):
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            self.register(tool)

    @classmethod
    def default(cls, entry_points_too: bool = True) -> ToolRegistry:
        """The built-ins plus every tool registered under the ``paravt.tools`` entry-point group."""
        reg = cls(t() for t in [*BUILTINS, *PERCEPTION])
        if entry_points_too:
            loaded = load_entry_points(ENTRY_POINT_GROUP, {}, "tool", make=lambda o: o() if isinstance(o, type) else o)
            for name, tool in loaded.items():
                try:
                    reg.register(tool)
                except TypeError as exc:  # not a Tool: a warning, as any broken plugin
                    log.warning("tool plugin %s could not be loaded: %s", name, exc)
        return reg

    def register(self, tool: Tool) -> None:
        if not isinstance(tool, Tool):
            raise TypeError(f"{tool!r} is not a paravt Tool")
        self._tools[tool.name] = tool

    def subset(self, names: Sequence[str]) -> ToolRegistry:
        missing = [n for n in names if n not in self._tools]
        if missing:
            raise ToolError(f"unknown tools {missing}; available: {', '.join(self.names())}")
        return ToolRegistry(self._tools[n] for n in names)

    def names(self) -> list[str]:
        return list(self._tools)

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._tools

    def __iter__(self):
        return iter(self._tools.values())

    def schemas(self) -> list[dict]:
        return [t.schema() for t in self._tools.values()]

    def signatures(self) -> dict[str, list[str]]:
        """Positional parameter orders, for :func:`paravt_agent.protocol.parse_tool_calls`."""
        return {t.name: list(t.positional) for t in self._tools.values()}

    def prepare(
        self, calls: Sequence[ToolCall | CallError], ctx: ToolContext, max_calls: int | None = None,
        drop_extra: bool = False,
    ) -> list[PreparedCall]:
        """Validate one turn's calls. Every call gets a slot; invalid ones get an error text.

        Rules (all here, nowhere else): unknown tools, bad arguments, windows outside
        the video (start >= end, negative or beyond-the-end start; end is clamped),
        a ``video_path`` naming another file, duplicates within the turn, and calls
        beyond ``max_calls`` (an error slot each, or dropped without a slot when ``drop_extra``).
        """
        out: list[PreparedCall] = []
        seen: dict[tuple, int] = {}
        if drop_extra and max_calls is not None:
            calls = calls[:max_calls]
        if max_calls is not None and len(calls) > max_calls + 1:
            # one slot sums up the calls past the cap: what one turn can produce stays bounded
            extra = len(calls) - max_calls
            summary = CallError(f"{extra} more tool calls not run: at most {max_calls} per turn", "", "tool_call")
            calls = [*calls[:max_calls], summary]
        for i, call in enumerate(calls):
            p = PreparedCall(i, call)
            out.append(p)
            if isinstance(call, CallError):
                p.error = call.message
                continue
            if max_calls is not None and i >= max_calls:
                p.error = f"not run: at most {max_calls} tool calls per turn"
                continue
            tool = self._tools.get(call.name)
            if tool is None:
                p.error = f"unknown tool {call.name!r}; available: {', '.join(self._tools)}"
                continue
            try:
                args = tool.Args.model_validate(call.arguments)
                path = getattr(args, "video_path", None)
                if path is not None:
                    self._check_video_path(str(path), ctx)
                    args = args.model_copy(update={"video_path": None})
                args = tool.check(args, ctx)
            except ValidationError as exc:
                p.error = f"invalid arguments for {call.name}: {_validation_message(exc)}"
                continue
            except ToolError as exc:
                p.error = f"invalid call of {call.name}: {exc}"
                continue
            key = (tool.name, json.dumps(args.model_dump(mode="json"), sort_keys=True))  # lists (objects) too
            if key in seen:
                p.error = f"duplicate of call {seen[key] + 1} in this turn; not run again"
                continue
            seen[key] = i
            p.tool, p.args = tool, args
        return out

    @staticmethod
    def _check_video_path(path: str, ctx: ToolContext) -> None:
        """The model never chooses the file: a path is only compared with the session's video."""
        given = path.strip()
        if not ctx.strict_video_path or given in _PLACEHOLDER_PATHS or given == ctx.video.path:
            return
        if os.path.basename(given) != os.path.basename(ctx.video.path):
            raise ToolError(
                f"video_path {given!r} is not the video of this question; only the current video can be cropped"
            )


def registry_of(tools) -> ToolRegistry:
    """A registry from what a user passed to ``Agent(tools=...)``: None (the default: built-ins and plugins), a
    registry, or tool instances."""
    if tools is None:
        return ToolRegistry.default()
    if isinstance(tools, ToolRegistry) or (hasattr(tools, "prepare") and hasattr(tools, "subset")):
        return tools
    tools = list(tools)
    bad = [t for t in tools if not (hasattr(t, "run") and hasattr(t, "schema") and hasattr(t, "name"))]
    if bad:
        raise ConfigError(f"tools must be paravt Tool instances, got {bad[0]!r}")
    return ToolRegistry(tools)
