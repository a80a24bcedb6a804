"""Built-in tools: ``crop_video`` (the paper's tool) and three that need no model weights."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import numpy as np
from pydantic import BaseModel, Field, field_validator

from paravt_agent.errors import ToolError, VideoError
from paravt_agent.protocol import format_time, parse_time
from paravt_agent.video import fit_size
from tools.base import TimeWindowArgs, Tool, ToolContext, ToolResult, check_window

__all__ = ["CropVideo", "GetSubtitles", "SceneChanges", "ZoomFrame", "BUILTINS"]


class CropVideoArgs(TimeWindowArgs):
    video_path: str | None = Field(
        None, description="The video to crop. Only the current video can be cropped; may be omitted."
    )


class CropVideo(Tool):
    name = "crop_video"
    description = (
        "Inspect the temporal window [start_time, end_time] of the video closely: a sub-agent looks at "
        "densely resampled frames of that window and returns a short text summary."
    )
    Args = CropVideoArgs
    positional = ["video_path", "start_time", "end_time"]
    visual = True

    async def run(self, args: CropVideoArgs, ctx: ToolContext) -> ToolResult:
        try:
            clip = await asyncio.to_thread(ctx.video.crop, args.start_time, args.end_time, ctx.frames)
        except VideoError as exc:
            raise ToolError(str(exc)) from exc
        return ToolResult(frames=clip.frames, timestamps=clip.timestamps, window=(args.start_time, args.end_time),
                          warnings=list(clip.warnings))

    def describe_call(self, args: CropVideoArgs) -> str:
        return f"crop_video({format_time(args.start_time)}-{format_time(args.end_time)})"


# --------------------------------------------------------------------------- subtitles

_CUE_RE = re.compile(
    r"(\d+:\d{2}:\d{2}[.,]\d{1,3}|\d{1,2}:\d{2}[.,]\d{1,3})\s*-->\s*(\d+:\d{2}:\d{2}[.,]\d{1,3}|\d{1,2}:\d{2}[.,]\d{1,3})"
)


def read_subtitles(path: Path) -> list[tuple[float, float, str]]:
    """Cues ``(start, end, text)`` of an .srt or .vtt file."""
    cues = []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    i = 0
    while i < len(lines):
        m = _CUE_RE.search(lines[i])
        if not m:
            i += 1
            continue
        start, end = (parse_time(g.replace(",", ".")) for g in m.groups())
        text = []
        i += 1
        while i < len(lines) and lines[i].strip():
            text.append(re.sub(r"<[^>]+>", "", lines[i]).strip())
            i += 1
        cues.append((start, end, " ".join(t for t in text if t)))
    return cues


def subtitle_file(video_path: str) -> Path | None:
    """An .srt/.vtt beside the video with the same stem (``v.srt``, ``v.en.vtt``), if any."""
    p = Path(video_path)
    for pattern in (f"{p.stem}.srt", f"{p.stem}.vtt", f"{p.stem}.*.srt", f"{p.stem}.*.vtt"):
        found = sorted(p.parent.glob(pattern))
        if found:
            return found[0]
    return None


class GetSubtitles(Tool):
    name = "get_subtitles"
    description = "Read the subtitles (speech transcript) shown between start_time and end_time."
    Args = TimeWindowArgs
    positional = ["start_time", "end_time"]

    async def run(self, args: TimeWindowArgs, ctx: ToolContext) -> ToolResult:
        path = subtitle_file(ctx.video.path)
        if path is None:
            raise ToolError("this video has no subtitle file (.srt or .vtt beside it)")
        cues = [c for c in read_subtitles(path) if c[1] > args.start_time and c[0] < args.end_time]
        window = (args.start_time, args.end_time)
        if not cues:
            return ToolResult(text=f"No subtitles between {format_time(window[0])} and {format_time(window[1])}.")
        text = "\n".join(f"[{format_time(a)}-{format_time(b)}] {t}" for a, b, t in cues)
        return ToolResult(text=text, window=window)


# --------------------------------------------------------------------------- zoom


class ZoomFrameArgs(BaseModel):
    time: float = Field(description="The moment to look at, in seconds (MM:SS also accepted).")
    x1: float = Field(0.0, ge=0, le=1, description="Left edge of the region, as a fraction of the width.")
    y1: float = Field(0.0, ge=0, le=1, description="Top edge of the region, as a fraction of the height.")
    x2: float = Field(1.0, ge=0, le=1, description="Right edge of the region, as a fraction of the width.")
    y2: float = Field(1.0, ge=0, le=1, description="Bottom edge of the region, as a fraction of the height.")

    @field_validator("time", mode="before")
    @classmethod
    def _seconds(cls, v):
        return parse_time(v)


class ZoomFrame(Tool):
    name = "zoom_frame"
    description = (
        "Look at one moment of the video at high resolution, optionally only the region (x1, y1)-(x2, y2) "
        "given as fractions of the frame; a sub-agent describes what it sees."
    )
    Args = ZoomFrameArgs
    positional = ["time", "x1", "y1", "x2", "y2"]
    visual = True

    def check(self, args: ZoomFrameArgs, ctx: ToolContext) -> ZoomFrameArgs:
        if not 0 <= args.time < ctx.duration:
            raise ToolError(f"time {args.time:g}s is outside the video (0 to {ctx.duration:.1f}s)")
        if args.x2 <= args.x1 or args.y2 <= args.y1:
            raise ToolError("the region needs x1 < x2 and y1 < y2")
        return args

    def window(self, args: ZoomFrameArgs) -> tuple[float, float] | None:
        return (float(args.time), float(args.time))

    async def run(self, args: ZoomFrameArgs, ctx: ToolContext) -> ToolResult:
        from PIL import Image

        info = ctx.video.info
        clip = await asyncio.to_thread(ctx.video.sample, [args.time], max_pixels=info.width * info.height, factor=2)
        frame = clip.frames[0]
        h, w = frame.shape[:2]
        box = (round(args.x1 * w), round(args.y1 * h), max(round(args.x2 * w), 1), max(round(args.y2 * h), 1))
        region = Image.fromarray(frame).crop(box)

        th, tw = fit_size(region.height, region.width, ctx.frames.max_pixels, ctx.frames.unit)
        region = region.resize((tw, th), Image.BICUBIC)
        return ToolResult(frames=np.asarray(region)[None], timestamps=clip.timestamps, window=(args.time, args.time))


# --------------------------------------------------------------------------- scene changes


class SceneChangesArgs(BaseModel):
    start_time: float = Field(0.0, description="Start of the range to scan, in seconds.")
    end_time: float | None = Field(None, description="End of the range to scan (default: end of video).")
    threshold: float = Field(0.25, gt=0, le=1, description="Mean colour change (0-1) that counts as a cut.")

    @field_validator("start_time", "end_time", mode="before")
    @classmethod
    def _seconds(cls, v):
        return None if v is None else parse_time(v)


def shot_boundaries(frames: np.ndarray, times: list[float], threshold: float) -> list[float]:
    """Times where consecutive frames differ by more than ``threshold`` (mean absolute change, 0-1)."""
    if len(frames) < 2:
        return []
    f = frames.astype(np.float32) / 255.0
    diffs = np.abs(f[1:] - f[:-1]).mean(axis=(1, 2, 3))
    return [times[i + 1] for i in np.nonzero(diffs > threshold)[0]]


class SceneChanges(Tool):
    name = "scene_changes"
    description = "List the shot boundaries (cuts) in a range of the video, found from frame differences at 1 fps."
    Args = SceneChangesArgs
    positional = ["start_time", "end_time"]
    max_samples = 1800

    def check(self, args: SceneChangesArgs, ctx: ToolContext) -> SceneChangesArgs:
        end = ctx.duration if args.end_time is None else args.end_time
        start, end = check_window(args.start_time, end, ctx.duration)
        return args.model_copy(update={"start_time": start, "end_time": end})

    def window(self, args: SceneChangesArgs) -> tuple[float, float] | None:
        return None if args.end_time is None else (float(args.start_time), float(args.end_time))

    async def run(self, args: SceneChangesArgs, ctx: ToolContext) -> ToolResult:
        step = max(1.0, (args.end_time - args.start_time) / self.max_samples)
        times = list(np.arange(args.start_time, args.end_time, step))
        times = [float(t) for t in times if t < ctx.duration]
        clip = await asyncio.to_thread(ctx.video.sample, times, max_pixels=64 * 64, factor=8)
        cuts = shot_boundaries(clip.frames, clip.timestamps, args.threshold)
        window = (args.start_time, args.end_time)
        span = f"{format_time(window[0])}-{format_time(window[1])}"
        if not cuts:
            return ToolResult(text=f"No shot boundary between {span}.", window=window)
        listed = ", ".join(format_time(t) for t in cuts)
        return ToolResult(text=f"{len(cuts)} shot boundaries between {span}: {listed}.", window=window)


BUILTINS: list[type[Tool]] = [CropVideo, GetSubtitles, ZoomFrame, SceneChanges]
