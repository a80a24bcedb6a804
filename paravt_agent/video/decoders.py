"""Decoder backends behind one interface: PyAV (default), decord and torchcodec (optional extras).

Sampling is defined on native frame indices (``index = floor(t * native_fps)``), so
every backend returns the same frames for the same call; each frame carries the
presentation timestamp of the decoded frame, never the requested time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from paravt_agent.errors import VideoError
from paravt_agent.video.sampling import VideoInfo
from paravt_agent.video.sniff import explain_unreadable, refuse_not_video

__all__ = ["DECODERS", "Decoder", "available_backends"]


class Decoder:
    """One open file in one backend. Not thread-safe: the pool hands it to one caller at a time."""

    info: VideoInfo

    def frames(self, indices: Sequence[int], size: tuple[int, int]) -> tuple[list[np.ndarray], list[float], list[str]]:
        raise NotImplementedError

    def keyframes(self, indices: Sequence[int],
                  size: tuple[int, int]) -> tuple[list[np.ndarray], list[float], list[str]]:
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


#: Containers and codecs FFmpeg opens that are not videos (a text file opens as ANSI art through "tty").
NOT_VIDEO_FORMATS = {"tty", "txt", "srt", "webvtt", "ass", "lrc", "jacosub", "microdvd", "mpl2", "sami", "subviewer"}
NOT_VIDEO_CODECS = {"ansi", "bintext", "xbin", "idf", "text", "subrip", "webvtt", "ass"}


def _rotate(rgb: np.ndarray, rotation: int) -> np.ndarray:
    """A decoded frame as it is displayed: turned counter-clockwise by the display matrix's rotation."""
    k = (rotation // 90) % 4
    return np.ascontiguousarray(np.rot90(rgb, k)) if k else rgb


class _PyAVDecoder(Decoder):
    def __init__(self, path: str):
        import av

        refuse_not_video(path)
        try:
            self._container = av.open(path)
        except av.error.EOFError as exc:
            raise VideoError(f"{path}: the file ends before any frame (empty or truncated video)") from exc
        except av.error.FFmpegError as exc:  # FFmpeg's words ("[Errno 1094995529] Invalid data ...") come last
            why = f"FFmpeg: {getattr(exc, 'strerror', None) or exc.__class__.__name__}"
            raise VideoError(explain_unreadable(path, path, why)) from exc
        streams = self._container.streams.video
        if not streams:
            kinds = sorted({s.type for s in self._container.streams})
            self._container.close()
            if not kinds:
                raise VideoError(f"{path}: the container holds no stream at all (zero-length video)")
            what = "an audio-only file" if kinds == ["audio"] else f"a file without a video stream ({kinds})"
            raise VideoError(f"{path}: {what}; a video is needed")
        s = self._stream = streams[0]
        fmt = (self._container.format.name or "").split(",")
        if set(fmt) & NOT_VIDEO_FORMATS or s.codec_context.name in NOT_VIDEO_CODECS:
            self._container.close()
            raise VideoError(f"{path}: not a video (FFmpeg reads it as {fmt[0]} / {s.codec_context.name}, e.g. a text "
                             "file); give a video file (mp4, mkv, webm, mov, avi, ...)")
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
        self.rotation = self._display_rotation()
        w, h = s.codec_context.width, s.codec_context.height
        if self.rotation % 180:  # a phone video held upright: displayed sideways to how it is coded
            w, h = h, w
        self.info = VideoInfo(
            path=path,
            duration=float(duration),
            fps=fps,
            num_frames=int(num),
            width=w,
            height=h,
            codec=s.codec_context.name,
            rotation=self.rotation,
        )
        self._gop: int | None = None  # smallest keyframe distance seen, in frames
        self._last_key: int | None = None
        self._target_pts: int | None = None  # the frame being sought (see _frames)

    def _display_rotation(self) -> int:
        """The display matrix's rotation (counter-clockwise degrees, a multiple of 90), from the first frame."""
        import av

        try:
            for frame in self._container.decode(self._stream):
                rotation = int(round((getattr(frame, "rotation", 0) or 0) / 90.0)) * 90
                break
            else:
                rotation = 0
            self._container.seek(self._start, stream=self._stream, backward=True, any_frame=False)
        except (av.error.FFmpegError, ValueError):
            rotation = 0
        return rotation % 360

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

    def _frames(self):
        """Decoded frames from the current position. Packets of frames shown before the target
        (``self._target_pts``) are decoded only when other frames reference them (``skip_frame``
        NONREF): nothing the target depends on is skipped, so the target decodes exactly as it would
        have; what is saved is the non-reference B-frames between the keyframe and the target."""
        cc = self._stream.codec_context
        for pkt in self._container.demux(self._stream):
            early = pkt.pts is not None and self._target_pts is not None and pkt.pts < self._target_pts
            cc.skip_frame = "NONREF" if early else "DEFAULT"
            yield from cc.decode(pkt)

    def _keyframe(self, target: int, after: float | None):
        """The keyframe at or before ``target`` (the next keyframe when that one is at or before ``after``
        seconds): only keyframe packets are read and decoded, each drained at once."""
        cc = self._stream.codec_context
        self._seek(target)
        try:
            for pkt in self._container.demux(self._stream):
                if not pkt.is_keyframe or pkt.size == 0:
                    continue
                if after is not None and pkt.pts is not None and (pkt.pts - self._start) * self._tb <= after + 1e-6:
                    continue  # the previous target's keyframe: take the next one
                frames = [*cc.decode(pkt), *cc.decode(None)]
                cc.flush_buffers()
                frames = [f for f in frames if after is None or (f.pts - self._start) * self._tb > after + 1e-6]
                if frames:
                    return frames[0]
            return None
        finally:
            cc.flush_buffers()

    def _decode(self, indices, size, keyframes_only: bool):
        import av

        h, w = size
        out, stamps, problems = [], [], []
        cur = None  # index of the last decoded frame
        it = None
        forward = self._gop if self._gop is not None else max(1, round(2 * self.info.fps))
        for target in indices:
            got = None
            try:
                if keyframes_only:
                    got = self._keyframe(target, stamps[-1] if stamps else None)
                else:
                    if it is None or cur is None or target <= cur or target - cur > forward:
                        self._seek(target)
                        it = self._frames()
                        self._last_key = None
                    self._target_pts = self._start + int(target / self.info.fps / self._tb)
                    for frame in it:
                        idx = self._index(frame)
                        self._note_key(frame, idx)
                        cur = idx
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
            if self.rotation % 180:
                coded = got.to_ndarray(width=h, height=w, format="rgb24", interpolation="BILINEAR")
            else:
                coded = got.to_ndarray(width=w, height=h, format="rgb24", interpolation="BILINEAR")
            out.append(_rotate(coded, self.rotation))
            stamps.append(round(float((got.pts - self._start) * self._tb), 6))
            if self._gop is not None:
                forward = self._gop
        self._stream.codec_context.skip_frame = "DEFAULT"
        self._target_pts = None
        return out, stamps, problems

    def frames(self, indices, size):
        return self._decode(indices, size, keyframes_only=False)

    def keyframes(self, indices, size):
        """Keyframes near ``indices``; when the keyframes run out before the targets do (a short video with
        sparse keyframes), the remaining targets are filled with exactly decoded frames after the last
        keyframe, so an overview of n frames has n frames."""
        out, stamps, problems = self._decode(indices, size, keyframes_only=True)
        missing = len(indices) - len(out)
        if missing <= 0 or problems and "truncated" not in problems[-1]:
            return out, stamps, problems
        last = round(stamps[-1] * self.info.fps) if stamps else -1
        later = [i for i in indices[len(out):] if i > last]
        pool = list(range(last + 1, self.info.num_frames))
        if len(later) < missing and len(pool) >= missing:  # spread the rest over the frames that are left
            later = [pool[round(k * (len(pool) - 1) / max(missing - 1, 1))] for k in range(missing)]
        more, more_stamps, more_problems = self._decode(sorted(set(later))[:missing], size, keyframes_only=False)
        return out + more, stamps + more_stamps, more_problems

    def close(self) -> None:
        self._container.close()


class _DecordDecoder(Decoder):
    def __init__(self, path: str):
        try:
            import decord
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise VideoError("the decord backend needs `pip install 'paravt[decord]'`") from exc
        try:
            self._vr = decord.VideoReader(path, ctx=decord.cpu(0), num_threads=2)
        except Exception as exc:  # decord raises bare DECORDError/RuntimeError
            raise VideoError(explain_unreadable(path, path, f"decord: {exc}")) from exc
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


class _TorchCodecDecoder(Decoder):
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
            raise VideoError(explain_unreadable(path, path, f"torchcodec: {exc}")) from exc
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


DECODERS = {"pyav": _PyAVDecoder, "decord": _DecordDecoder, "torchcodec": _TorchCodecDecoder}


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
