"""Weaver's spatial tools, backed by a model: boxes in one frame, and boxes followed through a clip.

* ``spatial_grounding(objects, time)``: boxes of the named objects in the frame at ``time`` in Qwen-VL's box format
  (``[{"bbox_2d": [x1, y1, x2, y2], "label": ...}]``), and the crop of each box as evidence.
* ``spatial_tracking(objects, start_time?, end_time?)``: Weaver's GroundedSAM2 tool (Grounding-DINO boxes the
  objects in the starting frame, SAM2 follows them). Here the model boxes them (the first frame of the clip that
  shows them) and a template tracker follows each box frame to frame; the clip comes back with the boxes drawn on
  its frames (Weaver's "highlighted video clip").
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
from paravt_agent.protocol import format_time, parse_time
from paravt_agent.video import fit_size
from tools.base import Tool, ToolContext, ToolResult, check_window

__all__ = ["SPATIAL_PROMPT", "SpatialArgs", "SpatialGrounding", "SpatialTracking", "TrackArgs", "draw_boxes",
           "parse_boxes", "track_box"]

Box = tuple[float, float, float, float]


def _object_list(v):
    return [p.strip() for p in v.split(",") if p.strip()] if isinstance(v, str) else v


class SpatialArgs(BaseModel):
    objects: list[str] = Field(min_length=1, max_length=8, description="The objects to locate, in words.")
    time: float = Field(description="The moment to look at, in seconds (MM:SS also accepted).")

    @field_validator("objects", mode="before")
    @classmethod
    def _objects(cls, v):
        return _object_list(v)

    @field_validator("time", mode="before")
    @classmethod
    def _seconds(cls, v):
        return parse_time(v)


SPATIAL_PROMPT = ("Locate every {objects} in this image. Output a JSON list "
                  '[{{"bbox_2d": [x1, y1, x2, y2], "label": "name"}}] in {coords}, '
                  "or [] if none is visible.")


def _boxes_of(value) -> list[tuple[str, Box]]:
    items = value if isinstance(value, list) else [value]
    out = []
    for it in items:
        box = it.get("bbox_2d", it.get("bbox")) if isinstance(it, dict) else None
        if isinstance(box, list) and len(box) == 4 and all(
                isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in box):
            out.append((str(it.get("label", "")), tuple(float(v) for v in box)))
    return out


def parse_boxes(text: str) -> tuple[list[tuple[str, Box]], str]:
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


def _relative(ctx: ToolContext) -> bool:
    return getattr(ctx.model, "box_coordinates", "pixels") == "relative-1000"


def _coords_text(ctx: ToolContext, w: int, h: int) -> str:
    return ("coordinates from 0 to 1000 relative to the image's sides" if _relative(ctx)
            else f"pixel coordinates of this {w}x{h} image")


def _seen(ctx: ToolContext, h: int, w: int) -> tuple[int, int]:
    """The ``(height, width)`` the answering model sees an ``h`` x ``w`` image at (its processor's resize, by its frame
    geometry); the image's own size when the geometry is unknown."""
    geometry = getattr(ctx.model, "geometry", None)
    return geometry.seen(h, w) if geometry is not None else (h, w)


async def _ask_boxes(ctx: ToolContext, image: np.ndarray, t: float, objects: list[str]) -> tuple[list, str]:
    """The model's boxes of ``objects`` in ``image`` (shown at time ``t``), in pixels of ``image``: ``(boxes, reply)``.
    A model that writes pixels writes them in the image as it saw it (after its processor's resize: Qwen2.5-VL), so
    those are scaled from that size; 0-1000 boxes from the image's sides."""
    h, w = image.shape[:2]
    sh, sw = _seen(ctx, h, w)
    prompt = SPATIAL_PROMPT.format(objects=" and every ".join(objects), coords=_coords_text(ctx, sw, sh))
    reply = await ctx.model.ask([{"role": "user", "content": [*frame_parts(image[None], [t]),
                                                             {"type": "text", "text": prompt}]}],
                                max_new_tokens=48 * len(objects) + 16)
    boxes, kind = parse_boxes(reply)
    sx, sy = (w / 1000, h / 1000) if kind == "tokens" or _relative(ctx) else (w / sw, h / sh)
    return [(label, (x1 * sx, y1 * sy, x2 * sx, y2 * sy)) for label, (x1, y1, x2, y2) in boxes], reply


def _scaled(box: Box, sx: float, sy: float, W: int, H: int) -> tuple[int, int, int, int]:
    x1, y1, x2, y2 = box
    return (max(0, round(min(x1, x2) * sx)), max(0, round(min(y1, y2) * sy)),
            min(W, round(max(x1, x2) * sx)), min(H, round(max(y1, y2) * sy)))


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
        from PIL import Image  # Pillow comes with the vision extras, not with the SDK's core

        if ctx.model is None:
            raise ToolError("this tool asks a model, and none was given (run it through the agent graph)")
        info = ctx.video.info
        full = await asyncio.to_thread(ctx.video.sample, [args.time], max_pixels=info.width * info.height, factor=2)
        big = full.frames[0]
        H, W = big.shape[:2]
        h, w = fit_size(H, W, ctx.frames.max_pixels, ctx.frames.unit)
        shown = np.asarray(Image.fromarray(big).resize((w, h), Image.BICUBIC))
        t = float(full.timestamps[0])
        boxes, reply = await _ask_boxes(ctx, shown, t, args.objects)
        found, crops, lines = [], [], []
        for label, b in boxes:
            box = _scaled(b, W / w, H / h, W, H)  # the shown frame's pixels -> the video's
            if box[2] - box[0] < 2 or box[3] - box[1] < 2:
                continue
            region = Image.fromarray(big).crop(box)
            ch, cw = fit_size(region.height, region.width, self.crop_pixels, ctx.frames.unit)
            crops.append(np.asarray(region.resize((cw, ch), Image.BICUBIC)))
            found.append({"label": label, "box": list(box)})
            lines.append(f"{label or 'object'}: [{box[0]}, {box[1]}, {box[2]}, {box[3]}]")
        where = f"at {t:g} seconds ({W}x{H} frame)"
        if not found:
            return ToolResult(text=f"No box for {', '.join(args.objects)} {where}.", window=(t, t),
                              meta={"boxes": [], "reply": reply})
        return ToolResult(text=f"Boxes {where}: " + "; ".join(lines) + ".", frames=crops,
                          timestamps=[t] * len(crops), window=(t, t), meta={"boxes": found, "reply": reply})


# --------------------------------------------------------------------------- spatial tracking


def track_box(frames: np.ndarray, start: int, box: tuple[int, int, int, int], radius: int | None = None
              ) -> list[tuple[int, int, int, int] | None]:
    """``box`` (pixels of ``frames[start]``) followed through ``frames[start:]`` by template matching: in each next
    frame, the box-sized patch within ``radius`` pixels of the last position (default: the box's longer side, so a
    clip sampled at 1 fps still follows a fast object) that differs least (sum of squared differences) from the
    patch first boxed. Frames before ``start`` get None."""
    x1, y1, x2, y2 = box
    H, W = frames.shape[1:3]
    tmpl = frames[start, y1:y2, x1:x2].astype(np.float32)
    bh, bw = tmpl.shape[:2]
    r = radius if radius is not None else max(8, bh, bw)
    out: list = [None] * len(frames)
    out[start] = box
    cx, cy = x1, y1
    for j in range(start + 1, len(frames)):
        ax, ay = max(0, cx - r), max(0, cy - r)
        bx, by = min(W - bw, cx + r), min(H - bh, cy + r)
        region = frames[j, ay:by + bh, ax:bx + bw].astype(np.float32)
        windows = np.lib.stride_tricks.sliding_window_view(region, (bh, bw, region.shape[2]))[..., 0, :, :, :]
        cost = ((windows - tmpl) ** 2).sum(axis=(2, 3, 4))
        dy, dx = np.unravel_index(int(np.argmin(cost)), cost.shape)
        cx, cy = ax + int(dx), ay + int(dy)
        out[j] = (cx, cy, cx + bw, cy + bh)
    return out


#: the colour boxes are drawn in (a green none of the toy's colours is)
BOX_COLOUR = (0, 255, 0)


def draw_boxes(frame: np.ndarray, boxes, width: int = 2) -> np.ndarray:
    """A copy of ``frame`` with each ``(x1, y1, x2, y2)`` drawn as a ``width``-pixel rectangle."""
    out = frame.copy()
    H, W = out.shape[:2]
    for x1, y1, x2, y2 in boxes:
        x1, y1, x2, y2 = max(0, x1), max(0, y1), min(W, x2), min(H, y2)
        out[y1:min(y1 + width, y2), x1:x2] = BOX_COLOUR
        out[max(y2 - width, y1):y2, x1:x2] = BOX_COLOUR
        out[y1:y2, x1:min(x1 + width, x2)] = BOX_COLOUR
        out[y1:y2, max(x2 - width, x1):x2] = BOX_COLOUR
    return out


class TrackArgs(BaseModel):
    objects: list[str] = Field(min_length=1, max_length=8, description="The objects to track, in words.")
    start_time: float | None = Field(None, description="Start of the clip, in seconds (default: 0).")
    end_time: float | None = Field(None, description="End of the clip (default: the end of the video).")

    @field_validator("objects", mode="before")
    @classmethod
    def _objects(cls, v):
        return _object_list(v)

    @field_validator("start_time", "end_time", mode="before")
    @classmethod
    def _seconds(cls, v):
        return None if v is None else parse_time(v)


class SpatialTracking(Tool):
    name = "spatial_tracking"
    description = ("Track objects through [start_time, end_time] (default: the whole video): a model boxes them in "
                   "the first frame that shows them, the boxes are followed frame by frame, and the clip comes back "
                   "with the boxes drawn on its frames.")
    Args = TrackArgs
    positional = ["objects", "start_time", "end_time"]
    visual = True
    uses_model = True
    #: frames (evenly spread over the clip) the model is asked to box, in order, until one shows the objects
    detect_tries = 4

    def check(self, args: TrackArgs, ctx: ToolContext) -> TrackArgs:
        start = 0.0 if args.start_time is None else args.start_time
        end = ctx.duration if args.end_time is None else args.end_time
        start, end = check_window(start, end, ctx.duration)
        return args.model_copy(update={"start_time": start, "end_time": end})

    def window(self, args: TrackArgs) -> tuple[float, float] | None:
        return None if args.start_time is None or args.end_time is None else (args.start_time, args.end_time)

    def describe_call(self, args: TrackArgs) -> str:
        return (f"spatial_tracking({', '.join(args.objects)}, {format_time(args.start_time)}-"
                f"{format_time(args.end_time)})")

    async def run(self, args: TrackArgs, ctx: ToolContext) -> ToolResult:
        if ctx.model is None:
            raise ToolError("this tool asks a model, and none was given (run it through the agent graph)")
        try:
            clip = await asyncio.to_thread(ctx.video.crop, args.start_time, args.end_time, ctx.frames)
        except VideoError as exc:
            raise ToolError(str(exc)) from exc
        frames, times = clip.frames, [float(t) for t in clip.timestamps]
        h, w = frames.shape[1:3]
        info = ctx.video.info
        tries = sorted({round(i * (len(frames) - 1) / max(1, self.detect_tries - 1))
                        for i in range(min(self.detect_tries, len(frames)))})
        start, boxes, replies = None, [], []
        for k in tries:
            found, reply = await _ask_boxes(ctx, frames[k], times[k], args.objects)
            replies.append(reply)
            boxes = [(label, b) for label, b in ((lb, _scaled(b, 1.0, 1.0, w, h)) for lb, b in found)
                     if b[2] - b[0] >= 2 and b[3] - b[1] >= 2]
            if boxes:
                start = k
                break
        where = f"between {format_time(args.start_time)} and {format_time(args.end_time)}"
        if start is None:
            return ToolResult(text=f"No box for {', '.join(args.objects)} {where}.",
                              window=(args.start_time, args.end_time), meta={"tracks": {}, "replies": replies})
        tracks = {f"{label or 'object'}#{i}": track_box(frames, start, b) for i, (label, b) in enumerate(boxes)}
        drawn = np.stack([draw_boxes(f, [tr[j] for tr in tracks.values() if tr[j] is not None])
                          for j, f in enumerate(frames)])
        sx, sy = info.width / w, info.height / h  # the clip's pixels -> the video's

        def video_box(b) -> list[int]:
            return [round(b[0] * sx), round(b[1] * sy), round(b[2] * sx), round(b[3] * sy)]

        lines, meta = [], {}
        for key, tr in tracks.items():
            label = key.rsplit("#", 1)[0]
            first, last = video_box(tr[start]), video_box(tr[-1])
            lines.append(f"{label}: {first} at {times[start]:g}s -> {last} at {times[-1]:g}s")
            meta[key] = [(times[j], video_box(b)) for j, b in enumerate(tr) if b is not None]
        return ToolResult(text=f"Tracked {where} ({info.width}x{info.height} frame): " + "; ".join(lines) + ".",
                          frames=drawn, timestamps=times, window=(args.start_time, args.end_time),
                          meta={"tracks": meta, "replies": replies}, warnings=list(clip.warnings))
