"""A tool: the mean brightness of the video at a moment (text evidence, no sub-agent needed)."""

import asyncio

from pydantic import BaseModel, Field

from tools import Tool, ToolResult


class BrightnessArgs(BaseModel):
    time: float = Field(description="The moment, in seconds.")


class Brightness(Tool):
    name = "brightness"
    description = "The mean brightness (0-255) of the frame shown at `time` seconds."
    Args = BrightnessArgs
    positional = ["time"]

    async def run(self, args: BrightnessArgs, ctx) -> ToolResult:
        clip = await asyncio.to_thread(ctx.video.sample, [args.time], max_pixels=64 * 64, factor=8)
        return ToolResult(text=f"brightness {float(clip.frames[0].mean()):.0f} at {clip.timestamps[0]:g}s")
