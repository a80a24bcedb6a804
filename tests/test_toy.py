"""The toy world: its videos, its questions' evidence design, its traces and the build pipeline."""

import numpy as np
import pytest

from paravt_agent.protocol import parse_tool_calls
from paravt_agent.video import VideoReader
from paravt_train.toy.quickstart import shortcut
from paravt_train.toy.world import COLOURS, make_world, make_worlds, parallel_trace, sft_rows
from tools import ToolRegistry

SCHEMA = ToolRegistry.default(entry_points_too=False).subset(["crop_video"]).schemas()


def nearest_colour(rgb):
    return min(COLOURS, key=lambda c: np.abs(np.array(COLOURS[c]) - rgb).sum())


@pytest.mark.parametrize("seed", range(20))
def test_world_timeline(seed):
    w = make_world(seed)
    assert 60 <= w.duration <= 90
    assert w.segments[0][1] == 0 and w.segments[-1][2] == w.duration
    for (c1, _, b1), (c2, a2, _) in zip(w.segments, w.segments[1:], strict=False):
        assert b1 == a2 and c1 != c2
    assert all(2 <= b - a <= 5 for _, a, b in w.segments)
    assert [c for c, _, _ in w.segments].count(w.unique) == 1
    tasks = [q.task for q in w.questions]
    assert tasks == ["mcq", "oe", "tvg"]
    mcq = w.questions[0]
    assert mcq.options[" ABCD".index(mcq.answer) - 1].endswith(w.colour_at(mcq.t))


def test_video_shows_the_timeline_and_the_trace_matches_the_frames(tmp_path):
    [w] = make_worlds([7], tmp_path)
    r = VideoReader(w.video)
    assert r.info.duration == pytest.approx(w.duration, abs=0.01)
    ov = r.overview(max_pixels=1024)
    assert ov.frames.shape[1:3] == (32, 32) and len(ov) == min(64, w.duration)
    for frame, t in zip(ov.frames, ov.timestamps, strict=True):
        assert nearest_colour(frame.reshape(-1, 3).mean(0)) == w.colour_at(t)
    # the summaries in a trace are exactly what the crop frames show
    for q in w.questions:
        msgs = parallel_trace(w, q, w.video, 8, SCHEMA)
        calls = parse_tool_calls(msgs[2]["content"])
        assert calls and all(c.ok for c in calls)
        for c in calls:
            a, b = c.arguments["start_time"], c.arguments["end_time"]
            clip = r.crop(a, b, fps=1.0, max_pixels=1024)
            seen = [f"{round(t)} {nearest_colour(f.reshape(-1, 3).mean(0))}" for f, t in zip(clip.frames, clip.timestamps, strict=True)]
            if q.task == "tvg":
                hits = [s.split()[0] for s in seen if s.endswith(q.colour)]
                assert w.sightings(q.colour, a, b) == f"{q.colour} at: {' '.join(hits) if hits else 'none'}"
            else:
                assert w.listing(a, b) == "; ".join(seen)


def test_evidence_is_not_in_a_sparse_overview_but_is_in_a_dense_one(tmp_path):
    worlds = [make_world(s) for s in range(200)]
    base = shortcut(worlds, (4, 8, 64))
    assert base[8]["mcq"] < 0.55 and base[4]["mcq"] < 0.45  # reading the nearest frame is a weak shortcut
    assert base[64]["mcq"] > 0.85  # with 64 frames every segment is visible
    assert base[8]["tvg"] < 0.3 and base[64]["tvg"] > 0.5


def test_sft_rows_mix():
    worlds = [make_world(s) for s in range(10)]
    for w in worlds:
        w.video = f"/v/{w.wid}.mp4"
    rows = sft_rows(worlds, SCHEMA, video_root="/v")
    kinds = {r["id"].rsplit("-", 1)[1][:3] for r in rows}
    assert kinds == {"par", "ans", "seq", "dir", "sub"}
    assert sum(r["id"].endswith("-par") for r in rows) == 30
    # the answer-focused copy: the planner turn is context, only the answer turn is trained
    ans = [r for r in rows if r["id"].endswith("-ans")]
    assert len(ans) == 30
    for r in ans:
        turns = [m for m in r["messages"] if m["role"] == "assistant"]
        assert [m.get("train", True) for m in turns] == [False, True] and "<answer>" in turns[-1]["content"]


def test_build_is_cached_and_quickstart_runs(tmp_path):
    from paravt_train.toy.build import ToyConfig, build
    from paravt_train.toy.quickstart import run

    cfg = ToyConfig(out=str(tmp_path / "toy"), train_worlds=4, test_worlds=1, steps=2, size="test", vocab_size=600,
                    batch_size=4)
    logs = []
    model = build(cfg, progress=False, log=logs.append)
    assert (model / "config.json").is_file() and (model / "agent_config.yaml").is_file()
    assert build(cfg, progress=False, log=logs.append) == model and "already built" in logs[-1]
    out = run(model, out=tmp_path / "qs", worlds=1, modes=("parallel", "none"), ns=(8,), progress=False,
              log=logs.append)
    assert set(out["results"]) == {("parallel", 8), ("none", 8)}
    assert out["results"][("none", 8)]["calls"] == 0
    assert "| parallel | 8 |" in out["table"] and "nearest-frame shortcut" in out["table"]
    assert any("one full trace" in m for m in logs)
