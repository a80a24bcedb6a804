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

from paravt_agent.errors import ToolError
from paravt_agent.protocol import parse_time
from paravt_agent.video import VideoReader

__all__ = ["Tool", "ToolContext", "ToolResult", "TimeWindowArgs", "check_window", "clean_schema"]


@dataclass
class ToolContext:
    """The session a call runs in: the one video it may read and the frame settings."""

    video: VideoReader
    crop_max_frames: int = 16
    crop_fps: float | None = 2.0
    max_pixels: int = 50176
    factor: int = 32
    strict_video_path: bool = True

    @property
    def duration(self) -> float:
        return self.video.info.duration


@dataclass
class ToolResult:
    """Text for the tool-response slot, or frames a sub-agent must summarise."""

    text: str = ""
    frames: np.ndarray | None = None
    timestamps: list[float] = field(default_factory=list)
    window: tuple[float, float] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def is_visual(self) -> bool:
        return self.frames is not None and len(self.frames) > 0


def check_window(start: float, end: float, duration: float) -> tuple[float, float]:
    """The one window rule: ``0 <= start < end``, ``start`` inside the video, ``end`` clamped to it."""
    if start < 0:
        raise ToolError(f"start_time {start:g}s is negative")
    if start >= end:
        raise ToolError(f"start_time {start:g}s must be before end_time {end:g}s")
    if start >= duration:
        raise ToolError(f"start_time {start:g}s is beyond the end of the video ({duration:.1f}s)")
    return start, min(end, duration)


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

    def describe_call(self, args: BaseModel) -> str:
        """A short human label of a call, for traces."""
        fields = ", ".join(f"{k}={v}" for k, v in args.model_dump(exclude_none=True).items())
        return f"{self.name}({fields})"
