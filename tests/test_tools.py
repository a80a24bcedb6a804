import asyncio
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from paravt_agent.protocol import parse_tool_calls
from paravt_agent.video import FrameConfig, VideoReader
from tools import Tool, ToolContext, ToolRegistry, ToolResult
from tools.builtin import read_subtitles, shot_boundaries


@pytest.fixture
def ctx(media):
    return ToolContext(video=VideoReader(media["video"]), frames=FrameConfig(crop_fps=1.0))


@pytest.fixture
def reg():
    return ToolRegistry.default()


def prep(reg, ctx, text, **kw):
    return reg.prepare(parse_tool_calls(text, reg.signatures()), ctx, **kw)


def test_schemas_render_as_openai_functions(reg):
    names = reg.names()
    assert {"crop_video", "get_subtitles", "zoom_frame", "scene_changes"} <= set(names)
    for schema in reg.schemas():
        fn = schema["function"]
        assert schema["type"] == "function" and fn["description"]
        params = fn["parameters"]
        assert params["type"] == "object" and set(params["required"]) <= set(params["properties"])
        json.dumps(schema)
    crop = reg.get("crop_video").schema()["function"]["parameters"]
    assert crop["required"] == ["start_time", "end_time"]
    assert crop["properties"]["start_time"]["type"] == "number"


def test_window_validation(reg, ctx):
    text = (
        "<tool_call>crop_video(10, 20)</tool_call>"  # ok
        "<tool_call>crop_video(30, 90)</tool_call>"  # end clamped to 40
        "<tool_call>crop_video(20, 10)</tool_call>"  # start >= end
        "<tool_call>crop_video(-5, 10)</tool_call>"  # negative
        "<tool_call>crop_video(45, 50)</tool_call>"  # beyond the end
        # duplicate
        '<tool_call>{"name": "crop_video", "arguments": {"start_time": "00:10", "end_time": "00:20"}}</tool_call>'
        "<tool_call>crop_video(1, 'abc')</tool_call>"  # bad time
        "<tool_call>fly_drone(1)</tool_call>"  # unknown
        "<tool_call>{broken</tool_call>"
    )
    p = prep(reg, ctx, text)
    assert len(p) == 9
    assert p[0].ok and (p[0].args.start_time, p[0].args.end_time) == (10, 20)
    assert p[1].ok and p[1].args.end_time == 40.0
    assert "before end_time" in p[2].error
    assert "negative" in p[3].error
    assert "beyond the end" in p[4].error
    assert "duplicate of call 1" in p[5].error
    assert "not a time" in p[6].error
    assert "unknown tool 'fly_drone'" in p[7].error
    assert "malformed" in p[8].error


def test_cap_on_calls_per_turn(reg, ctx):
    text = "".join(f"<tool_call>crop_video({i}, {i + 1})</tool_call>" for i in range(5))
    p = prep(reg, ctx, text, max_calls=4)
    assert [x.ok for x in p] == [True] * 4 + [False]
    assert "at most 4" in p[4].error
    # past the cap, one slot sums up the rest, however many there are (invalid calls included)
    text = "".join(f"<tool_call>crop_video({i}, {i + 1})</tool_call>" for i in range(30)) + "<tool_call>{bad"
    p = prep(reg, ctx, text, max_calls=4)
    assert len(p) == 5 and "27 more tool calls not run" in p[4].error


def test_a_tool_response_turn_is_bounded():
    from paravt_agent.prompts import MAX_SLOT_CHARS, tool_response_message

    msg = tool_response_message([("x" * 10_000, "y" * 100_000)] * 3)["content"]
    assert len(msg) < 3 * (MAX_SLOT_CHARS + 400) and "characters cut" in msg


def test_video_path_is_never_opened(reg, ctx, tmp_path):
    other = tmp_path / "secret.mp4"
    p = prep(reg, ctx, f'<tool_call>crop_video("{other}", 1, 2)</tool_call>'
                       '<tool_call>crop_video("../../etc/passwd", 3, 4)</tool_call>'
                       '<tool_call>crop_video("video.mp4", 5, 6)</tool_call>'
                       f'<tool_call>crop_video("{ctx.video.path}", 7, 8)</tool_call>')
    assert not p[0].ok and "not the video of this question" in p[0].error
    assert not p[1].ok
    assert p[2].ok and p[3].ok and p[3].args.video_path is None  # placeholder and the real path are fine
    ctx.strict_video_path = False
    assert prep(reg, ctx, f'<tool_call>crop_video("{other}", 1, 2)</tool_call>')[0].ok


def test_crop_video_runs(reg, ctx):
    [p] = prep(reg, ctx, '<tool_call>{"name": "crop_video", "arguments": {"start_time": 4, "end_time": 9}}</tool_call>')
    res = asyncio.run(p.tool.run(p.args, ctx))
    assert res.is_visual and res.timestamps == [4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    assert res.window == (4.0, 9.0)


def test_subtitles(reg, ctx, media, tmp_path):
    srt = textwrap.dedent("""\
        1
        00:00:01,000 --> 00:00:03,500
        Hello <i>there</i>

        2
        00:00:20,000 --> 00:00:22,000
        The red ball falls.
        """)
    (media["dir"] / "colours.srt").write_text(srt)
    try:
        assert read_subtitles(media["dir"] / "colours.srt")[0] == (1.0, 3.5, "Hello there")
        [p] = prep(reg, ctx, "<tool_call>get_subtitles(15, 25)</tool_call>")
        res = asyncio.run(p.tool.run(p.args, ctx))
        assert res.text == "[00:20-00:22] The red ball falls." and not res.is_visual
    finally:
        (media["dir"] / "colours.srt").unlink()
    [p] = prep(reg, ctx, "<tool_call>get_subtitles(15, 25)</tool_call>")
    with pytest.raises(Exception, match="no subtitle file"):
        asyncio.run(p.tool.run(p.args, ctx))


def test_zoom_frame(reg, ctx):
    [p] = prep(reg, ctx, "<tool_call>zoom_frame(5.0, 0.5, 0.5, 1.0, 1.0)</tool_call>")
    res = asyncio.run(p.tool.run(p.args, ctx))
    assert res.frames.shape[0] == 1 and res.timestamps == [5.0]
    [bad] = prep(reg, ctx, "<tool_call>zoom_frame(5.0, 0.8, 0.5, 0.2, 1.0)</tool_call>")
    assert "x1 < x2" in bad.error


def test_scene_changes_finds_the_cuts(reg, ctx):
    [p] = prep(reg, ctx,
               '<tool_call>{"name": "scene_changes", "arguments": {"start_time": 0, "end_time": 12}}</tool_call>')
    res = asyncio.run(p.tool.run(p.args, ctx))
    assert res.text.startswith("5 shot boundaries") and "00:02, 00:04, 00:06, 00:08, 00:10" in res.text
    frames = np.zeros((3, 4, 4, 3), np.uint8)
    assert shot_boundaries(frames, [0, 1, 2], 0.2) == []


class Echo(Tool):
    name = "echo"
    description = "Echo a word."

    from pydantic import BaseModel as _B

    class Args(_B):
        word: str

    async def run(self, args, ctx):
        return ToolResult(text=args.word)


def test_entry_point_plugins_are_discovered(tmp_path, monkeypatch):
    pkg = tmp_path / "plug"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mytools.py").write_text(textwrap.dedent("""\
        from pydantic import BaseModel
        from tools import Tool, ToolResult

        class Shout(Tool):
            name = "shout"
            description = "Shout a word."
            positional = ["word"]

            class Args(BaseModel):
                word: str

            async def run(self, args, ctx):
                return ToolResult(text=args.word.upper())
        """))
    dist = tmp_path / "plug-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: plug\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[paravt.tools]\nshout = plug.mytools:Shout\nbroken = plug.nothere:X\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = ToolRegistry.default()
    assert "shout" in reg and reg.signatures()["shout"] == ["word"]
    out = subprocess.run(
        [sys.executable, "-m", "paravt_agent.cli", "tools"], capture_output=True, text=True,
        env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)}, check=True,
    ).stdout
    assert "shout" in out and "crop_video" in out and "start_time" in out


def test_register_rejects_non_tools():
    reg = ToolRegistry([Echo()])
    assert reg.names() == ["echo"]
    with pytest.raises(TypeError):
        reg.register(object())
