"""What a tool is: a name, a description, a pydantic argument model and an async ``run``.

A tool returns a :class:`ToolResult`: text that goes straight into its slot of
the ``<tool_response>``, or visual evidence (frames with timestamps) that a
sub-agent sharing the policy summarises into text first.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from pydantic import AliasChoices, BaseModel, Field, field_validator

from paravt_agent.errors import ToolError, VideoError
from paravt_agent.protocol import parse_time
from paravt_agent.types import ToolContext
from paravt_agent.video import check_window as _video_window

__all__ = ["Tool", "ToolContext", "ToolResult", "TimeWindowArgs", "check_window", "clean_schema"]


@dataclass
class ToolResult:
    """Text for the tool-response slot, or frames a sub-agent must summarise."""

    text: str = ""
    frames: np.ndarray | None = None
    timestamps: list[float] = field(default_factory=list)
    window: tuple[float, float] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # what the caller should know (frames a damaged file lacked)
    #: the frames are optional evidence (the grounded clip of ``temporal_grounding``): they go to the planner
    #: under ``layout.evidence: frames`` (Weaver's interleaved context); elsewhere the text alone is the result
    frames_optional: bool = False

    @property
    def is_visual(self) -> bool:
        return self.frames is not None and len(self.frames) > 0


def check_window(start: float, end: float, duration: float) -> tuple[float, float]:
    """The video module's window rule (:func:`paravt_agent.video.check_window`), as a :class:`ToolError`."""
    try:
        return _video_window(start, end, duration)
    except VideoError as exc:
        raise ToolError(str(exc)) from None


class TimeWindowArgs(BaseModel):
    """Arguments ``start_time`` / ``end_time`` in seconds (``MM:SS`` and ``HH:MM:SS`` accepted)."""

    start_time: float = Field(
        validation_alias=AliasChoices("start_time", "start", "start_sec", "begin"),
        description="Start of the window in seconds (MM:SS or HH:MM:SS also accepted).",
    )
    end_time: float = Field(
        validation_alias=AliasChoices("end_time", "end", "end_sec", "stop"),
        description="End of the window in seconds (MM:SS or HH:MM:SS also accepted).",
    )

    @field_validator("start_time", "end_time", mode="before")
    @classmethod
    def _seconds(cls, v):
        try:
            return parse_time(v)
        except ValueError as exc:
            raise ValueError(str(exc)) from None


def clean_schema(schema: dict) -> dict:
    """A pydantic JSON schema reduced to the OpenAI function-parameter shape (type/properties/required)."""
    props = {}
    for name, spec in schema.get("properties", {}).items():
        spec = dict(spec)
        if "anyOf" in spec:  # Optional[X] -> X
            kinds = [s for s in spec.pop("anyOf") if s.get("type") != "null"]
            if kinds:
                spec.update(kinds[0])
        spec.pop("title", None)
        if spec.get("default", 0) is None:
            spec.pop("default")
        props[name] = spec
    return {"type": "object", "properties": props, "required": list(schema.get("required", []))}


class Tool(ABC):
    """Subclass with ``name``, ``description``, ``Args`` and ``run``; register in :mod:`tools.registry`."""

    name: ClassVar[str]
    description: ClassVar[str]
    Args: ClassVar[type[BaseModel]]
    #: Parameter order for Python-call style calls, e.g. ``crop_video("v.mp4", 80, 150)``.
    positional: ClassVar[list[str]] = []
    #: True when ``run`` returns frames a sub-agent summarises.
    visual: ClassVar[bool] = False
    #: True when ``run`` asks a model (``ctx.model``, a :class:`~paravt_agent.types.ToolModel`): the graph gives
    #: the call its model session and records every model call it makes (role ``tool:<name>``)
    uses_model: ClassVar[bool] = False
    #: ``frames``: the result's frames go to the planner as they are, whatever the layout's ``evidence``
    #: (``trim``); None: the layout decides (a sub-agent's summary, or frames)
    evidence: ClassVar[str | None] = None

    def schema(self) -> dict:
        """The tool as an OpenAI-style function: ``{"type": "function", "function": {...}}``."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": clean_schema(self.Args.model_json_schema()),
            },
        }

    def check(self, args: BaseModel, ctx: ToolContext) -> BaseModel:
        """Session-dependent validation (windows against the duration); returns the args to run with."""
        if isinstance(args, TimeWindowArgs):
            start, end = check_window(args.start_time, args.end_time, ctx.duration)
            args = args.model_copy(update={"start_time": start, "end_time": end})
        return args

    @abstractmethod
    async def run(self, args: BaseModel, ctx: ToolContext) -> ToolResult: ...

    def window(self, args: BaseModel) -> tuple[float, float] | None:
        """The time window a call with ``args`` works on, if any (the graph's events and traces show it;
        a reviewer edits it). Time-window tools have one; override for other argument shapes."""
        if isinstance(args, TimeWindowArgs):
            return (float(args.start_time), float(args.end_time))
        return None

    def describe_call(self, args: BaseModel) -> str:
        """A short human label of a call, for traces."""
        fields = ", ".join(f"{k}={v}" for k, v in args.model_dump(exclude_none=True).items())
        return f"{self.name}({fields})"
