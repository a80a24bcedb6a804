import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from paravt_train.toy.render import write_segments  # noqa: E402

PALETTE = [
    (230, 25, 75),
    (60, 180, 75),
    (255, 225, 25),
    (0, 130, 200),
    (245, 130, 48),
    (145, 30, 180),
    (70, 240, 240),
    (240, 50, 230),
]


@pytest.fixture(scope="session")
def media(tmp_path_factory):
    """Real mp4 files made once per session."""
    d = tmp_path_factory.mktemp("media")
    # 40 s, 30 fps, 96x64, a new colour every 2 s, keyframe every 30 frames (1 s)
    segs = [(PALETTE[i % len(PALETTE)], 2.0) for i in range(20)]
    return {
        "dir": d,
        "segments": segs,
        "video": write_segments(d / "colours.mp4", segs, fps=30, width=96, height=64, gop=30),
        # default x264 keyframe interval (250 frames): seeks land far back
        "sparse": write_segments(d / "sparse.mp4", segs, fps=30, width=96, height=64),
        "faststart": write_segments(d / "fast.mp4", segs[:6], fps=30, width=96, height=64, gop=30, faststart=True),
    }


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny random Qwen3-VL-architecture model directory built offline."""
    from paravt_train.toy.tiny import build_tiny_model

    corpus = ["red green blue yellow purple orange window shows seconds answer question"] * 4
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", corpus, size="test"))


@pytest.fixture(scope="session")
def toy_policy_dir():
    """The toy policy the repository ships (trained by `paravt-train toy`): it calls tools."""
    from paravt_train.toy.quickstart import REPO_CHECKPOINT

    return str(REPO_CHECKPOINT)


@pytest.fixture(scope="session")
def toy_rl(tmp_path_factory):
    """Four toy worlds (real mp4s) and their RL Parquet file."""
    from paravt_train.data import write_parquet
    from paravt_train.toy.world import make_worlds, rl_rows

    d = tmp_path_factory.mktemp("toyrl")
    worlds = make_worlds(range(910_000, 910_004), d / "videos")
    path = write_parquet(rl_rows(worlds, d / "videos"), d / "rl.parquet")
    return {"dir": d, "worlds": worlds, "data": str(path), "video_root": str(d / "videos")}
