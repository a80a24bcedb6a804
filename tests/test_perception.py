"""Model-backed tools (Weaver's set) end to end on generated mp4s: a policy that reads the pixels it is shown
(scripted perception: right span, frame and box), the tiny local model (its calls recorded as trainable token
sequences, or frozen), another endpoint for a tool, and the tool-success reward term."""

import json
import re

import numpy as np
import pytest

from paravt_agent.agent import Agent
from paravt_agent.config import AgentConfig
from paravt_agent.policy.base import text_of
from paravt_agent.policy.scripted import ScriptedPolicy
from paravt_train.toy.render import write_video


@pytest.fixture(scope="module")
def square_video(tmp_path_factory):
    """10 s at 5 fps, 160x120 black, a white square at x 96-128, y 24-56 from second 4 on."""
    d = tmp_path_factory.mktemp("square")

    def frame(i):
        img = np.zeros((120, 160, 3), np.uint8)
        if i >= 20:
            img[24:56, 96:128] = 255
        return img

    return write_video(d / "square.mp4", 50, frame, fps=5, width=160, height=120, gop=5)


def images_of(msgs):
    """(timestamp, pixels) of every image the messages show."""
    return [(p.get("timestamp"), p["image"]) for m in msgs if not isinstance(m["content"], str)
            for p in m["content"] if p.get("type") == "image"]


def iou(p, q) -> float:
    inter = max(0.0, min(p[1], q[1]) - max(p[0], q[0]))
    return inter / (max(p[1], q[1]) - min(p[0], q[0]))


def is_red(img) -> bool:
    r, g, b = img.reshape(-1, 3).mean(0)
    return r > 150 and b < 100


def perceiving(call: str, answer: str = "<think>done</think><answer>{slot}</answer>"):
    """Planner: ``call``, then an answer quoting the tool response. Tools' model calls and sub-agents: read the
    pixels they are shown (what a perception model does, with a rule)."""

    def script(role, msgs):
        if role == "tool:temporal_grounding":
            shown = images_of(msgs)
            red = [t for t, im in shown if is_red(im)]
            step = shown[1][0] - shown[0][0]
            return f"[{red[0]:g}, {red[-1] + step:g}]" if red else "none"
        if role == "tool:frame_selection":
            (_, im), = images_of(msgs)
            return f"{float(im[..., 0].mean() / 255):.2f}"
        if role == "tool:spatial_grounding":
            (_, im), = images_of(msgs)
            ys, xs = np.nonzero(im.mean(-1) > 200)
            if not len(xs):
                return "[]"
            return "```json\n" + json.dumps([{"bbox_2d": [int(xs.min()), int(ys.min()), int(xs.max()) + 1,
                                                          int(ys.max()) + 1], "label": "square"}]) + "\n```"
        if role == "subagent":
            shown = images_of(msgs)
            return f"{len(shown)} frames, red: {sum(is_red(im) for _, im in shown)}"
        last = text_of(msgs[-1]["content"])
        if "<tool_response>" in last:
            return answer.format(slot=last.split("</tool_response>")[0].split("\n", 1)[1].strip())
        return f"<think>look closer</think>\n<tool_call>{call}</tool_call>"

    return script


def run(video, call, tools, question="When is the screen red?", **cfg):
    pol = ScriptedPolicy(perceiving(call))
    agent = Agent(policy=pol, config=AgentConfig(tools=tools, **cfg))
    return agent.answer(video, question), pol


def test_temporal_grounding_finds_the_span(red_video):
    call = json.dumps({"name": "temporal_grounding", "arguments": {"query": "the screen turns red",
                                                                  "start_time": 12, "end_time": 28}})
    ans, pol = run(red_video, call, ["temporal_grounding"])
    (slot,) = ans.trace.turns[0].calls
    assert slot.error is None and slot.window == (12.0, 28.0) and slot.evidence == "text"
    a, b = (float(v) for v in re.search(r"\(\[([\d.]+), ([\d.]+)\]\)", slot.summary).groups())
    assert iou((a, b), (17.0, 20.0)) > 0.7  # frames sampled inside the window's seconds: within a second
    assert ans.span == (a, b)  # the planner copied the tool's span into its answer
    recs = [r for r in ans.records if r.role.startswith("tool:")]
    assert [(r.role, r.turn, r.index, r.trainable) for r in recs] == [("tool:temporal_grounding", 0, 0, True)] * 2
    # the window cut into crops of 16 frames at the crop rate (2 fps: 8 s each), one model call per crop
    assert [len(r.images) for r in recs] == [16, 16]
    assert [r for r, _ in pol.calls].count("subagent") == 0  # a text result needs no sub-agent
    assert "frames" not in (slot.summary or "")  # the grounded clip's frames go only to a planner reading frames


def test_temporal_grounding_defaults_to_the_whole_video_and_says_when_nothing_is_found(red_video):
    call = json.dumps({"name": "temporal_grounding", "arguments": {"query": "red"}})
    ans, _ = run(red_video, call, ["temporal_grounding"])
    (slot,) = ans.trace.turns[0].calls
    assert slot.window == (0.0, 40.0)
    span = re.search(r"\[([\d.]+), ([\d.]+)\]", slot.summary)
    a, b = float(span.group(1)), float(span.group(2))
    assert 14.0 <= a <= 19.0 and 19.5 <= b <= 23.5  # 16 frames over 40 s: 2.5 s apart
    call = json.dumps({"name": "temporal_grounding", "arguments": {"query": "red", "start_time": 0, "end_time": 12}})
    ans, _ = run(red_video, call, ["temporal_grounding"])
    assert "not found between 00:00 and 00:12" in ans.trace.turns[0].calls[0].summary


def test_frame_selection_keeps_the_best_scored_frame(red_video):
    call = json.dumps({"name": "frame_selection", "arguments": {"query": "a red screen", "start_time": "00:10",
                                                                "end_time": "00:26"}})
    ans, pol = run(red_video, call, ["frame_selection"])
    (slot,) = ans.trace.turns[0].calls
    recs = [r for r in ans.records if r.role == "tool:frame_selection"]
    assert len(recs) == 16 and all(len(r.images) == 1 for r in recs)  # one scored call per frame
    (t,) = slot.frame_timestamps
    assert 17.0 <= t < 20.0 and slot.window == (t, t)  # a red frame
    m = re.match(r"Best frame for 'a red screen': ([\d.]+) seconds \(00:1\d\), confidence 0\.8\d", slot.summary)
    assert m and float(m.group(1)) == t
    shown = sorted(float(re.search(r"<([\d.]+) seconds>", text_of(r_msgs[0]["content"])).group(1))
                   for r, r_msgs in pol.calls if r == "tool:frame_selection")
    assert t == min(x for x in shown if x >= 17.0)  # the earliest of the equally red frames
    assert slot.summary.endswith("1 frames, red: 1")  # the sub-agent saw that one frame


def test_spatial_grounding_boxes_the_object_in_video_pixels_and_returns_its_crop(square_video):
    call = json.dumps({"name": "spatial_grounding", "arguments": {"objects": "white square", "time": 6}})
    ans, pol = run(square_video, call, ["spatial_grounding"], question="Where is the square?",
                   frames={"max_pixels": 80 * 60})
    (slot,) = ans.trace.turns[0].calls
    (shown,) = images_of(next(m for r, m in pol.calls if r == "tool:spatial_grounding"))
    assert shown[1].shape[:2] != (120, 160)  # the model saw a smaller frame; the box is mapped back
    box = [int(v) for v in re.search(r"square: \[(\d+), (\d+), (\d+), (\d+)\]", slot.summary).groups()]
    assert max(abs(a - b) for a, b in zip(box, [96, 24, 128, 56], strict=True)) <= 4
    sub = next(m for r, m in pol.calls if r == "subagent")
    (_, crop), = images_of(sub)
    assert crop.mean() > 200  # the crop the sub-agent looked at is the white square
    # before second 4 nothing is there
    call = json.dumps({"name": "spatial_grounding", "arguments": {"objects": ["white square"], "time": 1}})
    ans, _ = run(square_video, call, ["spatial_grounding"])
    assert ans.trace.turns[0].calls[0].summary.startswith("No box for white square at 1 seconds (160x120 frame)")


def test_trim_returns_its_frames_to_the_planner_whatever_the_layout(red_video):
    call = json.dumps({"name": "trim", "arguments": {"start_time": 16, "end_time": 20}})
    ans, pol = run(red_video, call, ["trim"])
    (slot,) = ans.trace.turns[0].calls
    ts = slot.frame_timestamps
    assert slot.evidence == "frames" and len(ts) >= 4 and all(16.0 <= t <= 20.0 for t in ts)
    assert [r for r, _ in pol.calls].count("subagent") == 0
    second = pol.calls[-1][1]  # the planner's second turn shows the window's frames themselves
    shown = images_of(second[-1:])
    assert [t for t, _ in shown] == ts
    assert [is_red(im) for _, im in shown] == [17.0 <= t < 20.0 for t in ts]


def test_invalid_tool_arguments_are_the_registrys_errors(red_video):
    call = json.dumps({"name": "spatial_grounding", "arguments": {"objects": [], "time": 99}})
    ans, pol = run(red_video, call, ["spatial_grounding"])
    (slot,) = ans.trace.turns[0].calls
    assert slot.error.startswith("invalid arguments for spatial_grounding")
    assert not any(r.startswith("tool:") for r, _ in pol.calls)


def test_a_tool_may_ask_another_endpoint_recorded_but_never_trained(red_video, json_server):
    """``tool_models`` sends one tool's model calls to another OpenAI-compatible endpoint (a real HTTP server)."""
    done = {"id": "c1", "object": "chat.completion", "created": 0, "model": "grounder",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "[17, 20]"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}
    srv = json_server(lambda path, body: (200, done))
    call = json.dumps({"name": "temporal_grounding", "arguments": {"query": "red", "start_time": 12, "end_time": 28}})
    spec = {"backend": "openai", "model": "grounder", "endpoint": srv.url + "/v1"}
    ans, pol = run(red_video, call, ["temporal_grounding"], tool_models={"temporal_grounding": spec})
    assert not any(r.startswith("tool:") for r, _ in pol.calls)  # the agent's own policy was not asked
    assert srv.paths == ["/v1/chat/completions"] * 2 and {b["model"] for b in srv.bodies} == {"grounder"}
    assert [sum(p.get("type") == "image_url" for m in req["messages"] for p in m["content"]
                if isinstance(m["content"], list)) for req in srv.bodies] == [16, 16]  # one request per crop
    recs = [r for r in ans.records if r.role == "tool:temporal_grounding"]
    assert len(recs) == 2 and not any(r.trainable for r in recs)
    assert "[17, 20]" in ans.trace.turns[0].calls[0].summary


@pytest.mark.parametrize("tool,args", [
    ("temporal_grounding", {"query": "red", "start_time": 12, "end_time": 20}),
    ("frame_selection", {"query": "red", "start_time": 12, "end_time": 16}),
    ("spatial_grounding", {"objects": ["square"], "time": 3}),
])
def test_the_tiny_model_runs_each_tool_and_rl_trains_or_freezes_its_calls(tiny_model, red_video, tool, args):
    """The local backend with the tiny (untrained) model: the planner's call is pinned through the think prefix
    (its tokens are a forced prefix, never trained), the tool asks the model, and every one of its calls comes
    back as a token sequence RL trains (``tool_model_calls: train``) or leaves out (``freeze``)."""
    from paravt_agent.policy.registry import make_policy
    from paravt_train.rl.rollout import assemble

    call = json.dumps({"name": tool, "arguments": args})
    cfg = AgentConfig(tools=[tool], think_prefix=f"<think>\nlook</think>\n<tool_call>{call}</tool_call>",
                      max_turns=1, layout={"final_turn": "none"}, frames={"n_frames": 4, "max_pixels": 32 * 32},
                      planner_sampling={"max_new_tokens": 2}, subagent_sampling={"max_new_tokens": 3},
                      tool_sampling={"max_new_tokens": 3})
    agent = Agent(policy=make_policy("local", model=tiny_model), config=cfg)
    ans = agent.answer(red_video, "When is it red?")
    (slot,) = ans.trace.turns[0].calls
    assert slot.error is None, slot.error
    recs = [r for r in ans.records if r.role == f"tool:{tool}"]
    assert recs and all(r.generation.has_tokens and r.trainable for r in recs)
    assert len(recs) > 1 if tool == "frame_selection" else len(recs) == 1  # one call per frame scored
    eos = agent.policy.eos_id
    seqs, _ = assemble(ans, eos, tool_models=True)
    tool_seqs = [s for s in seqs if s.role == f"tool:{tool}"]
    assert len(tool_seqs) == len(recs)
    for s, r in zip(tool_seqs, recs, strict=True):
        assert s.n_trained == len(r.generation.output_ids) and len(s.images) == len(r.images) >= 1
        assert s.input_ids[-len(r.generation.output_ids):] == r.generation.output_ids
    frozen, _ = assemble(ans, eos, tool_models=False)
    assert [s.role for s in frozen] == [s.role for s in seqs if not s.role.startswith("tool:")]


def test_tool_success_reward_term():
    from paravt_train.rewards import RewardConfig, score

    cfg = RewardConfig(extra_terms={"tool_success": 0.1})
    call = '<tool_call>{"name": "crop_video", "arguments": {"start_time": 1, "end_time": 5}}</tool_call>'
    ok = f"<think>\nlook closer</think>{call}<tool_response>\n[1] crop: red\n</tool_response><think>\nred it is" \
         "</think><answer>A</answer>"
    failed = ok.replace("[1] crop: red", "[1] crop: error: window outside the video")
    wrong = ok.replace("<answer>A</answer>", "<answer>B</answer>")
    no_tool = "<think>\nno need to look</think><answer>A</answer>"
    terms = {name: score(t, "A", "mcq", ["red", "blue"], cfg).extra["tool_success"]
             for name, t in [("ok", ok), ("failed", failed), ("wrong", wrong), ("no_tool", no_tool)]}
    assert terms == {"ok": 1.0, "failed": 0.0, "wrong": 0.0, "no_tool": 0.0}
    assert score(ok, "A", "mcq", ["red", "blue"], cfg).total == pytest.approx(
        score(ok, "A", "mcq", ["red", "blue"], RewardConfig()).total + 0.1)


def test_reply_parsers_take_what_models_write():
    from tools.perception import parse_boxes, parse_confidence

    assert parse_boxes('```json\n[{"bbox_2d": [1, 2, 30, 40], "label": "cup"}]\n```') == (
        [("cup", (1.0, 2.0, 30.0, 40.0))], "json")
    # an empty list before the real one, one bare object, two lists, non-finite values, box tokens (0-1000)
    assert parse_boxes('none: [] but then [{"bbox_2d": [5, 5, 9, 9]}]')[0] == [("", (5.0, 5.0, 9.0, 9.0))]
    assert parse_boxes('{"bbox_2d": [1, 1, 4, 4], "label": "a"}')[0] == [("a", (1.0, 1.0, 4.0, 4.0))]
    assert parse_boxes('[{"bbox_2d": [1, 1, 2, 2]}] and [{"bbox_2d": [3, 3, 4, 4]}]')[0] == [("", (1, 1, 2, 2))]
    assert parse_boxes('[{"bbox_2d": [NaN, 1, Infinity, 2]}]') == ([], "tokens")
    assert parse_boxes("<|object_ref_start|>cup<|object_ref_end|><|box_start|>(100,200),(300,400)<|box_end|>") == (
        [("cup", (100.0, 200.0, 300.0, 400.0))], "tokens")
    assert [parse_confidence(t) for t in ("0.9", "8", "85%", "yes", "no", "frame at 12.0 seconds: 0.9",
                                          "#3, confidence: 0.7", "<think>1</think>0.2", "")] == \
        [0.9, 0.8, 0.85, 1.0, 0.0, 0.9, 0.7, 0.2, 0.0]


def test_boxes_in_relative_coordinates_and_spans_outside_the_window(square_video, red_video):
    """A Qwen3-VL-style model (0-1000 boxes: `box_coordinates: relative-1000`) is asked and read in its own terms;
    a span outside the searched window is no finding; a frame selection where no frame scores is none."""

    def script(role, msgs):
        if role == "tool:spatial_grounding":
            assert "from 0 to 1000" in text_of(msgs[-1]["content"])
            return '[{"bbox_2d": [600, 200, 800, 467], "label": "square"}]'  # x 96-128, y 24-56 of 160x120
        if role == "tool:temporal_grounding":
            return "[30, 35]"
        if role == "tool:frame_selection":
            return "0"
        if role == "subagent":
            return "seen"
        last = text_of(msgs[-1]["content"])
        if "<tool_response>" in last:
            return "<think>\nok</think><answer>" + last.split("\n", 1)[1].split("</tool_response>")[0] + "</answer>"
        return "<think>\nlook</think>" + CALL

    cfg = dict(tools=["spatial_grounding", "temporal_grounding", "frame_selection"], box_coordinates="relative-1000")
    CALL = '<tool_call>{"name": "spatial_grounding", "arguments": {"objects": ["square"], "time": 6}}</tool_call>'
    ans = Agent(policy=ScriptedPolicy(script), config=AgentConfig(**cfg)).answer(square_video, "Where?")
    assert "square: [96, 24, 128, 56]" in ans.trace.turns[0].calls[0].summary
    CALL = ('<tool_call>{"name": "temporal_grounding", "arguments": {"query": "red", "start_time": 10, '
            '"end_time": 20}}</tool_call><tool_call>{"name": "frame_selection", "arguments": {"query": "red", '
            '"start_time": 10, "end_time": 14}}</tool_call>')
    ans = Agent(policy=ScriptedPolicy(script), config=AgentConfig(**cfg)).answer(red_video, "When?")
    grounding, selection = ans.trace.turns[0].calls
    assert grounding.summary == "'red': not found between 00:10 and 00:20."
    assert selection.summary == "No frame shows 'red' between 00:10 and 00:14." and selection.evidence == "text"


def test_a_tool_failing_after_its_model_calls_keeps_them(red_video):
    """A model-backed tool that asked its model and then refused the call: the slot is the model's error (not the
    runtime's: RL scores the episode) and the model call is still recorded."""
    from paravt_agent.errors import ToolError
    from tools import ToolRegistry
    from tools.perception import QueryWindowArgs, TemporalGrounding

    class Picky(TemporalGrounding):
        name = "picky"

        async def run(self, args: QueryWindowArgs, ctx):
            await ctx.model.ask([{"role": "user", "content": "is it there?"}])
            raise ToolError("the model said the query makes no sense")

    def script(role, msgs):
        if role == "tool:picky":
            return "no"
        if "<tool_response>" in text_of(msgs[-1]["content"]):
            return "<think>\nfine</think><answer>A</answer>"
        return '<think>\nlook</think><tool_call>{"name": "picky", "arguments": {"query": "x"}}</tool_call>'

    reg = ToolRegistry([Picky()])
    ans = Agent(policy=ScriptedPolicy(script), tools=reg, config=AgentConfig(tools=["picky"])).answer(red_video, "Q?")
    (slot,) = ans.trace.turns[0].calls
    assert slot.error == "the model said the query makes no sense" and not slot.runtime_error
    assert [r.role for r in ans.records].count("tool:picky") == 1 and ans.trace.run_errors == []


def test_sft_teaches_the_tiny_model_frame_selection(tmp_path, red_video):
    """Trainable like crop_video: SFT rows in the tool's own prompt (a crop's labelled frame alone, `head: false`)
    teach a tiny model to score frames; then `frame_selection` through the graph, asking that model, picks a red
    frame of a video it never saw."""
    from paravt_agent.policy.registry import make_policy
    from paravt_train.data import write_parquet
    from paravt_train.sft import train
    from paravt_train.sft.config import SFTConfig
    from paravt_train.toy.render import write_segments
    from paravt_train.toy.tiny import build_tiny_model
    from tools.perception import SELECTION_PROMPT

    colours = [(220, 30, 30), (20, 40, 200), (30, 180, 60), (230, 220, 40)]
    prompt = SELECTION_PROMPT.format(query="a red screen")
    rows = []
    for v in range(6):
        write_segments(tmp_path / f"v{v}.mp4", [(colours[(v + i) % 4], 1.0) for i in range(8)], fps=4, width=32,
                       height=32)
        for t in range(8):
            rows.append({"id": f"{v}-{t}", "messages": [
                {"role": "user", "content": [{"type": "video", "video": f"v{v}.mp4", "start": t, "end": t + 0.5,
                                              "head": False}, {"type": "text", "text": prompt}]},
                {"role": "assistant", "content": "1" if (v + t) % 4 == 0 else "0"}]})
    write_parquet(rows, tmp_path / "sft.parquet")
    frames = {"max_pixels": 1024, "factor": 32, "crop_fps": 1.0}
    base = build_tiny_model(tmp_path / "base", [prompt, "0", "1"] * 4, size="test")
    train(SFTConfig(model=str(base), data=str(tmp_path / "sft.parquet"), video_root=str(tmp_path),
                    output_dir=str(tmp_path / "sft"), lr=3e-3, batch_size=8, micro_batch_size=8, max_steps=60,
                    warmup_ratio=0.0, save_every=0, frames=frames, seed=0), progress=False)
    call = json.dumps({"name": "frame_selection", "arguments": {"query": "a red screen", "start_time": 10,
                                                                "end_time": 26}})
    cfg = AgentConfig(tools=["frame_selection"], think_prefix=f"<think>\nlook</think>\n<tool_call>{call}</tool_call>",
                      max_turns=1, layout={"final_turn": "none"}, frames={**frames, "n_frames": 4},
                      planner_sampling={"max_new_tokens": 1}, subagent_sampling={"max_new_tokens": 1},
                      tool_sampling={"max_new_tokens": 4})
    ans = Agent(policy=make_policy("local", model=str(tmp_path / "sft" / "final")), config=cfg).answer(
        red_video, "When is it red?")
    (slot,) = ans.trace.turns[0].calls
    (t,) = slot.frame_timestamps
    assert 17.0 <= t < 20.0, slot.summary  # the model's scores found the red frame
    replies = [r.generation.text.strip() for r in ans.records if r.role == "tool:frame_selection"]
    assert len(replies) == 16 and set(replies) <= {"0", "1"} and replies.count("1") == 3  # 17, 18, 19: red


# --------------------------------------------------------------------------- Weaver's other tools and its preset


@pytest.fixture(scope="module")
def twice_red_video(tmp_path_factory):
    """40 s at 10 fps, 64x48: blue, red on [5, 8) and again on [25, 28)."""
    from paravt_train.toy.render import write_segments

    blue, red = (20, 40, 200), (220, 30, 30)
    return write_segments(tmp_path_factory.mktemp("twice") / "twice.mp4",
                          [(blue, 5.0), (red, 3.0), (blue, 17.0), (red, 3.0), (blue, 12.0)], fps=10, width=64,
                          height=48, gop=10)


@pytest.fixture(scope="module")
def moving_video(tmp_path_factory):
    """10 s at 5 fps, 160x120 black; from second 2 a white 24x24 square moving right 3 px a frame from x 20."""
    d = tmp_path_factory.mktemp("moving")

    def frame(i):
        img = np.zeros((120, 160, 3), np.uint8)
        if i >= 10:
            x = 20 + 3 * (i - 10)
            img[40:64, x:x + 24] = 255
        return img

    return write_video(d / "moving.mp4", 50, frame, fps=5, width=160, height=120, gop=5)


def test_temporal_count_splices_the_crops_where_the_event_occurs(twice_red_video):
    """The window is cut into crops (8 s at the default 2 fps); the model says whether each shows red; the two that
    do come back spliced, their frames, for the planner to count in."""

    def script(role, msgs):
        if role == "tool:temporal_count":
            return "yes" if any(is_red(im) for _, im in images_of(msgs)) else "no"
        if role == "subagent":
            shown = images_of(msgs)
            runs = sum(1 for k, (_, im) in enumerate(shown) if is_red(im) and (k == 0 or not is_red(shown[k - 1][1])))
            return f"{runs} red stretches"
        last = text_of(msgs[-1]["content"])
        if "<tool_response>" in last:
            n = re.search(r"(\d) red stretches", last).group(1)
            return f"<think>\ncounted</think><answer>{n}</answer>"
        return '<think>\ncount</think><tool_call>{"tool_name": "temporal_count", "query": "a red screen"}</tool_call>'

    pol = ScriptedPolicy(script)
    ans = Agent(policy=pol, config=AgentConfig(tools=["temporal_count"])).answer(twice_red_video, "How often red?")
    (slot,) = ans.trace.turns[0].calls
    assert "'a red screen' occurs in 2 of 5 clips between 00:00 and 00:40: [0, 7.5], [24, 31.5]" in slot.summary
    assert [r.role for r in ans.records].count("tool:temporal_count") == 5  # one judgement per crop
    assert all(0 <= t <= 7.5 or 24 <= t <= 31.5 for t in slot.frame_timestamps) and len(slot.frame_timestamps) == 32
    assert ans.text == "2"  # the spliced clip holds both red stretches


def box_script(question_call, answer="<think>\ndone</think><answer>{slot}</answer>"):
    def script(role, msgs):
        if role in ("tool:spatial_tracking", "tool:spatial_grounding"):
            (_, im), = images_of(msgs)
            ys, xs = np.nonzero(im.mean(-1) > 200)
            return "[]" if not len(xs) else json.dumps([{"bbox_2d": [int(xs.min()), int(ys.min()),
                                                                      int(xs.max()) + 1, int(ys.max()) + 1],
                                                         "label": "square"}])
        last = text_of(msgs[-1]["content"])
        if "<tool_response>" in last:
            return answer.format(slot=last.split("</tool_response>")[0].split("\n", 1)[1].strip())
        return f"<think>\ntrack it</think><tool_call>{question_call}</tool_call>"

    return script


def test_spatial_tracking_follows_the_object_and_draws_its_boxes(moving_video):
    """The model boxes the square in the first frame that shows it (it is asked about up to 4 frames), the tracker
    follows the box, and the clip comes back with the boxes drawn (under layout evidence: frames, to the planner)."""
    call = json.dumps({"name": "spatial_tracking", "arguments": {"objects": ["white square"], "start_time": 0,
                                                                "end_time": 9}})
    pol = ScriptedPolicy(box_script(call))
    cfg = AgentConfig(tools=["spatial_tracking"], layout={"evidence": "frames"}, frames={"max_pixels": 160 * 120,
                                                                                        "crop_fps": 1.0})
    ans = Agent(policy=pol, config=cfg).answer(moving_video, "Where does the square go?")
    (slot,) = ans.trace.turns[0].calls
    asked = [r for r in ans.records if r.role == "tool:spatial_tracking"]
    assert 2 <= len(asked) <= 4  # the first frames show nothing, a later one the square
    m = re.search(r"square: \[(\d+), (\d+), (\d+), (\d+)\] at ([\d.]+)s -> \[(\d+), (\d+), (\d+), (\d+)\] at 9s",
                  slot.summary)
    assert m, slot.summary
    x1_end, t_first = int(m.group(6)), float(m.group(5))
    assert abs(x1_end - (20 + 3 * 35)) <= 3  # at 9 s (frame 45) the square's left edge is at 125
    assert abs(int(m.group(1)) - (20 + 3 * (5 * t_first - 10))) <= 3
    frames = images_of(pol.calls[-1][1][-1:])  # the planner's second turn shows the tracked clip
    assert len(frames) == len(slot.frame_timestamps) == 10
    late = frames[-1][1]
    assert (late[38:66, :, 1] == 255).any() and (late[38:66, :, 0] == 0).any()  # the green box around the square


def test_the_weaver_preset_runs_its_tool_loop_with_frames_in_the_context(red_video):
    """Weaver's protocol: its system prompt, its flat tool calls, one call per turn, the tools' frames in the
    planner's context (the trimmed window, the grounded clip), at most 10 responses."""
    from paravt_agent.protocol.presets import WEAVER_SYSTEM_PROMPT, WEAVER_TOOLS

    turns = ['<think>\nground it</think><tool_call>{"tool_name": "temporal_grounding", "query": "red"}</tool_call>',
             '<think>\nlook</think><tool_call>{"tool_name": "trim", "start": 16, "end": 21}</tool_call>',
             "<think>\nred from 17</think><answer>[17, 20]</answer>"]

    def script(role, msgs):
        if role == "tool:temporal_grounding":
            shown = images_of(msgs)
            red = [t for t, im in shown if is_red(im)]
            return f"[{red[0]:g}, {red[-1] + 1:g}]" if red else "none"
        return turns[sum(1 for m in msgs if m["role"] == "assistant")]

    pol = ScriptedPolicy(script)
    cfg = AgentConfig(preset="weaver", frames={"n_frames": 16, "max_pixels": 64 * 48})
    assert cfg.tools == WEAVER_TOOLS and cfg.mode == "sequential" and cfg.layout.evidence == "frames"
    ans = Agent(policy=pol, config=cfg).answer(red_video, "When is the screen red?")
    assert ans.span == (17.0, 20.0)
    last = pol.calls[-1][1]
    assert last[0]["content"] == WEAVER_SYSTEM_PROMPT
    shown = [t for m in last[2:] if not isinstance(m["content"], str) for p in m["content"]
             if p.get("type") == "image" for t in [p["timestamp"]]]
    assert any(17 <= t < 20 for t in shown) and any(16 <= t <= 21 for t in shown[-5:])  # both tools' frames
    forever = ScriptedPolicy(lambda role, msgs: "<think>\nagain</think><tool_call>{\"tool_name\": \"trim\", "
                             "\"start\": 1, \"end\": 2}</tool_call>")
    looped = Agent(policy=forever, config=cfg).answer(red_video, "When?")
    assert len(looped.trace.turns) == 10 and looped.trace.tool_calls == 9  # Table 7: 10 conversation turns


def test_weavers_reward_is_configurable_and_frozen_tools():
    """R = 0.7 R_corr + 0.2 R_format + 0.1 R_tool (R_tool only with a tool call that worked and a right answer), as
    the weaver method sets it, with the tools' model calls frozen."""
    from paravt_train.rewards import score
    from paravt_train.rl.config import GRPOConfig

    cfg = GRPOConfig(model="m", method="weaver")
    r = cfg.reward
    assert (r.acc_weight, r.lambda_fmt, r.tool_bonus, r.format_reward, r.tool_reward, r.reward_bias) == (
        0.7, 0.2, 0.1, "answer", "success", 0.0)
    assert cfg.tool_model_calls == "freeze" and cfg.kl_coef == 1e-3
    call = '<tool_call>{"tool_name": "trim", "start": 1, "end": 5}</tool_call>'
    used = f"<think>\nlook</think>{call}<tool_response>\n[1] trim: 4 frames\n</tool_response>"
    cases = {"tool, right": (used + "<answer>A</answer>", 1), "tool, wrong": (used + "<answer>B</answer>", 1),
             "no tool, right": ("<answer>A</answer>", 0), "tool failed, right": (used + "<answer>A</answer>", 0),
             "no answer tags": ("A", 0)}
    got = {k: score(t, "A", "mcq", ["red", "blue"], r, tools_worked=w).total for k, (t, w) in cases.items()}
    assert got == pytest.approx({"tool, right": 1.0, "tool, wrong": 0.2, "no tool, right": 0.9,
                                 "tool failed, right": 0.9, "no answer tags": 0.7})
    assert r.max_format == 1.0 and r.min_total == 0.0


@pytest.mark.parametrize("kl_coef", [1e-3, 0.0], ids=["kl-reference-reused", "own-copy"])
def test_frozen_tools_answer_from_the_starting_weights_after_an_update(tiny_model, tmp_path, kl_coef):
    """Weaver's frozen tools are frozen models: under ``tool_model_calls: freeze`` the model-backed tools ask the
    starting weights (the KL reference when the run has one, else their own copy), so one real optimizer step at a
    high learning rate changes the policy's greedy answer and leaves the tool's answer as it was; its calls are
    never the trained policy's."""
    import dataclasses

    import torch

    from paravt_agent.graph.runtime import ToolSession
    from paravt_agent.types import Sampling
    from paravt_train.rl.config import GRPOConfig
    from paravt_train.rl.trainer import GRPOTrainer

    cfg = GRPOConfig(model=tiny_model, method="weaver", output_dir=str(tmp_path / "run"), kl_coef=kl_coef, lr=0.03,
                     seed=0, gating=False)
    tr = GRPOTrainer(cfg, progress=False)
    tr.setup()
    assert tr.agent.tool_policy is not None and not tr.agent.tool_policy.generates_with(tr.model)
    assert (tr.agent.tool_policy.model is tr.ref) == (kl_coef > 0)
    greedy = Sampling(temperature=0.0, max_new_tokens=8)
    ctx = tr.agent.context()
    ctx = dataclasses.replace(ctx, config=ctx.config.model_copy(update={"tool_sampling": greedy}))
    question = [{"role": "user", "content": "When is the screen red? Answer with a span of seconds."}]

    def answers():
        async def both():
            session = ToolSession(ctx, "temporal_grounding", turn=0, index=0, seed=None)
            await session.ask(question)
            (rec,) = session.records
            tool = (rec.generation.output_ids, rec.generation.logprobs)
            live = await tr.agent.policy.generate(question, greedy, role="planner")
            return tool, live, session.records

        tr.model.eval()
        return tr.agent.run(both())

    tool_before, live, recs = answers()
    live_before = live.output_ids
    assert not any(r.trainable for r in recs)  # recorded, never in the loss
    assert tool_before[0] == live_before  # the same weights so far: the same greedy reply
    tr.model.train()  # one real optimizer step on the live policy: towards a reply it did not write
    other = next(t for t in (300, 600) if t not in live_before)
    prompt = list(live.prompt_ids)
    ids = torch.tensor([prompt + [other] * 4], device=tr.device)
    labels = torch.tensor([[-100] * len(prompt) + [other] * 4], device=tr.device)
    tr.model(input_ids=ids, labels=labels).loss.backward()
    tr.optimizer.step()
    tr.optimizer.zero_grad()
    tool_after, live_after, _ = answers()
    assert live_after.output_ids != live_before  # the update changed the policy's answer
    assert tool_after == tool_before  # the tool's did not change, token for token and logprob for logprob


def test_frozen_tools_on_a_server_ask_the_starting_weights_or_a_named_server(tiny_model, tmp_path):
    """On a served policy: a LoRA run's tools ask the same server without the adapter (its base model is the
    starting weights); full fine-tuning overwrites the served weights, so the run refuses until a second server is
    named for the tools (tool_models) or the tools' calls train."""
    from types import SimpleNamespace

    from paravt_agent.errors import ConfigError
    from paravt_agent.policy.registry import make_rollout_policy
    from paravt_train.rl.config import GRPOConfig
    from paravt_train.rl.frozen_tools import frozen_tool_policy, unnamed_model_tools

    url = "http://127.0.0.1:9"  # nothing is asked: the choice is made before any request

    def trainer(adapter, **kw):
        cfg = GRPOConfig(model=tiny_model, method="weaver", backend="sglang", endpoint=url, **kw)
        served = make_rollout_policy("sglang", tiny_model, url, lora=adapter)
        agent = Agent(policy=served, config=AgentConfig(preset="weaver", **cfg.agent))
        return SimpleNamespace(cfg=cfg, model=object(), ref=None, syncer=SimpleNamespace(adapter_name=adapter)), agent

    tr, agent = trainer("policy", lora={"enabled": True}, sync={"via": "lora"})
    tools = unnamed_model_tools(agent)
    assert {"temporal_grounding", "frame_selection", "spatial_grounding"} <= set(tools)
    frozen = frozen_tool_policy(tr, agent)
    assert frozen.url == agent.policy.url == url and agent.policy.lora == "policy" and frozen.lora is None
    tr, agent = trainer(None)
    with pytest.raises(ConfigError, match="second server"):
        frozen_tool_policy(tr, agent)
    named = {t: {"backend": "sglang", "model": tiny_model, "endpoint": "http://127.0.0.1:30001"} for t in tools}
    tr, agent = trainer(None, agent={"tool_models": named})
    assert frozen_tool_policy(tr, agent) is None and not unnamed_model_tools(agent)
    tr, agent = trainer(None, tool_model_calls="train")  # the tools' calls train: they ask the live policy
    assert frozen_tool_policy(tr, agent) is None
