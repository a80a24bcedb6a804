"""A tool: the mean brightness of the video at a moment (text evidence, no sub-agent needed)."""

import asyncio

from pydantic import BaseModel, Field

from paravt_agent.errors import ToolError
from tools import Tool, ToolResult


class BrightnessArgs(BaseModel):
    time: float = Field(description="The moment, in seconds.")


class Brightness(Tool):
    name = "brightness"
    description = "The mean brightness (0-255) of the frame shown at `time` seconds."
    Args = BrightnessArgs
    positional = ["time"]

    def check(self, args: BrightnessArgs, ctx) -> BrightnessArgs:
        """A moment outside the video is an invalid call (the planner sees the error), never a clamped frame."""
        if not 0 <= args.time <= ctx.duration:
            raise ToolError(f"time {args.time:g}s is outside the video (0-{ctx.duration:g}s)")
        return args

    async def run(self, args: BrightnessArgs, ctx) -> ToolResult:
        clip = await asyncio.to_thread(ctx.video.sample, [args.time], max_pixels=64 * 64, factor=8)
        return ToolResult(text=f"brightness {float(clip.frames[0].mean()):.0f} at {clip.timestamps[0]:g}s")
