"""The text protocol shared by the runtime, the reward and evaluation: pure functions, no I/O.

What the agent accepts at deployment is exactly what RL rewards as parseable (ARCHITECTURE.md, decision 7).
Model output is untrusted input: every parser here runs in time linear in its input, never raises on what a model
wrote (a call that cannot be parsed becomes a :class:`CallError`), and bounds its work.

- :mod:`~paravt_agent.protocol.times`: seconds from ``80``, ``"1:20"``, ``"80.5s"``; spans in answers.
- :mod:`~paravt_agent.protocol.calls`: tool calls in a response (JSON, flat, Python-call styles).
- :mod:`~paravt_agent.protocol.answers`: the answer (``<answer>`` → after ``</think>`` → last line), tag balance,
  option letters, degenerate output.
- :mod:`~paravt_agent.protocol.tags`: text made safe to place between protocol tags (:func:`neutralize`).
- :mod:`~paravt_agent.protocol.presets`: the released checkpoints' protocols (prompts, schemas, limits).

Everything public is importable from here (``from paravt_agent.protocol import parse_tool_calls``).
"""

from paravt_agent.protocol.answers import (
    LETTERS,
    TAGS,
    TagStat,
    extract_answer,
    extract_choice,
    is_degenerate,
    labelled_options,
    option_body,
    split_options,
    split_think,
    strip_tool_blocks,
    subagent_report,
    tag_stats,
)
from paravt_agent.protocol.calls import (
    CALL_TAGS,
    DEFAULT_SIGNATURES,
    MAX_CALL_CHARS,
    MAX_CALLS,
    CallError,
    ToolCall,
    parse_tool_calls,
    render_tool_call,
)
from paravt_agent.protocol.tags import neutralize
from paravt_agent.protocol.times import MAX_SECONDS, format_time, parse_span, parse_time

__all__ = [
    "CALL_TAGS",
    "DEFAULT_SIGNATURES",
    "LETTERS",
    "MAX_CALLS",
    "MAX_CALL_CHARS",
    "MAX_SECONDS",
    "TAGS",
    "CallError",
    "TagStat",
    "ToolCall",
    "extract_answer",
    "extract_choice",
    "format_time",
    "is_degenerate",
    "labelled_options",
    "neutralize",
    "option_body",
    "parse_span",
    "parse_time",
    "parse_tool_calls",
    "render_tool_call",
    "split_options",
    "split_think",
    "strip_tool_blocks",
    "subagent_report",
    "tag_stats",
]
