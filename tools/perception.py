"""Model-backed perception tools (Weaver's set): a tool that asks a model about the video's frames.

Each asks ``ctx.model`` (:class:`~paravt_agent.types.ToolModel`): the agent's own policy, or the endpoint the
agent config names for the tool (``tool_models``). The graph records each of those model calls with role
``tool:<name>``, so RL can train them or leave them frozen (``paravt-train grpo --set tool_model_calls=...``).

* ``temporal_grounding(query, start_time?, end_time?)``: the span where an event happens, as the model grounds
  it over the window's labelled frames (its reply read by the protocol's span parser).
* ``frame_selection(query, start_time?, end_time?)``: the one frame that best matches; the model gives each of
  the window's frames a confidence (Weaver's frame selector) and the best is kept, with its time.
* ``spatial_grounding(objects, time)``: boxes of the named objects in the frame at ``time`` in Qwen-VL's box
  format (``[{"bbox_2d": [x1, y1, x2, y2], "label": ...}]``), and the crop of each box as evidence.
* ``trim(start_time, end_time)``: ``crop_video``'s sibling that returns the window's frames themselves to the
  planner (the released protocols that want frames), whatever the layout's ``evidence``.
"""

from __future__ import annotations

import asyncio
import json
import math
import re

import numpy as np
from pydantic import BaseModel, Field, field_validator

from paravt_agent.errors import ToolError, VideoError
from paravt_agent.prompts import frame_parts
from paravt_agent.protocol import format_time, parse_span, parse_time
from paravt_agent.video import fit_size
from tools.base import Tool, ToolContext, ToolResult, check_window
from tools.builtin import CropVideo

__all__ = ["FrameSelection", "SpatialGrounding", "TemporalGrounding", "Trim", "PERCEPTION", "parse_boxes",
           "parse_confidence"]


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

    async def frames(self, args: QueryWindowArgs, ctx: ToolContext):
        try:
            return await asyncio.to_thread(ctx.video.crop, args.start_time, args.end_time, ctx.frames)
        except VideoError as exc:
            raise ToolError(str(exc)) from exc

    @staticmethod
    def model(ctx: ToolContext):
        if ctx.model is None:
            raise ToolError("this tool asks a model, and none was given (run it through the agent graph)")
        return ctx.model


GROUNDING_PROMPT = ("Find when this happens in the frames above: {query}\n"
                    "Answer with its start and end second as [start, end], or 'none' if it is not shown.")


class TemporalGrounding(_QueryWindowTool):
    name = "temporal_grounding"
    description = ("Find WHEN an event happens: a model looks at frames of [start_time, end_time] (default: the "
                   "whole video) and returns the span where `query` is shown, in seconds.")

    async def run(self, args: QueryWindowArgs, ctx: ToolContext) -> ToolResult:
        clip = await self.frames(args, ctx)
        window = (args.start_time, args.end_time)
        content = [*frame_parts(clip.frames, clip.timestamps), {"type": "text", "text": GROUNDING_PROMPT.format(
            query=args.query.strip())}]
        reply = await self.model(ctx).ask([{"role": "user", "content": content}], max_new_tokens=64)
        span = parse_span(reply.split("</think>")[-1])
        if span is None:
            return ToolResult(text=f"{args.query!r}: not found between {format_time(window[0])} and "
                                   f"{format_time(window[1])}.", window=window, meta={"span": None, "reply": reply})
        a, b = sorted(span)
        if b <= window[0] or a >= window[1]:  # a span outside the window searched is no finding
            span = None
        if span is None:
            return ToolResult(text=f"{args.query!r}: not found between {format_time(window[0])} and "
                                   f"{format_time(window[1])}.", window=window, meta={"span": None, "reply": reply})
        a, b = max(a, window[0]), min(b, window[1])
        return ToolResult(text=f"{args.query!r}: from {a:g} to {b:g} seconds ([{a:g}, {b:g}]).", window=window,
                          meta={"span": (a, b), "reply": reply}, warnings=list(clip.warnings))


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


class SpatialArgs(BaseModel):
    objects: list[str] = Field(min_length=1, max_length=8, description="The objects to locate, in words.")
    time: float = Field(description="The moment to look at, in seconds (MM:SS also accepted).")

    @field_validator("objects", mode="before")
    @classmethod
    def _objects(cls, v):
        return [p.strip() for p in v.split(",") if p.strip()] if isinstance(v, str) else v

    @field_validator("time", mode="before")
    @classmethod
    def _seconds(cls, v):
        return parse_time(v)


SPATIAL_PROMPT = ("Locate every {objects} in this image. Output a JSON list "
                  '[{{"bbox_2d": [x1, y1, x2, y2], "label": "name"}}] in {coords}, '
                  "or [] if none is visible.")


def _boxes_of(value) -> list[tuple[str, tuple[float, float, float, float]]]:
    items = value if isinstance(value, list) else [value]
    out = []
    for it in items:
        box = it.get("bbox_2d", it.get("bbox")) if isinstance(it, dict) else None
        if isinstance(box, list) and len(box) == 4 and all(
                isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in box):
            out.append((str(it.get("label", "")), tuple(float(v) for v in box)))
    return out


def parse_boxes(text: str) -> tuple[list[tuple[str, tuple[float, float, float, float]]], str]:
    """``([(label, (x1, y1, x2, y2)), ...], kind)`` of a reply in Qwen-VL's box formats: JSON (a list of
    ``{"bbox_2d": [...], "label": ...}`` or one such object, in a code fence or not; ``kind`` ``json``), or
    ``<|box_start|>(x1,y1),(x2,y2)<|box_end|>`` after an optional ``<|object_ref_start|>label<|object_ref_end|>``
    (``kind`` ``tokens``: 0-1000 coordinates). The first JSON value that holds a box wins; malformed and non-finite
    boxes are skipped."""
    body = text.split("</think>")[-1]
    decoder = json.JSONDecoder()
    for m in re.finditer(r"[\[{]", body):
        try:
            value, _ = decoder.raw_decode(body, m.start())
        except ValueError:
            continue
        found = _boxes_of(value)
        if found:
            return found, "json"
    tokens = re.findall(r"(?:<\|object_ref_start\|>(.*?)<\|object_ref_end\|>)?\s*<\|box_start\|>"
                        r"\(\s*([\d.]+)\s*,\s*([\d.]+)\s*\)\s*,\s*\(\s*([\d.]+)\s*,\s*([\d.]+)\s*\)"
                        r"<\|box_end\|>", body)
    out = []
    for label, *xy in tokens:
        try:
            out.append((label, tuple(float(v) for v in xy)))
        except ValueError:
            continue
    return out, "tokens"


class SpatialGrounding(Tool):
    name = "spatial_grounding"
    description = ("Find WHERE objects are in the frame at `time`: a model returns a box per object (pixel "
                   "coordinates of the video frame), and the crop of each box comes back as evidence.")
    Args = SpatialArgs
    positional = ["objects", "time"]
    visual = True
    uses_model = True
    #: the side the crops are scaled to fit (pixels), so every box's evidence has a readable size
    crop_pixels = 224 * 224

    def check(self, args: SpatialArgs, ctx: ToolContext) -> SpatialArgs:
        if not 0 <= args.time < ctx.duration:
            raise ToolError(f"time {args.time:g}s is outside the video (0 to {ctx.duration:.1f}s)")
        return args

    def window(self, args: SpatialArgs) -> tuple[float, float] | None:
        return (float(args.time), float(args.time))

    def describe_call(self, args: SpatialArgs) -> str:
        return f"spatial_grounding({', '.join(args.objects)} at {format_time(args.time)})"

    async def run(self, args: SpatialArgs, ctx: ToolContext) -> ToolResult:
        from PIL import Image


        if ctx.model is None:
            raise ToolError("this tool asks a model, and none was given (run it through the agent graph)")
        info = ctx.video.info
        full = await asyncio.to_thread(ctx.video.sample, [args.time], max_pixels=info.width * info.height, factor=2)
        big = full.frames[0]
        H, W = big.shape[:2]
        h, w = fit_size(H, W, ctx.frames.max_pixels, ctx.frames.factor)
        shown = np.asarray(Image.fromarray(big).resize((w, h), Image.BICUBIC))
        t = float(full.timestamps[0])
        coords = ("coordinates from 0 to 1000 relative to the image's sides"
                  if getattr(ctx.model, "box_coordinates", "pixels") == "relative-1000"
                  else f"pixel coordinates of this {w}x{h} image")
        prompt = SPATIAL_PROMPT.format(objects=" and every ".join(args.objects), coords=coords)
        reply = await ctx.model.ask([{"role": "user", "content": [*frame_parts(shown[None], [t]),
                                                                 {"type": "text", "text": prompt}]}],
                                    max_new_tokens=48 * len(args.objects) + 16)
        found, crops, lines = [], [], []
        boxes, kind = parse_boxes(reply)
        relative = kind == "tokens" or getattr(ctx.model, "box_coordinates", "pixels") == "relative-1000"
        for label, (x1, y1, x2, y2) in boxes:
            sx, sy = (W / 1000, H / 1000) if relative else (W / w, H / h)  # the model's box -> the video's pixels
            box = (max(0, round(min(x1, x2) * sx)), max(0, round(min(y1, y2) * sy)),
                   min(W, round(max(x1, x2) * sx)), min(H, round(max(y1, y2) * sy)))
            if box[2] - box[0] < 2 or box[3] - box[1] < 2:
                continue
            region = Image.fromarray(big).crop(box)
            ch, cw = fit_size(region.height, region.width, self.crop_pixels, ctx.frames.factor)
            crops.append(np.asarray(region.resize((cw, ch), Image.BICUBIC)))
            found.append({"label": label, "box": list(box)})
            lines.append(f"{label or 'object'}: [{box[0]}, {box[1]}, {box[2]}, {box[3]}]")
        where = f"at {t:g} seconds ({W}x{H} frame)"
        if not found:
            return ToolResult(text=f"No box for {', '.join(args.objects)} {where}.", window=(t, t),
                              meta={"boxes": [], "reply": reply})
        return ToolResult(text=f"Boxes {where}: " + "; ".join(lines) + ".", frames=crops,
                          timestamps=[t] * len(crops), window=(t, t), meta={"boxes": found, "reply": reply})


class Trim(CropVideo):
    name = "trim"
    description = ("Cut the window [start_time, end_time] out of the video and look at its frames yourself: they "
                   "come back to you as images (crop_video returns a sub-agent's summary instead).")
    evidence = "frames"

    def describe_call(self, args) -> str:
        return f"trim({format_time(args.start_time)}-{format_time(args.end_time)})"


PERCEPTION: list[type[Tool]] = [TemporalGrounding, FrameSelection, SpatialGrounding, Trim]
