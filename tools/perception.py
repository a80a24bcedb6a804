"""Model-backed perception tools (Weaver's set, Table 1): a tool that asks a model about the video's frames.

Each asks ``ctx.model`` (:class:`~paravt_agent.types.ToolModel`): the agent's own policy, or the endpoint the
agent config names for the tool (``tool_models``). The graph records each of those model calls with role
``tool:<name>``, so RL can train them or leave them frozen (``paravt-train grpo --set tool_model_calls=...``;
Weaver keeps its tools frozen).

* ``temporal_grounding(query, start_time?, end_time?)``: the span where an event happens. The window is cut into
  crops at the crop protocol's rate (:func:`clips_of`: ``crop_max_frames`` frames at ``crop_fps``, at most
  :data:`MAX_CLIPS`), the model grounds the query in each crop (concurrently; its reply read by the protocol's span
  parser) and the spans found are merged. The grounded clip's frames are optional evidence: they reach the planner
  under ``layout.evidence: frames`` (Weaver's interleaved context), elsewhere the text is the result.
* ``temporal_count(query, start_time?, end_time?)``: the same crops; the model judges whether the query occurs in
  each, and the crops where it does come back spliced together (their frames, merged where adjacent) for the
  caller to count in.
* ``frame_selection(query, start_time?, end_time?)``: the one frame that best matches; the model gives each of
  the window's frames a confidence (Weaver's frame selector) and the best is kept, with its time.
* ``spatial_grounding``, ``spatial_tracking``: :mod:`tools.spatial`.
* ``trim(start_time, end_time)``: ``crop_video``'s sibling that returns the window's frames themselves to the
  planner (the released protocols that want frames), whatever the layout's ``evidence``.
"""

from __future__ import annotations

import asyncio
import math
import re

import numpy as np
from pydantic import BaseModel, Field, field_validator

from paravt_agent.errors import ToolError, VideoError
from paravt_agent.prompts import frame_parts
from paravt_agent.protocol import format_time, parse_span, parse_time
from tools.base import Tool, ToolContext, ToolResult, check_window
from tools.builtin import CropVideo
from tools.spatial import SpatialGrounding, SpatialTracking, parse_boxes

__all__ = ["FrameSelection", "MAX_CLIPS", "PERCEPTION", "SpatialGrounding", "SpatialTracking", "TemporalCount",
           "TemporalGrounding", "Trim", "clips_of", "merge_spans", "parse_boxes", "parse_confidence"]

#: crops a query tool asks about at most: a longer window is cut into this many, each still ``crop_max_frames``
MAX_CLIPS = 8


def clips_of(start: float, end: float, frames) -> list[tuple[float, float]]:
    """The crops a query tool cuts ``[start, end]`` into: consecutive windows of ``crop_max_frames`` frames at
    ``crop_fps`` ([0, 15], [16, 31], ... at 16 frames and 1 fps), the last one ending at ``end``; at most
    :data:`MAX_CLIPS` (a longer window is cut into that many equal crops, sampled more sparsely). Without a
    ``crop_fps`` the window is one crop."""
    if frames.crop_fps is None:
        return [(start, end)]
    span = frames.crop_max_frames / frames.crop_fps
    n = math.ceil((end - start) / span - 1e-9)
    if n <= 1:
        return [(start, end)]
    if n > MAX_CLIPS:
        n, span = MAX_CLIPS, (end - start) / MAX_CLIPS
    gap = span / frames.crop_max_frames  # one frame's spacing: the next crop starts a frame after this one ends
    return [(start + i * span, min(end, start + (i + 1) * span - gap)) for i in range(n)]


def merge_spans(spans: list[tuple[float, float]], gap: float) -> list[tuple[float, float]]:
    """Spans sorted and merged where they touch or are at most ``gap`` apart (one frame: the same event seen by
    two neighbouring crops)."""
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1] + gap + 1e-6:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


class QueryWindowArgs(BaseModel):
    query: str = Field(min_length=1, max_length=500, description="What to look for, in words.")
    start_time: float | None = Field(None, description="Start of the range to search, in seconds (default: 0).")
    end_time: float | None = Field(None, description="End of the range to search (default: end of the video).")

    @field_validator("start_time", "end_time", mode="before")
    @classmethod
    def _seconds(cls, v):
        return None if v is None else parse_time(v)


class _QueryWindowTool(Tool):
    Args = QueryWindowArgs
    positional = ["query", "start_time", "end_time"]
    uses_model = True

    def check(self, args: QueryWindowArgs, ctx: ToolContext) -> QueryWindowArgs:
        start = 0.0 if args.start_time is None else args.start_time
        end = ctx.duration if args.end_time is None else args.end_time
        start, end = check_window(start, end, ctx.duration)
        return args.model_copy(update={"start_time": start, "end_time": end})

    def window(self, args: QueryWindowArgs) -> tuple[float, float] | None:
        if args.start_time is None or args.end_time is None:
            return None
        return (float(args.start_time), float(args.end_time))

    def describe_call(self, args: QueryWindowArgs) -> str:
        where = "" if self.window(args) is None else f", {format_time(args.start_time)}-{format_time(args.end_time)}"
        return f"{self.name}({args.query!r}{where})"

    async def frames(self, args: QueryWindowArgs, ctx: ToolContext, window: tuple[float, float] | None = None):
        a, b = window or (args.start_time, args.end_time)
        try:
            return await asyncio.to_thread(ctx.video.crop, a, b, ctx.frames)
        except VideoError as exc:
            raise ToolError(str(exc)) from exc

    async def ask_clips(self, args: QueryWindowArgs, ctx: ToolContext, prompt: str, max_new_tokens: int) -> list:
        """``[(crop window, clip, reply)]``: the model asked ``prompt`` about each crop of the window
        (:func:`clips_of`), concurrently."""
        model = self.model(ctx)
        wins = clips_of(args.start_time, args.end_time, ctx.frames)
        clips = await asyncio.gather(*(self.frames(args, ctx, w) for w in wins))

        async def one(clip):
            content = [*frame_parts(clip.frames, clip.timestamps), {"type": "text", "text": prompt}]
            return await model.ask([{"role": "user", "content": content}], max_new_tokens=max_new_tokens)

        replies = await asyncio.gather(*(one(c) for c in clips))
        return list(zip(wins, clips, replies, strict=True))

    @staticmethod
    def model(ctx: ToolContext):
        if ctx.model is None:
            raise ToolError("this tool asks a model, and none was given (run it through the agent graph)")
        return ctx.model


def _spacing(clip, window: tuple[float, float]) -> float:
    """The time between two of a crop's frames (its window when it has one frame)."""
    ts = clip.timestamps
    return (ts[-1] - ts[0]) / (len(ts) - 1) if len(ts) > 1 else window[1] - window[0]


GROUNDING_PROMPT = ("Find when this happens in the frames above: {query}\n"
                    "Answer with its start and end second as [start, end], or 'none' if it is not shown.")


class TemporalGrounding(_QueryWindowTool):
    name = "temporal_grounding"
    description = ("Find WHEN an event happens: a model looks at frames of [start_time, end_time] (default: the "
                   "whole video), crop by crop, and returns the span where `query` is shown, in seconds.")

    async def run(self, args: QueryWindowArgs, ctx: ToolContext) -> ToolResult:
        window = (args.start_time, args.end_time)
        asked = await self.ask_clips(args, ctx, GROUNDING_PROMPT.format(query=args.query.strip()), 64)
        spans, gap, warnings = [], 0.0, []
        for (a0, b0), clip, reply in asked:
            step = _spacing(clip, (a0, b0))
            gap = max(gap, step)
            warnings += clip.warnings
            span = parse_span(reply.split("</think>")[-1])
            if span is None:
                continue
            a, b = sorted(span)
            if b <= a0 or a > b0 + step:  # a span outside the crop searched is no finding
                continue
            spans.append((max(a, a0), min(b, b0 + step)))  # a span may end a frame after the crop's last frame
        replies = [r for _, _, r in asked]
        found = merge_spans(spans, gap)
        if not found:
            return ToolResult(text=f"{args.query!r}: not found between {format_time(window[0])} and "
                                   f"{format_time(window[1])}.", window=window,
                              meta={"span": None, "reply": replies[0] if len(replies) == 1 else replies})
        a, b = max(found, key=lambda s: (s[1] - s[0], -s[0]))  # the longest stretch (the earliest of equal ones)
        a, b = max(a, window[0]), min(b, ctx.duration)
        text = f"{args.query!r}: from {a:g} to {b:g} seconds ([{a:g}, {b:g}])."
        if len(found) > 1:
            text += " Also: " + ", ".join(f"[{x:g}, {y:g}]" for x, y in found if (x, y) != (a, b)) + "."
        try:  # the grounded clip, for a planner that reads frames (layout evidence: frames)
            grounded = await asyncio.to_thread(ctx.video.crop, a, max(b, a + 1e-3), ctx.frames)
            frames, times = grounded.frames, list(grounded.timestamps)
        except VideoError:
            frames, times = None, []
        return ToolResult(text=text, window=window, frames=frames, timestamps=times, frames_optional=True,
                          meta={"span": (a, b), "spans": found, "reply": replies[0] if len(replies) == 1 else replies},
                          warnings=warnings)


COUNT_PROMPT = ("Does this happen in the frames above: {query}\n"
                "Answer yes or no.")


class TemporalCount(_QueryWindowTool):
    name = "temporal_count"
    description = ("Find EVERY part of [start_time, end_time] (default: the whole video) where `query` happens, "
                   "to count it: a model judges crop by crop whether it occurs, and the crops where it does come "
                   "back spliced together as one clip.")
    visual = True
    #: frames the spliced clip holds at most (evenly thinned beyond)
    max_frames = 32

    async def run(self, args: QueryWindowArgs, ctx: ToolContext) -> ToolResult:
        asked = await self.ask_clips(args, ctx, COUNT_PROMPT.format(query=args.query.strip()), 8)
        hits = [(w, clip) for w, clip, reply in asked if parse_confidence(reply) >= 0.5]
        where = f"between {format_time(args.start_time)} and {format_time(args.end_time)}"
        meta = {"clips": [list(w) for w, _ in hits], "replies": [r for _, _, r in asked]}
        if not hits:
            return ToolResult(text=f"{args.query!r} does not occur {where}.", window=(args.start_time, args.end_time),
                              meta=meta)
        gap = max(_spacing(c, w) for w, c in hits)
        merged = merge_spans([w for w, _ in hits], gap)
        frames = np.concatenate([c.frames for _, c in hits])
        times = [float(t) for _, c in hits for t in c.timestamps]
        if len(times) > self.max_frames:
            keep = np.linspace(0, len(times) - 1, self.max_frames).round().astype(int)
            frames, times = frames[keep], [times[k] for k in keep]
        text = (f"{args.query!r} occurs in {len(hits)} of {len(asked)} clips {where}: "
                + ", ".join(f"[{a:g}, {b:g}]" for a, b in merged) + " (spliced below).")
        return ToolResult(text=text, frames=frames, timestamps=times, window=(args.start_time, args.end_time),
                          meta={**meta, "merged": [list(m) for m in merged]},
                          warnings=[w for _, c in hits for w in c.warnings])


SELECTION_PROMPT = ("Does this frame show: {query}\n"
                    "Answer with your confidence from 0 (not at all) to 1 (certainly), as a number.")
_NUMBER_RE = re.compile(r"(?<![\w.])(\d{1,3}(?:\.\d+)?|\.\d+)(\s*%)?")
_ANCHORED_RE = re.compile(r"confidence\D{0,12}?(\d{1,3}(?:\.\d+)?|\.\d+)(\s*%)?", re.I)


def parse_confidence(text: str) -> float:
    """A reply's confidence in [0, 1]: the number after "confidence" if there is one, else the reply's last number
    (0-1; 0-10 and percentages scaled), else yes/no, else 0."""
    body = text.split("</think>")[-1]
    m = _ANCHORED_RE.search(body) or next(reversed(list(_NUMBER_RE.finditer(body))), None)
    if m:
        v = float(m.group(1))
        if m.group(2) or v > 10:
            v /= 100.0
        elif v > 1:
            v /= 10.0
        return min(max(v, 0.0), 1.0)
    low = body.strip().lower()
    return 1.0 if low.startswith(("yes", "true")) else 0.0


class FrameSelection(_QueryWindowTool):
    name = "frame_selection"
    description = ("Find the ONE frame of [start_time, end_time] (default: the whole video) that best shows "
                   "`query`: a model scores every frame and the best one comes back with its time.")
    visual = True

    async def run(self, args: QueryWindowArgs, ctx: ToolContext) -> ToolResult:
        clip = await self.frames(args, ctx)
        model = self.model(ctx)
        prompt = SELECTION_PROMPT.format(query=args.query.strip())
        replies = await asyncio.gather(*(model.ask([{"role": "user", "content": [
            *frame_parts(f[None], [t]), {"type": "text", "text": prompt}]}], max_new_tokens=16)
            for f, t in zip(clip.frames, clip.timestamps, strict=True)))
        scores = [parse_confidence(r) for r in replies]
        best = int(np.argmax(scores))  # the earliest of equal scores
        if scores[best] <= 0:  # no frame shows it (or no reply said so)
            return ToolResult(text=f"No frame shows {args.query!r} between {format_time(args.start_time)} and "
                                   f"{format_time(args.end_time)}.", window=(args.start_time, args.end_time),
                              meta={"time": None, "scores": dict(zip(clip.timestamps, scores, strict=True))})
        t = float(clip.timestamps[best])
        text = f"Best frame for {args.query!r}: {t:g} seconds ({format_time(t)}), confidence {scores[best]:.2f}."
        return ToolResult(text=text, frames=clip.frames[best:best + 1], timestamps=[t], window=(t, t),
                          meta={"time": t, "scores": dict(zip(clip.timestamps, scores, strict=True))},
                          warnings=list(clip.warnings))


class Trim(CropVideo):
    name = "trim"
    description = ("Cut the window [start_time, end_time] out of the video and look at its frames yourself: they "
                   "come back to you as images (crop_video returns a sub-agent's summary instead).")
    evidence = "frames"

    def describe_call(self, args) -> str:
        return f"trim({format_time(args.start_time)}-{format_time(args.end_time)})"


PERCEPTION: list[type[Tool]] = [TemporalGrounding, FrameSelection, SpatialGrounding, Trim, TemporalCount,
                                 SpatialTracking]
