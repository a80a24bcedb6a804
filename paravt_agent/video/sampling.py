"""The frame protocol (paper, Appendix B) and the pure sampling rules on top of it.

:class:`FrameConfig` is the one settings object of the protocol: the agent, the
tools, the SFT/RL data rendering and the evaluation all pass it along instead of
repeating the paper's numbers. The functions here are pure: which times an
overview or a crop samples, how large a frame is, which windows are valid.

Protocol: decode at ``fps`` (1.0), subsample uniformly to at most ``max_frames``
(64) — or ``n`` frames for nFrames gating — and resize each frame, keeping its
aspect ratio, to at most ``max_pixels`` (50176 = 224x224) with both sides a
multiple of the model's unit (``factor``: its processor's patch x merge, 32 for Qwen3-VL, 28 for Qwen2.5-VL and
Qwen2-VL; an agent reads it from its model, :meth:`FrameConfig.bound_to`). A crop takes at most
``crop_max_frames`` (16) frames inside ``[start, end]``, at most ``crop_fps`` per second.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from paravt_agent.errors import VideoError
from paravt_agent.video.geometry import FrameGeometry

__all__ = [
    "BACKENDS",
    "UNBOUND_UNIT",
    "Clip",
    "FrameConfig",
    "VideoInfo",
    "check_window",
    "crop_times",
    "file_identity",
    "fit_size",
    "overview_times",
]

BACKENDS = ("pyav", "decord", "torchcodec")

#: the side unit of frames read for no model in particular (a video read on its own; a backend whose model's
#: processor is not on this machine): Qwen3-VL's 32. An agent, SFT and the trainer bind the protocol to their model's
#: own unit (:meth:`FrameConfig.bound_to`), never to this.
UNBOUND_UNIT = 32


class FrameConfig(BaseModel):
    """The frame protocol (paper, Appendix B). Defaults are the paper's values."""

    model_config = ConfigDict(extra="forbid")

    fps: float = Field(1.0, gt=0, description="Overview sampling rate before uniform subsampling (paper: 1 fps).")
    max_frames: int = Field(64, ge=1, description="Overview frame cap (paper: 64).")
    n_frames: int | None = Field(
        None, ge=1, description="Overview of n frames (nFrames gating, paper Eq. 2); never denser than `fps`. "
        "None = the fps/max_frames rule."
    )
    max_pixels: int = Field(50176, ge=256, description="Pixel budget per frame (paper: 50176 = 224x224).")
    factor: int | None = Field(
        None, ge=1, description="Frame sides are multiples of this: the model's unit (its processor's patch x merge: "
        "32 for Qwen3-VL, 28 for Qwen2.5-VL and Qwen2-VL), read from the model when None; a value that contradicts "
        "the model is refused.")
    fast_overview: bool = Field(False, description="Keyframe-snapped overview (faster on long videos; the true "
                                                   "timestamps of the keyframes are reported).")
    crop_max_frames: int = Field(16, ge=1, description="Frames per crop (paper: at most 16 per sub-agent).")
    crop_fps: float | None = Field(2.0, gt=0, description="Cap on crop frames per second; None = no cap.")
    backend: Literal["pyav", "decord", "torchcodec"] = Field("pyav", description="Video decoder.")
    decode_workers: int = Field(0, ge=0, description="PyAV: decoders working on disjoint stretches of the timeline "
                                "at once (each its own open file, in threads: FFmpeg decodes without the GIL). "
                                "0 = one per core, at most 8. The frames are the same whatever the number.")

    @property
    def unit(self) -> int:
        """The side unit frames are sized with: ``factor``, or :data:`UNBOUND_UNIT` before the protocol is bound to
        a model."""
        return self.factor or UNBOUND_UNIT

    def bound_to(self, geometry: FrameGeometry | None) -> FrameConfig:
        """This protocol for a model of ``geometry``: ``factor`` its unit (a stated factor that contradicts it is
        refused, :class:`~paravt_agent.errors.ConfigError` naming both), ``max_pixels`` at most its processor's (a
        larger frame would be shrunk by the model). ``self`` when the geometry is unknown."""
        if geometry is None:
            return self
        geometry.check_factor(self.factor)
        return self.model_copy(update={"factor": geometry.unit, "max_pixels": min(self.max_pixels,
                                                                                  geometry.max_pixels)})


@dataclass(frozen=True)
class VideoInfo:
    """What a video file reports about itself."""

    path: str
    duration: float
    fps: float
    num_frames: int
    width: int  # as displayed (a rotated phone video: its display width)
    height: int
    codec: str = ""
    rotation: int = 0  # counter-clockwise degrees the display matrix turns coded frames (applied to frames)


@dataclass
class Clip:
    """Sampled frames: ``frames`` is ``(N, H, W, 3)`` uint8 RGB, ``timestamps`` in seconds."""

    frames: np.ndarray
    timestamps: list[float]
    info: VideoInfo
    keyframe_snapped: bool = False
    warnings: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.timestamps)

    def images(self):
        """The frames as PIL images."""
        from PIL import Image

        return [Image.fromarray(f) for f in self.frames]


def check_window(start: float, end: float, duration: float) -> tuple[float, float]:
    """The one window rule: finite, ``0 <= start < end``, ``start`` inside the video; ``end`` is clamped
    to the duration. Returns the window to use; raises :class:`VideoError` saying what is wrong."""
    if not (math.isfinite(start) and math.isfinite(end)):
        raise VideoError(f"window [{start}, {end}] is not finite")
    if start < 0:
        raise VideoError(f"start_time {start:g}s is negative")
    if start >= end:
        raise VideoError(f"start_time {start:g}s must be before end_time {end:g}s")
    if start >= duration:
        raise VideoError(f"start_time {start:g}s is beyond the end of the video ({duration:.1f}s)")
    return start, min(end, duration)


def file_identity(path: str | os.PathLike) -> tuple[str, int, int]:
    """``(real path, size, mtime_ns)``: what caches of a file's frames or prompts are keyed by (a changed
    file is a different video). Raises :class:`VideoError` for a missing, unreadable or empty file."""
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise VideoError(f"{path}: no such file") from None
    except OSError as exc:
        raise VideoError(f"{path}: cannot be read ({exc.strerror})") from None
    if not os.path.isfile(path):
        raise VideoError(f"{path}: not a file")
    if st.st_size == 0:
        raise VideoError(f"{path}: the file is empty (zero length)")
    return os.path.realpath(path), st.st_size, st.st_mtime_ns


def fit_size(height: int, width: int, max_pixels: int = 50176, factor: int = 32) -> tuple[int, int]:
    """Target ``(height, width)``: aspect kept, sides multiples of ``factor``, area <= ``max_pixels``.

    Frames are never upscaled beyond rounding to the nearest multiple of ``factor``.
    """
    if height <= 0 or width <= 0:
        raise VideoError(f"frame size {width}x{height} is empty")
    if max_pixels < factor * factor:
        raise ValueError(f"max_pixels={max_pixels} is below one {factor}x{factor} patch")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        scale = math.sqrt(max_pixels / (height * width))
        h = max(factor, math.floor(height * scale / factor) * factor)
        w = max(factor, math.floor(width * scale / factor) * factor)
    return h, w


def _uniform(count: int, k: int) -> list[int]:
    """``k`` indices spread uniformly over ``range(count)`` (first and last included)."""
    if k >= count:
        return list(range(count))
    if k == 1:
        return [count // 2]
    return [round(i * (count - 1) / (k - 1)) for i in range(k)]


def overview_times(duration: float, fps: float = 1.0, max_frames: int = 64, n: int | None = None) -> list[float]:
    """Target times of an overview: the ``fps`` grid, uniformly subsampled.

    Without ``n``: every grid point when there are at most ``max_frames`` of them,
    else ``max_frames`` of them spread uniformly. With ``n`` (nFrames gating): ``n``
    grid points spread uniformly, or the whole grid when it has fewer than ``n``
    points: gating never samples faster than ``fps`` (a 30 s video at n = 64 gets the
    30 frames serving would show).
    """
    if duration <= 0:
        raise VideoError("the video has zero length")
    if fps <= 0:
        raise ValueError("fps must be positive")
    grid = [k / fps for k in range(max(1, math.ceil(duration * fps - 1e-9)))]
    if n is not None:
        if n < 1:
            raise ValueError("n must be >= 1")
        return [grid[i] for i in _uniform(len(grid), n)]
    if max_frames < 1:
        raise ValueError("max_frames must be >= 1")
    return [grid[i] for i in _uniform(len(grid), max_frames)]


def crop_times(start: float, end: float, native_fps: float, max_frames: int = 16,
               fps: float | None = None) -> list[float]:
    """Target times of a crop: at most ``max_frames`` (and at most ``fps`` per second) in ``[start, end]``."""
    if end <= start:
        raise VideoError(f"window start {start:g}s must be before its end {end:g}s")
    available = math.floor(end * native_fps + 1e-9) - math.ceil(start * native_fps - 1e-9) + 1
    count = max(1, min(max_frames, available))
    if fps is not None:
        count = max(1, min(count, math.floor((end - start) * fps + 1e-9) + 1))
    if count == 1:
        return [(start + end) / 2]
    step = (end - start) / (count - 1)
    return [start + i * step for i in range(count)]
