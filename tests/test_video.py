import os
import warnings
from pathlib import Path

import numpy as np
import pytest

from paravt_agent.video import (
    POOL,
    VideoError,
    VideoReader,
    available_backends,
    crop_times,
    fit_size,
    open_video,
    overview_times,
)
from paravt_train.toy.render import write_audio_only, write_segments
from tests.conftest import PALETTE


def colour_at(t, seconds_per_segment=2.0):
    return np.array(PALETTE[int(t // seconds_per_segment) % len(PALETTE)])


def test_info(media):
    info = VideoReader(media["video"]).info
    assert info.duration == pytest.approx(40.0)
    assert info.fps == pytest.approx(30.0)
    assert info.num_frames == 1200
    assert (info.width, info.height) == (96, 64)


def test_fit_size_protocol():
    assert fit_size(360, 640, 50176, 32) == (160, 288)  # 46080 <= 50176, aspect ~1.8
    h, w = fit_size(1080, 1920, 50176, 28)
    assert h % 28 == 0 and w % 28 == 0 and h * w <= 50176
    assert fit_size(64, 96, 50176, 32) == (64, 96)  # small frames are not upscaled
    assert fit_size(10, 10, 50176, 32) == (32, 32)


def test_overview_times_protocol():
    assert overview_times(40.0) == [float(i) for i in range(40)]  # 1 fps, under 64 frames: all
    long = overview_times(3600.0)
    assert len(long) == 64 and long[0] == 0.0 and long[-1] == 3599.0
    assert overview_times(40.0, n=4) == [0.0, 13.0, 26.0, 39.0]
    # gating never samples faster than the 1 fps grid: a 30 s video at n = 64 gets its 30 frames
    assert overview_times(30.0, n=64) == [float(i) for i in range(30)]
    assert overview_times(3.0, n=8) == [0.0, 1.0, 2.0]
    assert crop_times(10, 20, 30.0, max_frames=16)[0] == 10 and len(crop_times(10, 20, 30.0)) == 16
    assert crop_times(10, 14, 30.0, fps=1.0) == [10.0, 11.0, 12.0, 13.0, 14.0]


def test_overview_frames_and_timestamps_are_true(media):
    clip = VideoReader(media["video"]).overview()
    assert clip.frames.shape == (40, 64, 96, 3)
    assert clip.timestamps == [float(i) for i in range(40)]
    for frame, t in zip(clip.frames, clip.timestamps, strict=True):
        assert np.abs(frame.reshape(-1, 3).mean(0) - colour_at(t)).max() < 12


@pytest.mark.parametrize("n", [4, 8, 16, 32, 64])
def test_overview_exactly_n(media, n):
    clip = VideoReader(media["video"]).overview(n=n)
    assert len(clip) == min(n, 40) == len(clip.frames)  # a 40 s video has 40 frames at 1 fps
    assert clip.timestamps == sorted(clip.timestamps)


def test_max_pixels_and_factor(media):
    clip = VideoReader(media["video"]).overview(n=2, max_pixels=32 * 32 * 2, factor=32)
    assert clip.frames.shape[1:] == (32, 32, 3)
    clip28 = VideoReader(media["video"]).overview(n=2, factor=28)
    assert clip28.frames.shape[1] % 28 == 0 and clip28.frames.shape[2] % 28 == 0


def test_crop_inside_window(media):
    clip = VideoReader(media["sparse"]).crop(13.0, 23.5)
    assert len(clip) == 16
    assert all(13.0 <= t <= 23.5 for t in clip.timestamps)
    for frame, t in zip(clip.frames, clip.timestamps, strict=True):
        assert np.abs(frame.reshape(-1, 3).mean(0) - colour_at(t)).max() < 12
    one_fps = VideoReader(media["video"]).crop(4, 8, crop_fps=1.0)
    assert one_fps.timestamps == [4.0, 5.0, 6.0, 7.0, 8.0]


def test_crop_end_clamped_and_errors(media):
    r = VideoReader(media["video"])
    assert r.crop(36, 90).timestamps[-1] < 40.0
    with pytest.raises(VideoError, match="must be before end_time"):
        r.crop(10, 10)
    with pytest.raises(VideoError, match="negative"):
        r.crop(-1, 5)
    with pytest.raises(VideoError, match="beyond the end of the video"):
        r.crop(41, 50)


def test_fast_mode_returns_keyframes_with_true_timestamps(media):
    r = VideoReader(media["sparse"])  # keyframes every 250 frames = 8.33 s
    fast = r.overview(n=8, fast_overview=True)
    assert fast.keyframe_snapped
    assert len(fast) >= 4
    assert fast.timestamps == sorted(set(fast.timestamps))
    for t in fast.timestamps:  # x264 default: keyframes at multiples of 250 frames (plus scene cuts)
        assert (t * 30) == pytest.approx(round(t * 30))
    for frame, t in zip(fast.frames, fast.timestamps, strict=True):
        assert np.abs(frame.reshape(-1, 3).mean(0) - colour_at(t)).max() < 12
    exact = r.overview(n=8)
    assert exact.timestamps != fast.timestamps  # snapped to keyframes, not the requested grid


@pytest.mark.parametrize("backend", [b for b in ("decord", "torchcodec") if b in available_backends()])
def test_backends_agree(media, backend):
    ref, other = VideoReader(media["sparse"]), VideoReader(media["sparse"], backend=backend)
    assert other.info.num_frames == ref.info.num_frames
    assert other.info.duration == pytest.approx(ref.info.duration, abs=0.05)
    pairs = ((ref.overview(), other.overview()), (ref.crop(5, 17), other.crop(5, 17)),
             (ref.overview(n=8), other.overview(n=8)))
    for a, b in pairs:
        assert a.timestamps == pytest.approx(b.timestamps, abs=1e-3)
        assert a.frames.shape == b.frames.shape
        assert np.abs(a.frames.astype(int) - b.frames.astype(int)).mean() < 3  # equal up to interpolation
    if backend == "decord":
        assert ref.overview(n=8, fast_overview=True).timestamps == pytest.approx(
            other.overview(n=8, fast_overview=True).timestamps)


def test_cache_reuses_decoders_and_keys_everything(media, tmp_path):
    path = write_segments(tmp_path / "c.mp4", [((255, 0, 0), 2), ((0, 0, 255), 2)], fps=10, width=32, height=32)
    POOL.clear()
    opened = POOL.opened
    for _ in range(5):
        VideoReader(path).crop(0.5, 3.0)
    assert POOL.opened - opened == 1
    r = VideoReader(path)
    assert r.overview(n=2).timestamps != r.overview(n=3).timestamps
    big = VideoReader(media["video"])
    assert big.overview(n=2, max_pixels=1024).frames.shape[1:3] == (32, 32)
    assert big.overview(n=2, max_pixels=4096, factor=16).frames.shape[1:3] == (48, 64)
    assert r.crop(0, 1).timestamps != r.crop(0, 3).timestamps
    # same path, new content: the cache key includes size and mtime, so frames change
    before = r.overview(n=1).frames.mean(axis=(0, 1, 2))
    write_segments(path, [((0, 255, 0), 5)], fps=10, width=32, height=32)
    os.utime(path, ns=(1, 1))
    after = VideoReader(path).overview(n=1).frames.mean(axis=(0, 1, 2))
    assert after[1] > 200 and before[1] < 50


def test_frame_cache_is_bounded_by_bytes(media):
    from paravt_agent.video.reader import DecoderPool

    pool = DecoderPool(max_result_bytes=3 * 8 * 64 * 96 * 3)  # three 8-frame 64x96 overviews
    r = VideoReader(media["video"], pool=pool)
    clips = [r.overview(n=8, max_pixels=64 * 96 + i) for i in range(5)]  # five keys, same size
    assert all(c.frames.nbytes == 8 * 64 * 96 * 3 for c in clips)
    assert pool.result_bytes == 3 * clips[0].frames.nbytes and len(pool._results) == 3
    assert r.overview(n=8, max_pixels=64 * 96 + 4) is clips[4]  # the newest are kept
    assert r.overview(n=8, max_pixels=64 * 96) is not clips[0]  # the oldest went
    huge = DecoderPool(max_result_bytes=100)
    VideoReader(media["video"], pool=huge).overview(n=8)
    assert huge.result_bytes == 0  # a clip larger than the whole cache is not kept


def test_bad_inputs(tmp_path, media):
    with pytest.raises(VideoError, match="no such file"):
        VideoReader(tmp_path / "missing.mp4")
    text = tmp_path / "notes.mp4"
    text.write_text("this is not a video")
    with pytest.raises(VideoError, match="not a video"):
        open_video(text)
    with pytest.raises(VideoError, match="audio-only"):
        open_video(write_audio_only(tmp_path / "speech.m4a"))
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    with pytest.raises(VideoError, match="zero length"):
        open_video(empty)
    import av

    zero = tmp_path / "zero.mp4"
    c = av.open(str(zero), "w")
    s = c.add_stream("libx264", rate=30)
    s.width = s.height = 32
    s.pix_fmt = "yuv420p"
    c.start_encoding()
    c.close()
    with pytest.raises(VideoError, match="zero-length"):
        open_video(zero)
    with pytest.raises(VideoError, match="unknown video backend"):
        VideoReader(media["video"], backend="opencv")


def test_truncated_file_returns_what_decodes(media, tmp_path):
    data = Path(media["faststart"]).read_bytes()
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(data[: int(len(data) * 0.6)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        clip = VideoReader(cut).overview()
    assert 0 < len(clip) < 12
    assert clip.warnings and any("truncated" in str(w.message) for w in caught)
    worse = tmp_path / "worse.mp4"
    worse.write_bytes(data[:200])
    with pytest.raises(VideoError):
        VideoReader(worse).overview()


@pytest.fixture(scope="module")
def textured(tmp_path_factory):
    """40 s of moving texture at 30 fps with x264's B-frames and default keyframe interval (250 frames):
    most frames reference others, some do not, keyframes are sparse."""
    from paravt_train.toy.render import write_video

    rng = np.random.default_rng(3)
    tex = rng.integers(0, 256, (12, 20, 3), dtype=np.uint8).repeat(8, 0).repeat(8, 1)  # 96x160

    def frame(i):
        img = np.roll(tex, shift=(i * 3) % 160, axis=1).copy()
        img[40:56, (i * 2) % 140:(i * 2) % 140 + 16] = 255
        return img

    return write_video(tmp_path_factory.mktemp("tex") / "tex.mp4", 40 * 30, frame, fps=30, width=160, height=96)


def _plain_decode(path, indices, size):
    """Ground truth: every frame decoded in order, no skipping, no seeking; the first at or after each index."""
    import av

    h, w = size
    out, stamps, want = [], [], list(indices)
    with av.open(path) as c:
        s = c.streams.video[0]
        fps, tb, start = float(s.average_rate), float(s.time_base), s.start_time or 0
        for f in c.decode(s):
            while want and round((f.pts - start) * tb * fps) >= want[0]:
                out.append(f.to_ndarray(width=w, height=h, format="rgb24", interpolation="BILINEAR"))
                stamps.append(round(float((f.pts - start) * tb), 6))
                want.pop(0)
            if not want:
                break
    return out, stamps


def test_skipping_and_parallel_decoding_give_the_frames_of_a_plain_decode(textured):
    from paravt_agent.video.sampling import FrameConfig

    reader = VideoReader(textured)
    info = reader.info
    size = fit_size(info.height, info.width)
    times = overview_times(info.duration, n=64)
    indices = sorted({min(info.num_frames - 1, int(np.floor(t * info.fps + 1e-6))) for t in times})
    frames, stamps = _plain_decode(textured, indices, size)
    for workers in (1, 2, 4):
        POOL.clear()
        clip = reader.overview(64, FrameConfig(decode_workers=workers))
        assert clip.timestamps == stamps, workers
        assert np.array_equal(clip.frames, np.stack(frames)), workers
    # keyframe mode: 64 targets over 5 keyframes (two stretches meet at one keyframe): the same as one decoder
    POOL.clear()
    one = reader.overview(64, FrameConfig(fast_overview=True, decode_workers=1))
    for workers in (2, 4):
        POOL.clear()
        many = reader.overview(64, FrameConfig(fast_overview=True, decode_workers=workers))
        assert many.timestamps == one.timestamps and np.array_equal(many.frames, one.frames)
    import av

    with av.open(textured) as c:
        s = c.streams.video[0]
        keyframes = {round(float(f.pts * s.time_base), 6) for f in c.decode(s) if f.key_frame}
    assert len(keyframes) == 5 and keyframes <= set(one.timestamps)  # every keyframe, at its true time
    assert one.timestamps == sorted(set(one.timestamps))
    # a crop decodes the same too
    POOL.clear()
    crop = reader.crop(12.3, 19.9, FrameConfig(decode_workers=4))
    c_idx = sorted({int(np.floor(t * info.fps + 1e-6)) for t in crop_times(12.3, 19.9, info.fps, 16, 2.0)})
    c_frames, c_stamps = _plain_decode(textured, c_idx, size)
    assert crop.timestamps == c_stamps and np.array_equal(crop.frames, np.stack(c_frames))
