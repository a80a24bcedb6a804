"""Video I/O: the frame protocol of the paper, on top of interchangeable decoders.

Protocol (paper, Appendix B): decode at ``fps`` (1.0), subsample uniformly to at
most ``max_frames`` (64) — or exactly ``n`` frames for nFrames gating — and resize
each frame, keeping its aspect ratio, to at most ``max_pixels`` (50176 = 224x224)
with both sides a multiple of ``factor`` (32 for Qwen3-VL, 28 for Qwen2.5-VL).
A crop takes at most 16 frames inside ``[start, end]``.

Every sampled frame carries the *true* presentation timestamp of the decoded
frame, in seconds from the start of the stream. Sampling is defined on native
frame indices (``index = floor(t * native_fps)``), so every backend returns the
same frames for the same call.

Backends: ``pyav`` (default), ``decord`` and ``torchcodec`` (optional). Decoders
are kept open in a small pool keyed by the file's identity, so K sub-agents
cropping the same file do not reopen and re-index it; results are cached in a
small LRU keyed by everything that changes them.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from paravt_agent.errors import VideoError

__all__ = [
    "BACKENDS",
    "Clip",
    "VideoError",
    "VideoInfo",
    "VideoReader",
    "available_backends",
    "crop_times",
    "fit_size",
    "open_video",
    "overview_times",
]

DEFAULT_FPS = 1.0
DEFAULT_MAX_FRAMES = 64
DEFAULT_MAX_PIXELS = 50176
DEFAULT_FACTOR = 32
DEFAULT_CROP_FRAMES = 16
BACKENDS = ("pyav", "decord", "torchcodec")


@dataclass(frozen=True)
class VideoInfo:
    """What a video file reports about itself."""

    path: str
    duration: float
    fps: float
    num_frames: int
    width: int
    height: int
    codec: str = ""

    def check_window(self, start: float, end: float) -> None:
        """Raise :class:`VideoError` when ``[start, end]`` is not a window of this video."""
        if not (math.isfinite(start) and math.isfinite(end)):
            raise VideoError(f"window [{start}, {end}] is not finite")
        if start >= end:
            raise VideoError(f"window start {start:g}s must be before its end {end:g}s")
        if start < 0:
            raise VideoError(f"window start {start:g}s is negative")
        if start >= self.duration:
            raise VideoError(
                f"window [{start:g}, {end:g}]s starts after the video ends ({self.duration:.2f}s)"
            )


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


# --------------------------------------------------------------------------- sampling


def fit_size(
    height: int, width: int, max_pixels: int = DEFAULT_MAX_PIXELS, factor: int = DEFAULT_FACTOR
) -> tuple[int, int]:
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


def overview_times(
    duration: float,
    fps: float = DEFAULT_FPS,
    max_frames: int = DEFAULT_MAX_FRAMES,
    n: int | None = None,
) -> list[float]:
    """Target times of an overview: the ``fps`` grid, uniformly subsampled.

    Without ``n``: every grid point when there are at most ``max_frames`` of them,
    else ``max_frames`` of them spread uniformly. With ``n``: exactly ``n`` points
    (nFrames gating); when the grid is shorter than ``n`` the points are spread
    uniformly over the whole duration instead.
    """
    if duration <= 0:
        raise VideoError("the video has zero length")
    if fps <= 0:
        raise ValueError("fps must be positive")
    grid = [k / fps for k in range(max(1, math.ceil(duration * fps - 1e-9)))]
    if n is not None:
        if n < 1:
            raise ValueError("n must be >= 1")
        if n <= len(grid):
            return [grid[i] for i in _uniform(len(grid), n)]
        return [(i + 0.5) * duration / n for i in range(n)]
    if max_frames < 1:
        raise ValueError("max_frames must be >= 1")
    return [grid[i] for i in _uniform(len(grid), max_frames)]


def crop_times(
    start: float,
    end: float,
    native_fps: float,
    max_frames: int = DEFAULT_CROP_FRAMES,
    fps: float | None = None,
) -> list[float]:
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


# --------------------------------------------------------------------------- backends


class _Decoder:
    """One open file in one backend. Not thread-safe: the pool hands it to one caller at a time."""

    info: VideoInfo

    def frames(self, indices: Sequence[int], size: tuple[int, int]) -> tuple[list[np.ndarray], list[float], list[str]]:
        raise NotImplementedError

    def keyframes(self, indices: Sequence[int], size: tuple[int, int]) -> tuple[list[np.ndarray], list[float], list[str]]:
        """Keyframes near ``indices`` (at or before each; the next one when that repeats)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


def _resize(rgb: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    h, w = size
    if rgb.shape[0] == h and rgb.shape[1] == w:
        return np.ascontiguousarray(rgb)
    from PIL import Image

    return np.asarray(Image.fromarray(rgb).resize((w, h), Image.BILINEAR))


class _PyAVDecoder(_Decoder):
    def __init__(self, path: str):
        import av

        try:
            self._container = av.open(path)
        except av.error.EOFError as exc:
            raise VideoError(f"{path}: the file ends before any frame (empty or truncated video)") from exc
        except av.error.FFmpegError as exc:
            raise VideoError(f"{path}: not a readable video ({exc.__class__.__name__}: {exc})") from exc
        streams = self._container.streams.video
        if not streams:
            kinds = sorted({s.type for s in self._container.streams})
            self._container.close()
            if not kinds:
                raise VideoError(f"{path}: the container holds no stream at all (zero-length video)")
            what = "an audio-only file" if kinds == ["audio"] else f"a file without a video stream ({kinds})"
            raise VideoError(f"{path}: {what}; a video is needed")
        s = self._stream = streams[0]
        # Frame threading makes every seek refill a pipeline of frames: measured here it made the
        # keyframe overview 3.5x slower and exact seeks no faster; slice threading costs nothing.
        s.thread_type = "SLICE"
        self._tb = float(s.time_base) if s.time_base else 1 / 90000
        self._start = s.start_time or 0
        rate = s.average_rate or s.guessed_rate or s.base_rate
        fps = float(rate) if rate else 0.0
        if s.duration:
            duration = s.duration * self._tb
        elif self._container.duration:
            duration = self._container.duration / 1_000_000
        else:
            duration = 0.0
        num = s.frames or (round(duration * fps) if fps else 0)
        if fps <= 0 or num <= 0 or duration <= 0:
            self._container.close()
            raise VideoError(f"{path}: the video stream is empty (zero length)")
        self.info = VideoInfo(
            path=path,
            duration=float(duration),
            fps=fps,
            num_frames=int(num),
            width=s.codec_context.width,
            height=s.codec_context.height,
            codec=s.codec_context.name,
        )
        self._gop: int | None = None  # smallest keyframe distance seen, in frames
        self._last_key: int | None = None

    def _index(self, frame) -> int:
        pts = frame.pts if frame.pts is not None else frame.dts
        return round((pts - self._start) * self._tb * self.info.fps)

    def _seek(self, index: int) -> None:
        target = self._start + int(index / self.info.fps / self._tb)
        self._container.seek(target, stream=self._stream, backward=True, any_frame=False)

    def _note_key(self, frame, index: int) -> None:
        if frame.key_frame:
            if self._last_key is not None and index > self._last_key:
                gap = index - self._last_key
                self._gop = gap if self._gop is None else min(self._gop, gap)
            self._last_key = index

    def _decode(self, indices, size, keyframes_only: bool):
        import av

        s = self._stream
        s.codec_context.skip_frame = "NONKEY" if keyframes_only else "DEFAULT"
        h, w = size
        out, stamps, problems = [], [], []
        cur = None  # index of the last decoded frame
        it = None
        forward = self._gop if self._gop is not None else max(1, round(2 * self.info.fps))
        for target in indices:
            if keyframes_only:
                self._seek(target)
                it = self._container.decode(s)
                cur = None
            elif it is None or cur is None or target <= cur or target - cur > forward:
                self._seek(target)
                it = self._container.decode(s)
                self._last_key = None
            got = None
            try:
                for frame in it:
                    idx = self._index(frame)
                    if not keyframes_only:
                        self._note_key(frame, idx)
                    cur = idx
                    if keyframes_only:
                        if stamps and (frame.pts - self._start) * self._tb <= stamps[-1] + 1e-6:
                            continue  # same keyframe as the previous target: take the next one
                        got = frame
                        break
                    if idx >= target:
                        got = frame
                        break
            except (av.error.FFmpegError, ValueError) as exc:
                problems.append(f"decoding stopped near frame {target}: {exc}")
                it = None
            if got is None:
                if not problems:
                    problems.append(f"no frame decodes at or after frame {target} (truncated file?)")
                break
            out.append(got.to_ndarray(width=w, height=h, format="rgb24", interpolation="BILINEAR"))
            stamps.append(round(float((got.pts - self._start) * self._tb), 6))
            if self._gop is not None:
                forward = self._gop
        s.codec_context.skip_frame = "DEFAULT"
        return out, stamps, problems

    def frames(self, indices, size):
        return self._decode(indices, size, keyframes_only=False)

    def keyframes(self, indices, size):
        return self._decode(indices, size, keyframes_only=True)

    def close(self) -> None:
        self._container.close()


class _DecordDecoder(_Decoder):
    def __init__(self, path: str):
        try:
            import decord
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise VideoError("the decord backend needs `pip install 'paravt[decord]'`") from exc
        try:
            self._vr = decord.VideoReader(path, ctx=decord.cpu(0), num_threads=2)
        except Exception as exc:  # decord raises bare DECORDError/RuntimeError
            raise VideoError(f"{path}: decord cannot open it as a video ({exc})") from exc
        n = len(self._vr)
        fps = float(self._vr.get_avg_fps() or 0)
        if n <= 0 or fps <= 0:
            raise VideoError(f"{path}: the video stream is empty (zero length)")
        h, w = self._vr[0].shape[:2]
        last = self._vr.get_frame_timestamp([n - 1])[0]
        self.info = VideoInfo(path=path, duration=float(last[1]), fps=fps, num_frames=n, width=w, height=h)
        self._keys: list[int] | None = None

    def _fetch(self, indices, size):
        indices = [i for i in indices if i < self.info.num_frames]
        if not indices:
            return [], [], ["window lies past the last frame"]
        batch = self._vr.get_batch(list(indices)).asnumpy()
        stamps = [float(t[0]) for t in self._vr.get_frame_timestamp(list(indices))]
        return [_resize(f, size) for f in batch], stamps, []

    def frames(self, indices, size):
        return self._fetch(indices, size)

    def keyframes(self, indices, size):
        import bisect

        if self._keys is None:
            self._keys = sorted(int(k) for k in self._vr.get_key_indices())
        keys, chosen = self._keys, []
        for target in indices:
            pos = max(0, bisect.bisect_right(keys, target) - 1)
            if chosen and keys[pos] <= chosen[-1]:
                pos = bisect.bisect_right(keys, chosen[-1])
                if pos >= len(keys):
                    break
            chosen.append(keys[pos])
        return self._fetch(chosen, size)


class _TorchCodecDecoder(_Decoder):
    def __init__(self, path: str):
        try:
            from torchcodec.decoders import VideoDecoder
        except Exception as exc:  # ImportError, or a missing system FFmpeg (RuntimeError/OSError)
            raise VideoError(
                "the torchcodec backend needs `pip install 'paravt[torchcodec]'` and a system FFmpeg "
                f"(`apt-get install ffmpeg`): {exc}"
            ) from exc
        try:
            self._dec = VideoDecoder(path, seek_mode="exact")
        except Exception as exc:
            raise VideoError(f"{path}: torchcodec cannot open it as a video ({exc})") from exc
        md = self._dec.metadata
        n, fps = int(md.num_frames or 0), float(md.average_fps or 0)
        if n <= 0 or fps <= 0:
            raise VideoError(f"{path}: the video stream is empty (zero length)")
        self.info = VideoInfo(
            path=path,
            duration=float(md.duration_seconds),
            fps=fps,
            num_frames=n,
            width=int(md.width),
            height=int(md.height),
            codec=str(md.codec or ""),
        )

    def frames(self, indices, size):
        indices = [i for i in indices if i < self.info.num_frames]
        if not indices:
            return [], [], ["window lies past the last frame"]
        batch = self._dec.get_frames_at(indices=list(indices))
        data = batch.data.permute(0, 2, 3, 1).numpy()
        return [_resize(f, size) for f in data], [float(t) for t in batch.pts_seconds], []

    def keyframes(self, indices, size):
        # torchcodec has no public keyframe index: exact frames, reported as such.
        return self.frames(indices, size)


_DECODERS = {"pyav": _PyAVDecoder, "decord": _DecordDecoder, "torchcodec": _TorchCodecDecoder}


def available_backends() -> list[str]:
    """Backends whose Python package imports here."""
    found = []
    for name, module in (("pyav", "av"), ("decord", "decord"), ("torchcodec", "torchcodec.decoders")):
        try:
            __import__(module)
        except Exception:
            continue
        found.append(name)
    return found


# --------------------------------------------------------------------------- pool and cache


def _identity(path: str) -> tuple[str, int, int]:
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


class _Pool:
    """Open decoders by (file identity, backend); each is used by one caller at a time."""

    def __init__(self, max_files: int = 16, max_idle_per_file: int = 4, max_results: int = 64):
        self._lock = threading.Lock()
        self._idle: OrderedDict[tuple, list[_Decoder]] = OrderedDict()
        self._info: dict[tuple, VideoInfo] = {}
        self._results: OrderedDict[tuple, Clip] = OrderedDict()
        self.max_files, self.max_idle, self.max_results = max_files, max_idle_per_file, max_results
        self.opened = 0  # decoders opened so far (for tests and benchmarks)

    def acquire(self, key: tuple) -> _Decoder:
        with self._lock:
            idle = self._idle.get(key)
            if idle:
                self._idle.move_to_end(key)
                return idle.pop()
        dec = _DECODERS[key[3]](key[0])
        with self._lock:
            self.opened += 1
            self._info[key] = dec.info
        return dec

    def release(self, key: tuple, dec: _Decoder) -> None:
        evicted: list[_Decoder] = []
        with self._lock:
            idle = self._idle.setdefault(key, [])
            self._idle.move_to_end(key)
            if len(idle) < self.max_idle:
                idle.append(dec)
            else:
                evicted.append(dec)
            while len(self._idle) > self.max_files:
                _, old = self._idle.popitem(last=False)
                evicted.extend(old)
        for d in evicted:
            d.close()

    def info(self, key: tuple) -> VideoInfo | None:
        with self._lock:
            return self._info.get(key)

    def cached(self, key: tuple) -> Clip | None:
        with self._lock:
            clip = self._results.get(key)
            if clip is not None:
                self._results.move_to_end(key)
            return clip

    def store(self, key: tuple, clip: Clip) -> None:
        with self._lock:
            self._results[key] = clip
            while len(self._results) > self.max_results:
                self._results.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            decs = [d for ds in self._idle.values() for d in ds]
            self._idle.clear()
            self._info.clear()
            self._results.clear()
        for d in decs:
            d.close()


POOL = _Pool()


# --------------------------------------------------------------------------- public reader


class VideoReader:
    """Frames of one video file under the paper's protocol.

    ``VideoReader(path).overview()`` gives the planner's overview,
    ``.crop(start, end)`` a sub-agent's window. Cheap to create: decoders and
    results come from a process-wide pool keyed by the file's identity.
    """

    def __init__(self, path: str | os.PathLike, backend: str = "pyav", pool: _Pool | None = None):
        if backend not in _DECODERS:
            raise VideoError(f"unknown video backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        self.path = os.fspath(path)
        self.backend = backend
        self._pool = pool or POOL
        real, size, mtime = _identity(self.path)
        self._key = (real, size, mtime, backend)

    @property
    def info(self) -> VideoInfo:
        info = self._pool.info(self._key)
        if info is None:
            dec = self._pool.acquire(self._key)
            info = dec.info
            self._pool.release(self._key, dec)
        return info

    def _sample(self, kind: str, times: list[float], size: tuple[int, int], fast: bool) -> Clip:
        info = self.info
        last = info.num_frames - 1
        indices = sorted({min(last, max(0, math.floor(t * info.fps + 1e-6))) for t in times})
        dec = self._pool.acquire(self._key)
        try:
            frames, stamps, problems = (dec.keyframes if fast else dec.frames)(indices, size)
        except VideoError:
            dec.close()
            raise
        except Exception as exc:
            dec.close()
            raise VideoError(f"{self.path}: decoding failed ({exc.__class__.__name__}: {exc})") from exc
        self._pool.release(self._key, dec)
        if not frames:
            detail = "; ".join(problems) or "no frame decoded"
            raise VideoError(f"{self.path}: no frame of the {kind} decodes ({detail}); the file may be corrupt")
        if problems:
            msg = f"{self.path}: {kind} returned {len(frames)} of {len(indices)} frames ({'; '.join(problems)})"
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
        return Clip(np.stack(frames), stamps, info, keyframe_snapped=fast, warnings=problems)

    def sample(
        self,
        times: Sequence[float],
        *,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        factor: int = DEFAULT_FACTOR,
    ) -> Clip:
        """The frames showing at ``times`` (seconds), resized under ``max_pixels``. Not cached."""
        info = self.info
        bad = [t for t in times if not (0 <= t < info.duration)]
        if not times or bad:
            raise VideoError(f"times {bad or list(times)} are not inside the video (0 to {info.duration:.2f}s)")
        return self._sample("sample", list(times), fit_size(info.height, info.width, max_pixels, factor), False)

    def overview(
        self,
        n: int | None = None,
        *,
        fps: float = DEFAULT_FPS,
        max_frames: int = DEFAULT_MAX_FRAMES,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        factor: int = DEFAULT_FACTOR,
        fast: bool = False,
    ) -> Clip:
        """The planner's overview: the ``fps`` grid subsampled to ``max_frames`` (or exactly ``n``).

        ``fast=True`` returns the keyframe at or before each target (the next one
        when two targets share a keyframe) with its real timestamp: no decoding
        between keyframes, which matters on long videos with sparse keyframes.
        """
        key = (*self._key, "overview", n, fps, max_frames, max_pixels, factor, fast)
        clip = self._pool.cached(key)
        if clip is None:
            info = self.info
            times = overview_times(info.duration, fps=fps, max_frames=max_frames, n=n)
            clip = self._sample("overview", times, fit_size(info.height, info.width, max_pixels, factor), fast)
            self._pool.store(key, clip)
        return clip

    def crop(
        self,
        start: float,
        end: float,
        *,
        max_frames: int = DEFAULT_CROP_FRAMES,
        fps: float | None = None,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        factor: int = DEFAULT_FACTOR,
    ) -> Clip:
        """At most ``max_frames`` frames inside ``[start, end]`` (``end`` clamped to the duration)."""
        info = self.info
        start, end = float(start), float(end)
        info.check_window(start, end)
        end = min(end, info.duration)
        key = (*self._key, "crop", start, end, max_frames, fps, max_pixels, factor)
        clip = self._pool.cached(key)
        if clip is None:
            times = crop_times(start, end, info.fps, max_frames=max_frames, fps=fps)
            times = [min(t, info.duration - 0.5 / info.fps) for t in times]
            clip = self._sample("crop", times, fit_size(info.height, info.width, max_pixels, factor), False)
            self._pool.store(key, clip)
        return clip


def open_video(path: str | os.PathLike, backend: str = "pyav") -> VideoReader:
    """Open ``path`` and check it is a decodable video (raises :class:`VideoError` otherwise)."""
    reader = VideoReader(path, backend=backend)
    reader.info  # noqa: B018 - opening validates the file
    return reader
