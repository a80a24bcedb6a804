"""``VideoReader``: frames of one video file under the frame protocol, from a shared decoder pool.

Decoders are kept open in a small pool keyed by the file's identity, so K
sub-agents cropping the same file do not reopen and re-index it; results are
cached in a small LRU keyed by everything that changes them.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from paravt_agent.errors import VideoError
from paravt_agent.video.decoders import DECODERS, Decoder
from paravt_agent.video.sampling import (
    BACKENDS,
    Clip,
    FrameConfig,
    VideoInfo,
    check_window,
    crop_times,
    file_identity,
    fit_size,
    overview_times,
)

__all__ = ["POOL", "DecoderPool", "VideoReader", "open_video"]


def _cache_bytes() -> int:
    """The decoded-frame cache's bound: ``PARAVT_FRAME_CACHE_MB`` (default 512 MiB)."""
    try:
        return max(0, int(float(os.environ.get("PARAVT_FRAME_CACHE_MB", "512")) * (1 << 20)))
    except ValueError:
        return 512 << 20


class DecoderPool:
    """Open decoders by (file identity, backend); each is used by one caller at a time. Decoded results
    are kept in an LRU bounded by bytes (``max_result_bytes``; ``PARAVT_FRAME_CACHE_MB``) and entries."""

    def __init__(self, max_files: int = 16, max_idle_per_file: int = 8, max_results: int = 256,
                 max_result_bytes: int | None = None):
        self._lock = threading.Lock()
        self._idle: OrderedDict[tuple, list[Decoder]] = OrderedDict()
        self._info: dict[tuple, VideoInfo] = {}
        self._results: OrderedDict[tuple, Clip] = OrderedDict()
        self.max_files, self.max_idle, self.max_results = max_files, max_idle_per_file, max_results
        self.max_result_bytes = _cache_bytes() if max_result_bytes is None else max_result_bytes
        self.result_bytes = 0
        self.opened = 0  # decoders opened so far (for tests and benchmarks)

    def acquire(self, key: tuple) -> Decoder:
        with self._lock:
            idle = self._idle.get(key)
            if idle:
                self._idle.move_to_end(key)
                return idle.pop()
        dec = DECODERS[key[3]](key[0])
        with self._lock:
            self.opened += 1
            self._info[key] = dec.info
        return dec

    def release(self, key: tuple, dec: Decoder) -> None:
        evicted: list[Decoder] = []
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
        size = clip.frames.nbytes
        if size > self.max_result_bytes:
            return  # larger than the whole cache: not kept
        with self._lock:
            old = self._results.pop(key, None)
            if old is not None:
                self.result_bytes -= old.frames.nbytes
            self._results[key] = clip
            self.result_bytes += size
            while len(self._results) > self.max_results or self.result_bytes > self.max_result_bytes:
                _, gone = self._results.popitem(last=False)
                self.result_bytes -= gone.frames.nbytes

    def clear(self) -> None:
        with self._lock:
            decs = [d for ds in self._idle.values() for d in ds]
            self._idle.clear()
            self._info.clear()
            self._results.clear()
            self.result_bytes = 0
        for d in decs:
            d.close()


POOL = DecoderPool()


def _settings(frames: FrameConfig | None, overrides: dict) -> FrameConfig:
    base = frames or FrameConfig()
    unknown = set(overrides) - set(FrameConfig.model_fields)
    if unknown:
        raise TypeError(f"unknown frame settings {sorted(unknown)}; see FrameConfig")
    return base.model_copy(update=overrides) if overrides else base


class VideoReader:
    """Frames of one video file under the frame protocol.

    ``VideoReader(path).overview(frames)`` gives the planner's overview,
    ``.crop(start, end, frames)`` a sub-agent's window; ``frames`` is the
    :class:`FrameConfig` (its fields may also be given as keyword overrides).
    Cheap to create: decoders and results come from a process-wide pool keyed by
    the file's identity.
    """

    def __init__(self, path: str | os.PathLike, backend: str = "pyav", pool: DecoderPool | None = None):
        if backend not in DECODERS:
            raise VideoError(f"unknown video backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        self.path = os.fspath(path)
        self.backend = backend
        self._pool = pool or POOL
        real, size, mtime = file_identity(self.path)
        self._key = (real, size, mtime, backend)

    @property
    def identity(self) -> tuple:
        """``(real path, size, mtime_ns, backend)``."""
        return self._key

    @property
    def info(self) -> VideoInfo:
        info = self._pool.info(self._key)
        if info is None:
            dec = self._pool.acquire(self._key)
            info = dec.info
            self._pool.release(self._key, dec)
        return info

    def _decode(self, indices: list[int], size: tuple[int, int], fast: bool):
        """One decoder from the pool decodes ``indices`` in order."""
        dec = self._pool.acquire(self._key)
        try:
            got = (dec.keyframes if fast else dec.frames)(indices, size)
        except VideoError:
            dec.close()
            raise
        except Exception as exc:
            dec.close()
            raise VideoError(f"{self.path}: decoding failed ({exc.__class__.__name__}: {exc})") from exc
        self._pool.release(self._key, dec)
        return got

    def _decode_parallel(self, indices: list[int], size: tuple[int, int], fast: bool, workers: int):
        """``workers`` decoders take disjoint, contiguous stretches of ``indices`` at once.

        Exact frames are the same as one decoder's (each target is the first frame at or after its
        index, whoever decodes it). A stretch that fails ends the result where one decoder would have
        stopped. Keyframe mode takes the next keyframe when two targets share one, which depends on the
        previous target's choice: when two stretches meet at one keyframe (or a stretch comes back
        short), one decoder does the whole list again, in order (sparse keyframes: rare, and cheap)."""
        n = len(indices)
        bounds = [round(i * n / workers) for i in range(workers + 1)]
        chunks = [indices[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
        with ThreadPoolExecutor(len(chunks), thread_name_prefix="paravt-decode") as ex:
            parts = list(ex.map(lambda c: self._decode(c, size, fast), chunks))
        if fast and any(len(f) < len(c) for c, (f, _, _) in zip(chunks, parts, strict=True)):
            return self._decode(indices, size, fast)  # keyframes ran out inside a stretch: one decoder, in order
        frames, stamps, problems = [], [], []
        for f, t, p in parts:
            if fast and stamps and t and t[0] <= stamps[-1] + 1e-6:
                return self._decode(indices, size, fast)  # two stretches met at one keyframe: one decoder
            frames += f
            stamps += t
            problems += p
            if p:  # a damaged stretch: one decoder would have stopped here
                break
        return frames, stamps, problems

    def _workers(self, n: int, frames: FrameConfig | None) -> int:
        if self.backend != "pyav" or n < 8:
            return 1
        want = (frames.decode_workers if frames is not None else 0) or min(8, os.cpu_count() or 1)
        return max(1, min(want, n // 4))

    def _sample(self, kind: str, times: list[float], size: tuple[int, int], fast: bool,
                frames_cfg: FrameConfig | None = None) -> Clip:
        info = self.info
        last = info.num_frames - 1
        indices = sorted({min(last, max(0, math.floor(t * info.fps + 1e-6))) for t in times})
        workers = self._workers(len(indices), frames_cfg)
        if workers > 1:
            frames, stamps, problems = self._decode_parallel(indices, size, fast, workers)
        else:
            frames, stamps, problems = self._decode(indices, size, fast)
        if not frames:
            detail = "; ".join(problems) or "no frame decoded"
            raise VideoError(f"{self.path}: no frame of the {kind} decodes ({detail}); the file may be corrupt")
        notes = []
        if problems:
            notes.append(f"{kind} returned {len(frames)} of {len(indices)} frames, the file may be damaged or "
                         f"truncated ({'; '.join(problems)})")
            warnings.warn(f"{self.path}: {notes[0]}", RuntimeWarning, stacklevel=3)
        return Clip(np.stack(frames), stamps, info, keyframe_snapped=fast, warnings=notes)

    def sample(self, times: Sequence[float], *, max_pixels: int = 50176, factor: int = 32) -> Clip:
        """The frames showing at ``times`` (seconds), resized under ``max_pixels``. Not cached."""
        info = self.info
        bad = [t for t in times if not (0 <= t < info.duration)]
        if not times or bad:
            raise VideoError(f"times {bad or list(times)} are not inside the video (0 to {info.duration:.2f}s)")
        return self._sample("sample", list(times), fit_size(info.height, info.width, max_pixels, factor), False)

    def overview(self, n: int | None = None, frames: FrameConfig | None = None, **overrides) -> Clip:
        """The planner's overview: the ``fps`` grid subsampled to ``max_frames`` (or ``n``, else
        ``frames.n_frames``).

        ``fast_overview`` returns the keyframe at or before each target (the next one
        when two targets share a keyframe) with its real timestamp: no decoding
        between keyframes, which matters on long videos with sparse keyframes.
        """
        f = _settings(frames, overrides)
        n = n if n is not None else f.n_frames
        key = (*self._key, "overview", n, f.fps, f.max_frames, f.max_pixels, f.unit, f.fast_overview)
        clip = self._pool.cached(key)
        if clip is None:
            info = self.info
            times = overview_times(info.duration, fps=f.fps, max_frames=f.max_frames, n=n)
            size = fit_size(info.height, info.width, f.max_pixels, f.unit)
            clip = self._sample("overview", times, size, f.fast_overview, f)
            self._pool.store(key, clip)
        return clip

    def crop(self, start: float, end: float, frames: FrameConfig | None = None, **overrides) -> Clip:
        """At most ``crop_max_frames`` frames inside ``[start, end]`` (``end`` clamped to the duration)."""
        f = _settings(frames, overrides)
        info = self.info
        start, end = check_window(float(start), float(end), info.duration)
        key = (*self._key, "crop", start, end, f.crop_max_frames, f.crop_fps, f.max_pixels, f.unit)
        clip = self._pool.cached(key)
        if clip is None:
            times = crop_times(start, end, info.fps, max_frames=f.crop_max_frames, fps=f.crop_fps)
            times = [min(t, info.duration - 0.5 / info.fps) for t in times]
            clip = self._sample("crop", times, fit_size(info.height, info.width, f.max_pixels, f.unit), False, f)
            clip = _inside(clip, start, end)
            self._pool.store(key, clip)
        return clip


def _inside(clip: Clip, start: float, end: float) -> Clip:
    """A crop keeps its frames inside its window, each once: a variable-frame-rate or damaged file can hand
    back frames from elsewhere or the same frame twice; what was dropped is said in the clip's warnings."""
    slack = 1.0 / max(clip.info.fps, 1e-3)
    keep, seen = [], set()
    for k, t in enumerate(clip.timestamps):
        if start - slack <= t <= end + slack and t not in seen:
            keep.append(k)
            seen.add(t)
    if len(keep) == len(clip.timestamps):
        return clip
    if not keep:
        raise VideoError(f"{clip.info.path}: no frame of the window [{start:g}, {end:g}]s decodes")
    note = (f"crop [{start:g}, {end:g}]s: {len(clip.timestamps) - len(keep)} of {len(clip.timestamps)} frames were "
            "outside the window or repeated (a variable frame rate or a damaged file) and were dropped")
    return Clip(clip.frames[keep], [clip.timestamps[k] for k in keep], clip.info, clip.keyframe_snapped,
                [*clip.warnings, note])


def open_video(path: str | os.PathLike, backend: str = "pyav") -> VideoReader:
    """Open ``path`` and check it is a decodable video (raises :class:`VideoError` otherwise)."""
    reader = VideoReader(path, backend=backend)
    reader.info  # noqa: B018 - opening validates the file
    return reader
