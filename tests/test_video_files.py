"""Video files that are hostile but fair: rotated phone videos reach the model upright, a text file is not a video,
a keyframe-snapped overview fills every target, and a damaged file's warnings reach the trace."""

from pathlib import Path

import pytest


def _write(path, frames, rate=4, rotation=None, gop=None):
    import av

    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=rate)
        s.height, s.width = frames[0].shape[:2]
        s.pix_fmt = "yuv420p"
        if gop:
            s.codec_context.gop_size = gop
        if rotation is not None:
            s.set_display_rotation(rotation)
        for f in frames:
            for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return str(path)


def test_rotated_phone_videos_reach_the_model_upright(tmp_path):
    import numpy as np
    from av.video.stream import VideoStream

    if not hasattr(VideoStream, "set_display_rotation"):  # reading the matrix needs PyAV 14.1, writing it 18
        pytest.skip("this PyAV cannot write a display matrix (PyAV >= 18 can); the reader needs >= 14.1")

    from paravt_agent.video import VideoReader

    img = np.zeros((32, 64, 3), np.uint8)
    img[:, :32] = (230, 20, 20)  # left half red, right half blue (as coded)
    img[:, 32:] = (20, 20, 230)
    for rotation, k in ((90, 1), (270, 3), (180, 2)):
        path = _write(tmp_path / f"rot{rotation}.mp4", [img] * 8, rotation=rotation)
        r = VideoReader(path)
        assert r.info.rotation == rotation
        frame = r.overview(n=2, max_pixels=64 * 32, factor=32).frames[0]
        want = np.rot90(img, k)  # displayed: turned counter-clockwise by the display matrix
        assert frame.shape == want.shape
        assert np.abs(frame.astype(int) - want.astype(int)).mean() < 20
    plain = VideoReader(_write(tmp_path / "plain.mp4", [img] * 8))
    assert plain.info.rotation == 0 and (plain.info.width, plain.info.height) == (64, 32)


def test_a_text_file_is_not_a_video(tmp_path, media):
    from paravt_agent.agent import Agent
    from paravt_agent.errors import VideoError
    from paravt_agent.policy.scripted import ScriptedPolicy
    from paravt_agent.video import open_video

    text = tmp_path / "notes.txt"
    text.write_text("hello world this is a longer text file with some content " * 50)
    with pytest.raises(VideoError, match="not a video"):
        open_video(text)
    agent = Agent(policy=ScriptedPolicy(lambda role, m: "<answer>A</answer>"))
    with pytest.raises(VideoError, match="not a video"):
        agent.answer(text, "What is shown?")


def test_keyframe_overview_fills_every_target(tmp_path):
    import numpy as np

    from paravt_agent.video import VideoReader

    frames = [np.full((32, 32, 3), 6 * i, np.uint8) for i in range(40)]
    path = _write(tmp_path / "sparse.mp4", frames, rate=4, gop=250)  # one keyframe in 10 s
    clip = VideoReader(path).overview(n=8, fast_overview=True)
    assert len(clip) == 8 and clip.timestamps == sorted(set(clip.timestamps))  # exactly n, increasing
    assert not clip.warnings


def test_damaged_video_warnings_reach_the_trace(media, tmp_path):

    from paravt_agent.agent import Agent
    from paravt_agent.policy.scripted import ScriptedPolicy

    data = Path(media["faststart"]).read_bytes()
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(data[: int(len(data) * 0.6)])
    agent = Agent(policy=ScriptedPolicy(lambda role, m: "<think>seen</think><answer>A</answer>"))
    with pytest.warns(RuntimeWarning):
        ans = agent.answer(cut, "What is shown?")
    assert ans.trace.warnings and "truncated" in ans.trace.warnings[0] and "Warnings:" in ans.trace.render()
