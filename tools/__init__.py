"""Pluggable tools: :class:`Tool`, the built-ins and the :class:`ToolRegistry`."""

from tools.base import TimeWindowArgs, Tool, ToolContext, ToolResult, check_window
from tools.registry import ENTRY_POINT_GROUP, PreparedCall, ToolRegistry

__all__ = [
    "ENTRY_POINT_GROUP",
    "PreparedCall",
    "TimeWindowArgs",
    "Tool",
    "ToolContext",
    "ToolRegistry",
    "ToolResult",
    "check_window",
]
