"""Write synthetic H.264 videos: a timeline of solid-colour segments (and test oddities)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import numpy as np

RGB = tuple[int, int, int]


def write_video(
    path: str | os.PathLike,
    num_frames: int,
    frame_fn: Callable[[int], np.ndarray],
    fps: int = 30,
    width: int = 64,
    height: int = 64,
    gop: int | None = None,
    preset: str = "veryfast",
    faststart: bool = False,
) -> str:
    """Encode ``num_frames`` RGB frames from ``frame_fn(i)`` as H.264 in an mp4 (or any container by suffix).

    ``gop=None`` keeps the encoder's default keyframe interval (x264: 250 frames).
    """
    import av

    path = os.fspath(path)
    options = {"movflags": "faststart"} if faststart else {}
    with av.open(path, "w", options=options) as c:
        s = c.add_stream("libx264", rate=fps, options={"preset": preset})
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        if gop is not None:
            s.codec_context.gop_size = gop
        for i in range(num_frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame_fn(i), dtype=np.uint8), format="rgb24")
            for pkt in s.encode(frame):
                c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)
    return path


def write_segments(
    path: str | os.PathLike,
    segments: Sequence[tuple[RGB, float]],
    fps: int = 30,
    width: int = 64,
    height: int = 64,
    gop: int | None = None,
    **kw,
) -> str:
    """A video of solid-colour ``(rgb, seconds)`` segments, back to back."""
    bounds, colours, t = [], [], 0.0
    for rgb, secs in segments:
        t += secs
        bounds.append(round(t * fps))
        colours.append(np.asarray(rgb, dtype=np.uint8))
    total = bounds[-1]
    canvas = np.empty((height, width, 3), np.uint8)

    def frame(i: int) -> np.ndarray:
        k = int(np.searchsorted(bounds, i, side="right"))
        canvas[:] = colours[min(k, len(colours) - 1)]
        return canvas

    return write_video(path, total, frame, fps=fps, width=width, height=height, gop=gop, **kw)


def write_audio_only(path: str | os.PathLike, seconds: float = 1.0, rate: int = 16000) -> str:
    """An .m4a with one AAC track and no video (for error tests)."""
    import av

    path = os.fspath(path)
    with av.open(path, "w") as c:
        s = c.add_stream("aac", rate=rate)
        samples = int(seconds * rate)
        chunk = 1024
        for start in range(0, samples, chunk):
            data = np.zeros((1, chunk), np.float32)
            f = av.AudioFrame.from_ndarray(data, format="fltp", layout="mono")
            f.sample_rate = rate
            f.pts = start
            for pkt in s.encode(f):
                c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)
    return path
