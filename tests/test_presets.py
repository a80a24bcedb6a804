"""Protocol presets: each renders the conversation its source produced, message by message.

The expected texts below are copied from the released sources named in each test (ParaVT's
``paravt/eval/driver.py`` and ``paravt/rl/workflow.py`` + ``paravt/rl/subagents``, LongVT's
``examples/eval/single_inference.py``), not from ``paravt_agent.protocol.presets``: a change to a preset that
departs from its source fails here.
"""

import re

import pytest

from paravt_agent.agent import Agent
from paravt_agent.config import AgentConfig, describe_differences, protocol_differences, resolve_agent_config
from paravt_agent.policy.base import text_of
from paravt_agent.policy.scripted import ScriptedPolicy
from paravt_train.toy.render import write_segments

PAPER_PROMPT_HEAD = "You are a video understanding agent.\n\n# Workflow\n1. Think inside <think>...</think>"

EVAL_TOOL = ('{"type": "function", "function": {"name": "crop_video", "description": "Analyze a cropped video '
             'segment by sampling frames from a specific time range.", "parameters": {"type": "object", '
             '"properties": {"video_path": {"type": "string", "description": "Path to the video file"}, '
             '"start_time": {"type": "number", "description": "Start time in seconds"}, "end_time": {"type": '
             '"number", "description": "End time in seconds"}}, "required": ["video_path", "start_time", '
             '"end_time"]}}}')

EVAL_SYSTEM = f"""You are a video understanding agent that can analyze videos by cropping and examining specific \
segments.

Available tool:
<tools>
{EVAL_TOOL}
</tools>

For tool calls, return a JSON object within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": "crop_video", "arguments": {{"video_path": "...", "start_time": 0, "end_time": 10}}}}
</tool_call>

You may emit **multiple <tool_call> blocks in one turn** to analyze different segments in parallel — this is more \
efficient than sequential calls and is the recommended dispatch shape for this agent.

Format strictly as:
<think>your reasoning here</think>
<tool_call>...</tool_call>  (zero or more, parallel if multiple)
<answer>your final answer</answer>

Always wrap your reasoning in <think> tags and your final answer in <answer> tags."""

RL_TOOL = ('{"type": "function", "function": {"name": "crop_video", "description": "Analyze a cropped video '
           'segment by sampling fixed number of frames and providing a summary of the content. Use this when you '
           'need to understand what happens in a specific time range of a video.", "parameters": {"video_path": '
           '{"type": "string", "description": "Path to the video file"}, "start_time": {"type": "number", '
           '"description": "Start time in seconds"}, "end_time": {"type": "number", "description": "End time in '
           'seconds"}}}}')

LONGVT_TOOL = ('{"type": "function", "function": {"name": "crop_video", "description": "Crop a video to a '
               'specified duration. Use this tool to zoom in on specific time segments for detailed analysis.", '
               '"parameters": {"type": "object", "properties": {"video_path": {"type": "string", "description": '
               '"Path to the video file"}, "start_time": {"type": "number", "description": "Start time in '
               'seconds"}, "end_time": {"type": "number", "description": "End time in seconds"}}, "required": '
               '["video_path", "start_time", "end_time"]}}}')


def hermes(tools: str) -> str:
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{tools}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


SUBAGENT_PROMPT = """You are analyzing a video segment from 01:00 to 01:10 (duration: 10.0 seconds).

The images shown are frames sampled from this video segment. Carefully examine each frame in sequence to understand \
the temporal progression of events.

Your task: Provide a concise summary of what happens in this video segment.

Guidelines:
- Describe the key actions, events, or changes that occur across the frames
- Note any important objects, people, or elements visible in the scene
- Capture the temporal flow (what happens first, then, finally)
- Focus on factual observations rather than interpretations

Summary:"""

CALL = ('<tool_call>\n{{"name": "crop_video", "arguments": {{"video_path": "long.mp4", "start_time": {a}, '
        '"end_time": {b}}}}}\n</tool_call>')


@pytest.fixture(scope="module")
def long_video(tmp_path_factory):
    """80 s, a new colour every 5 s: long enough for a 64-frame overview at 1 fps."""
    d = tmp_path_factory.mktemp("presets")
    colours = [(200, 40, 40), (40, 200, 40), (40, 40, 200), (200, 200, 40)]
    return write_segments(d / "long.mp4", [(colours[i % 4], 5.0) for i in range(16)], fps=4, width=64, height=48)


class Recording(ScriptedPolicy):
    """A scripted policy that also records each call's sampling and pinned prefix."""

    def __init__(self, script):
        super().__init__(script)
        self.settings = []

    async def generate(self, messages, sampling, prefix="", continuation=None, role="planner"):
        self.settings.append((sampling, prefix))
        return await super().generate(messages, sampling, prefix, continuation, role=role)


def planner_turn(msgs) -> int:
    return sum(1 for m in msgs if m["role"] == "assistant")


def kinds(content) -> list[str]:
    return [p["type"] for p in content] if not isinstance(content, str) else ["text"]


def run(preset: str, script, video, question="What colour comes first?", options=("red", "green"), **cfg):
    pol = Recording(script)
    agent = Agent(policy=pol, config=AgentConfig(preset=preset, **cfg))
    ans = agent.answer(video, question, list(options) if options else None)
    return pol, ans


def test_paravt_eval_renders_the_released_driver_conversation(long_video):
    """paravt/eval/driver.py, --prompt_mode agentic_general --max_turns 3 --max_parallel 5 --main_nframes 64."""
    windows = {0: [(0, 10), (10, 20), (20, 30), (30, 40), (40, 50), (50, 60)], 1: [(60, 70)], 2: [(70, 80)]}

    def script(role, msgs):
        assert role == "planner"  # no sub-agent in this protocol
        t = planner_turn(msgs)
        if t in windows:
            return "<think>look</think>\n" + "\n".join(CALL.format(a=a, b=b) for a, b in windows[t])
        return "B"

    pol, ans = run("paravt-eval", script, long_video)
    msgs = ans.messages
    assert msgs[0] == {"role": "system", "content": EVAL_SYSTEM}
    user = msgs[1]["content"]
    assert kinds(user) == ["image"] * 64 + ["text"]  # 64 frames, no time labels
    assert user[-1]["text"] == ("Question: What colour comes first?\nOptions:\nA. red\nB. green\n"
                                "Answer with the option letter only. The video path for this video is: long.mp4")
    # turn 0: six calls, five run (the sixth dropped without a trace), one user message each
    i = 3
    for a, b in windows[0][:5]:
        m = msgs[i]
        assert m["role"] == "user" and kinds(m["content"])[-1] == "text"
        n = kinds(m["content"]).count("image")
        assert 1 <= n <= 16
        assert m["content"][-1]["text"] == f"<tool_response>\n{n} frames from {a:.1f}s to {b:.1f}s.\n</tool_response>"
        i += 1
    assert msgs[i]["role"] == "assistant" and "60, \"end_time\": 70" in msgs[i]["content"]
    assert msgs[i + 1]["content"][-1]["text"].startswith("<tool_response>\n")
    assert msgs[i + 2]["role"] == "assistant"
    tail = msgs[i + 3:]
    # after the third tool turn: the forced letter question, then the final response
    assert [m["role"] for m in tail] == ["user", "user", "assistant"]
    assert tail[1]["content"] == "Based on the video and cropped segments above, answer with ONLY the letter."
    assert tail[2]["content"] == "B" and ans.choice == "B"
    assert ans.trace.tool_calls == 7 and ans.trace.turns[-1].forced_final
    # greedy, 2048 tokens per turn, 64 for the forced letter; no think prefix anywhere
    assert [s.max_new_tokens for s, _ in pol.settings] == [2048, 2048, 2048, 64]
    assert all(s.temperature == 0 and p == "" for s, p in pol.settings)
    assert all(c.evidence == "frames" for t in ans.trace.turns for c in t.calls)


def test_paravt_eval_grounding_forced_turn_asks_for_the_span(long_video):
    def script(role, msgs):
        t = planner_turn(msgs)
        return CALL.format(a=10 * t, b=10 * t + 10) if t < 3 else "The event happens in the 10.0 - 20.0 seconds."

    pol, ans = run("paravt-eval", script, long_video, question="the person opens the door", options=None)
    assert ans.messages[-2]["content"] == (
        "Based on the video and any cropped segments, provide your final answer about when the event happens. "
        "Use the format: 'The event happens in the X.X - Y.Y seconds.'")
    assert pol.settings[-1][0].max_new_tokens == 128
    assert ans.span == (10.0, 20.0)


def test_paravt_rl_renders_the_released_workflow_conversation(long_video):
    """paravt/rl/workflow.py + subagents/crop_video: Hermes tools block, labelled frames, one message per call."""

    def script(role, msgs):
        if role == "subagent":
            return f"summary {len(msgs[0]['content'])}"
        t = planner_turn(msgs)
        calls = [(60, 70), (20, 30)] if t == 0 else [(10 * t, 10 * t + 5)]
        return "\n".join(CALL.format(a=a, b=b) for a, b in calls) + "</think>"  # always calls: the bound ends it

    pol, ans = run("paravt-rl", script, long_video)
    msgs = ans.messages
    assert msgs[0]["content"].startswith(PAPER_PROMPT_HEAD)
    assert msgs[0]["content"].endswith("- Do NOT call the same temporal window twice.\n\n" + hermes(RL_TOOL))
    user = msgs[1]["content"]
    assert kinds(user) == ["text", "image"] * 64 + ["text"]  # "<t.1f seconds>" before each frame, no intro line
    assert [p["text"] for p in user[:-1:2]] == [f"<{t:.1f} seconds>" for t in ans.trace.overview_timestamps]
    assert user[0]["text"] == "<0.0 seconds>"
    assert user[-1]["text"] == "Question: What colour comes first?\nOptions:\nA. red\nB. green\n" \
                               "Answer with the option's letter."
    # the sub-agent: no system prompt, unlabelled frames, the released prompt, never the question
    subs = [m for r, m in pol.calls if r == "subagent"]
    first = next(m for m in subs if "01:00 to 01:10" in text_of(m[0]["content"]))
    assert len(first) == 1 and first[0]["role"] == "user"
    parts = first[0]["content"]
    assert kinds(parts) == ["image"] * (len(parts) - 1) + ["text"] and parts[-1]["text"] == SUBAGENT_PROMPT
    assert len(parts) - 1 == 11  # 1 fps over 10 s, both ends (qwen-vl-utils takes 10: docs/presets.md)
    # each result its own user message, in call order
    assert msgs[3]["content"] == f"<tool_response>\nsummary {len(parts)}\n</tool_response>"
    assert msgs[4]["content"].startswith("<tool_response>\nsummary ")
    assert msgs[5]["role"] == "assistant"
    # max_turns 3: four planner responses, tools after the first three, no forced final turn
    planner = [m for m in msgs if m["role"] == "assistant"]
    assert len(planner) == 4 and not any(t.forced_final for t in ans.trace.turns)
    assert msgs[-1]["role"] == "assistant" and ans.trace.tool_calls == 4  # the last response's call ends it
    assert all(p == "<think>\n" for _, p in pol.settings if _.max_new_tokens != 512)
    assert {s.max_new_tokens for (s, _), (r, _m) in zip(pol.settings, pol.calls, strict=True)
            if r == "subagent"} == {512}


def test_longvt_renders_hermes_tool_turns_with_frames(long_video):
    """LongVT examples/eval/single_inference.py: tools via the API, frames back, no labels, no system text."""

    def script(role, msgs):
        return CALL.format(a=10, b=20) if planner_turn(msgs) == 0 else "<think>seen</think><answer>A</answer>"

    pol, ans = run("longvt", script, long_video, question="What colour comes first? Options: A. red B. green",
                   options=None)
    msgs = ans.messages
    assert msgs[0] == {"role": "system", "content": hermes(LONGVT_TOOL)}
    user = msgs[1]["content"]
    assert kinds(user) == ["image"] * 80 + ["text"]  # the whole video at 1 fps
    assert user[-1]["text"] == (
        "Question: What colour comes first? Options: A. red B. green Think first, call **crop_video** if needed, "
        "then answer. Format strictly as: <think>...</think> <tool_call>...</tool_call> (if needed) "
        "<answer>...</answer>.")
    tool = msgs[3]["content"]
    n = kinds(tool).count("image")
    assert kinds(tool) == ["text"] + ["image"] * n + ["text"] and n == 11
    assert tool[0]["text"] == "<tool_response>\n"
    assert tool[-1]["text"] == f"Cropped 10s-20s, got {n} frames.\n</tool_response>"
    assert ans.choice is None and ans.text == "A"
    assert [s.max_new_tokens for s, _ in pol.settings] == [4096, 4096]


def test_default_preset_is_this_projects_layout(long_video):
    """preset paravt = the defaults: the paper's prompt with a '# Tools' block, intro line, ONE tool turn."""
    assert AgentConfig() == AgentConfig(preset="paravt")

    def script(role, msgs):
        if role == "subagent":
            return "a summary"
        return CALL.format(a=0, b=10) + CALL.format(a=10, b=20) if planner_turn(msgs) == 0 else "<answer>A</answer>"

    pol, ans = run("paravt", script, long_video)
    msgs = ans.messages
    assert msgs[0]["content"].startswith(PAPER_PROMPT_HEAD) and "\n\n# Tools\n<tools>\n" in msgs[0]["content"]
    assert msgs[1]["content"][0]["text"].startswith("Video: long.mp4, duration 80.0 seconds (01:20).")
    assert msgs[3]["content"] == ("<tool_response>\n[1] crop_video(00:00-00:10): a summary\n"
                                  "[2] crop_video(00:10-00:20): a summary\n</tool_response>")
    sub = next(m for r, m in pol.calls if r == "subagent")
    assert sub[0]["role"] == "system" and "Question: What colour comes first?" in text_of(sub[1]["content"])


def test_frames_mode_in_one_turn_layout(long_video):
    def script(role, msgs):
        assert role == "planner"
        return CALL.format(a=0, b=10) + CALL.format(a=90, b=99) if planner_turn(msgs) == 0 else "<answer>A</answer>"

    pol, ans = run("paravt", script, long_video, layout={"evidence": "frames"})
    tool = ans.messages[3]["content"]
    texts = [p["text"] for p in tool if p["type"] == "text" and not p["text"].startswith("<")]
    assert texts[0].startswith("\n[1] crop_video(00:00-00:10): ")
    assert re.match(r"\n\[1\] crop_video\(00:00-00:10\): (\d+) frames from 0\.0s to 10\.0s\.", texts[0])
    assert texts[1].startswith("\n[2] crop_video: error: invalid call of crop_video: start_time 90s is beyond")
    n = kinds(tool).count("image")
    assert n == int(re.search(r"(\d+) frames", texts[0]).group(1)) == 16  # crop_fps 2: 21 -> at most 16
    assert ans.trace.turns[0].calls[0].evidence == "frames" and all(r == "planner" for r, _ in pol.calls)
    # the planner's next request carries the crop's frames after the overview's
    assert len(ans.records[1].images) == 64 + n


def test_preset_from_yaml_cli_and_model_directory(tmp_path, long_video):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "agent_config.yaml").write_text("preset: paravt-eval\nmax_turns: 2\n")
    cfg = AgentConfig.for_model(tmp_path / "m")
    assert cfg.layout.evidence == "frames" and cfg.max_turns == 2 and cfg.frames.n_frames == 64
    notes = []
    used = resolve_agent_config(None, tmp_path / "m", ["layout.evidence=summary"], notes=notes)
    assert used.layout.evidence == "summary" and used.layout.system == "paravt-eval"
    assert len(notes) == 1 and "paravt-eval" in notes[0] and "layout.evidence: 'frames' -> 'summary'" in notes[0]
    notes = []
    resolve_agent_config(None, tmp_path / "m", ["max_concurrency=2"], notes=notes)
    assert notes == []  # runtime settings are not the protocol
    other = resolve_agent_config(None, tmp_path / "m", preset="paravt-rl", notes=(notes := []))
    assert other.layout.tool_response == "per_call" and "... and " in notes[0]
    assert ("max_turns", 2, 3) in protocol_differences(AgentConfig.for_model(tmp_path / "m"), other)
    assert describe_differences(AgentConfig(), AgentConfig(preset="paravt")) is None
    with pytest.raises(Exception, match="unknown preset"):
        AgentConfig(preset="paravt-9000")
    dumped = AgentConfig(preset="longvt").to_yaml()
    assert AgentConfig.model_validate(__import__("yaml").safe_load(dumped)) == AgentConfig(preset="longvt")


def test_presets_are_documented():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "presets.md").read_text()
    from paravt_agent.protocol.presets import PRESETS

    for name in PRESETS:
        assert f"`{name}`" in doc


def test_cli_names_what_departs_from_the_models_protocol(toy_policy_dir, media):
    """`paravt answer --preset X` on a model trained with another protocol says what differs, and still runs."""
    from typer.testing import CliRunner

    from paravt_agent.cli import app

    res = CliRunner().invoke(app, ["answer", media["video"], "Which colour is first?", "--model", toy_policy_dir,
                                   "--preset", "paravt-eval", "--set", "max_turns=0"])
    assert res.exit_code == 0, res.output
    assert "trained with the 'paravt' protocol" in res.stderr and "layout.evidence: 'summary' -> 'frames'" in res.stderr
    assert "Answer:" in res.stdout


@pytest.mark.parametrize("layout", [{"evidence": "frames"}, {"tool_response": "per_call"},
                                    {"evidence": "frames", "tool_response": "per_call"}])
def test_layouts_run_on_the_toy_policy_and_train_token_for_token(toy_policy_dir, toy_rl, layout):
    """Frames evidence and per-call tool messages through the real graph and the local policy: the episode is
    one token sequence whose sampled spans are exactly the turns' output ids (the reward sees every tool turn)."""
    from paravt_agent.policy.local import LocalPolicy
    from paravt_train.data.records import PromptItem
    from paravt_train.rewards import RewardConfig
    from paravt_train.rl.rollout import PromptCache, RolloutSettings, assemble, run_group

    cfg = AgentConfig.for_model(toy_policy_dir).model_copy(deep=True)
    cfg = cfg.override([f"layout.{k}={v}" for k, v in layout.items()]
                       + ["planner_sampling.max_new_tokens=96", "subagent_sampling.max_new_tokens=40"])
    agent = Agent(policy=LocalPolicy(toy_policy_dir), config=cfg)
    w = toy_rl["worlds"][0]
    q = next(q for q in w.questions if q.task == "mcq")
    prompt = PromptItem(id=q.qid, video=w.video, question=q.question, options=q.options, answer=q.answer, task=q.task)
    settings = RolloutSettings(group=2, n_frames=8, reward=RewardConfig(), seed=0)
    eps = agent.run(run_group(agent, PromptCache(agent), prompt, settings, agent.policy.eos_id))
    ep = next(e for e in eps if e.tool_calls)
    msgs = ep.answer.messages
    tool_msgs = [m for m in msgs if m["role"] == "user" and "<tool_response>" in text_of(m["content"])]
    calls = ep.answer.trace.turns[0].calls
    if layout.get("tool_response") == "per_call":
        assert len(tool_msgs) >= len(calls) >= 1
    if layout.get("evidence") == "frames":
        assert all(c.evidence == "frames" for c in calls if not c.error)
        assert not ep.answer.subagent_records()  # no sub-agent ran
        assert len(ep.answer.planner_records()[1].images) > 8  # the crops' frames reached the planner
    for m in tool_msgs:  # every tool message is in the transcript the reward scores
        text = text_of(m["content"])
        assert text[text.index("<tool_response>"):] in ep.text
    seqs, split = assemble(ep.answer, agent.policy.eos_id)
    assert split == 0
    planner = [s for s in seqs if s.role == "planner"]
    assert len(planner) == 1
    outs = [r.generation.output_ids for r in ep.answer.planner_records()]
    assert sum(planner[0].loss_mask) == sum(len(o) for o in outs)
    sampled = [t for t, m in zip(planner[0].input_ids, planner[0].loss_mask, strict=True) if m]
    assert sampled == [t for o in outs for t in o]
