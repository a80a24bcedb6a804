"""Graph control flow with a scripted policy (fixed outputs), on a real mp4."""

import asyncio
import json
import re
import time

import pytest

from paravt_agent.agent import Agent
from paravt_agent.config import AgentConfig
from paravt_agent.errors import PolicyError
from paravt_agent.policy.base import text_of
from paravt_agent.policy.scripted import ScriptedPolicy
from paravt_agent.trajectory import Trace
from paravt_agent.types import AnswerEvent, OverviewEvent, PlannerEvent, SubAgentEvent

WINDOWS = [(2, 6), (10, 14), (20, 24), (30, 34)]


def calls_text(windows):
    return "<think>inspect the windows</think>\n" + "\n".join(
        f'<tool_call>{{"name": "crop_video", "arguments": {{"start_time": {a}, "end_time": {b}}}}}</tool_call>'
        for a, b in windows
    )


def summary_script(windows, answer="<think>done</think><answer>B</answer>", fail=None):
    """Planner: the calls, then the answer once a tool response arrived. Sub-agent: name its window."""

    def script(role, msgs):
        if role == "subagent":
            head = text_of(msgs[1]["content"])
            m = re.search(r"Window ([\d.]+)-([\d.]+)", head)
            if fail and fail(float(m.group(1))):
                raise ValueError(f"decoder exploded at {m.group(1)}")
            return f"summary of {float(m.group(1)):g}-{float(m.group(2)):g}"
        if "<tool_response>" in text_of(msgs[-1]["content"]):
            return answer
        return calls_text(windows)

    return script


def agent_with(script, delay=0.0, **cfg):
    return Agent(policy=ScriptedPolicy(script, delay=delay), config=AgentConfig(**cfg))


def test_parallel_k_calls_one_tool_response_in_call_order(media):
    pol = ScriptedPolicy(summary_script(WINDOWS))
    agent = Agent(policy=pol)
    ans = agent.answer(media["video"], "Which colour?", ["red", "green"])
    roles = [r for r, _ in pol.calls]
    assert roles.count("subagent") == 4 and roles.count("planner") == 2
    final_prompt = pol.calls[-1][1]
    responses = [m for m in final_prompt if text_of(m["content"]).startswith("<tool_response>")]
    assert len(responses) == 1  # ONE user turn for all K results
    body = text_of(responses[0]["content"])
    order = [body.index(f"summary of {a}-{b}") for a, b in WINDOWS]
    assert order == sorted(order)
    assert ans.choice == "B" and ans.text == "B"
    [turn1, turn2] = ans.trace.turns
    assert [c.window for c in turn1.calls] == [(float(a), float(b)) for a, b in WINDOWS]
    assert all(c.frame_timestamps and a <= c.frame_timestamps[0]
               for c, (a, _) in zip(turn1.calls, WINDOWS, strict=True))
    assert turn1.reasoning == "inspect the windows" and not turn2.calls
    assert final_prompt[0]["role"] == "system" and "<tool_call>" in text_of(final_prompt[0]["content"])


@pytest.mark.parametrize("report", ["full", "answer"])
def test_subagent_report_full_or_answer(media, report):
    """A thinking sub-agent: with subagent_report answer the planner reads what follows its </think> (all of a
    reply that closed none); the trace keeps the whole reply."""

    def script(role, msgs):
        if role == "subagent":
            a = float(re.search(r"Window ([\d.]+)-", text_of(msgs[1]["content"])).group(1))
            return f"<think>\nnotes on {a:g}</think>\nfound {a:g}" if a != 10 else f"plain {a:g}"
        if "<tool_response>" in text_of(msgs[-1]["content"]):
            return "<think>done</think><answer>B</answer>"
        return calls_text(WINDOWS)

    pol = ScriptedPolicy(script)
    ans = Agent(policy=pol, config=AgentConfig(subagent_report=report)).answer(media["video"], "Which?", ["a", "b"])
    body = text_of(pol.calls[-1][1][-1]["content"])
    assert "plain 10" in body and all(f"found {a}" in body for a, _ in WINDOWS if a != 10)
    assert ("notes on" in body) == (report == "full")
    records = ans.trace.turns[0].calls
    assert [c.summary for c in records][1] == "plain 10"
    assert records[0].summary == ("<think>\nnotes on 2</think>\nfound 2" if report == "full" else "found 2")
    assert records[0].reply == (None if report == "full" else "<think>\nnotes on 2</think>\nfound 2")
    assert records[1].reply is None and Trace.from_json(ans.trace.to_json()).turns[0].calls[0] == records[0]


def test_think_prefix_is_pinned(media):
    seen = []

    def script(role, msgs):
        return "<answer>A</answer>"

    class Recording(ScriptedPolicy):
        async def generate(self, messages, sampling, prefix="", continuation=None, role="planner"):
            seen.append(prefix)
            return await super().generate(messages, sampling, prefix, role=role)

    ans = Agent(policy=Recording(script)).answer(media["video"], "q?")
    assert seen == ["<think>\n"] and ans.trace.response.startswith("<think>\n")


def test_error_slots_keep_the_others(media):
    windows = [(2, 6), (50, 60), (10, 14), (20, 24)]
    text = calls_text(windows) + "\n<tool_call>{broken</tool_call>"

    def script(role, msgs):
        if role == "planner" and "<tool_response>" not in text_of(msgs[-1]["content"]):
            return text
        return summary_script(windows, fail=lambda start: start == 20)(role, msgs)

    pol = ScriptedPolicy(script)
    ans = Agent(policy=pol, config=AgentConfig(retries=0)).answer(media["video"], "q?")
    calls = ans.trace.turns[0].calls
    assert [c.index for c in calls] == [0, 1, 2, 3, 4]
    assert calls[0].summary == "summary of 2-6" and calls[2].summary == "summary of 10-14"
    assert "beyond the end" in calls[1].error
    assert "decoder exploded" in calls[3].error
    assert "malformed" in calls[4].error
    body = text_of(pol.calls[-1][1][-1]["content"])
    assert body.count("error:") == 3 and ans.text == "B"


def test_subagent_timeout_and_retry_use_langgraph_policies(media):
    attempts = {"n": 0}

    class Flaky(ScriptedPolicy):
        async def generate(self, messages, sampling, prefix="", continuation=None, role="planner"):
            if role == "subagent":
                head = text_of(messages[1]["content"])
                if head.startswith("Window 2.0"):
                    attempts["n"] += 1
                    if attempts["n"] == 1:
                        raise PolicyError("503 from endpoint", transient=True)
                if head.startswith("Window 10.0"):
                    await asyncio.sleep(5)
            return await super().generate(messages, sampling, prefix, role=role)

    agent = Agent(policy=Flaky(summary_script(WINDOWS[:2])), config=AgentConfig(subagent_timeout=0.5, retries=1))
    t0 = time.perf_counter()
    ans = agent.answer(media["video"], "q?")
    calls = ans.trace.turns[0].calls
    assert attempts["n"] == 2 and calls[0].summary == "summary of 2-6"  # retried once, then fine
    assert "timeout" in calls[1].error  # timed out twice (1 + 1 retry)
    assert time.perf_counter() - t0 < 4


@pytest.mark.parametrize("mode,turns,failing", [
    ("parallel", [[(2, 6)]], {2}),  # the only call of the turn fails
    ("parallel", [[(2, 6), (10, 14)]], {2, 10}),  # every call fails
    ("parallel", [[(2, 6), (10, 14)]], {10}),  # one of two fails
    ("sequential", [[(2, 6)]], {2}),  # the one call fails
    ("sequential", [[(2, 6)], [(10, 14)]], {2, 10}),  # every turn's call fails
    ("sequential", [[(2, 6)], [(10, 14)]], {10}),  # one of two turns' calls fails
])
def test_a_turn_whose_calls_fail_still_reaches_an_answer(media, mode, turns, failing):
    """A sub-agent that fails after its retries gets an error slot and the turn is still aggregated: the planner
    reads the slots and answers (langgraph >= 1.2.24 runs an error handler as its own node, with no edge onward
    unless it routes). Such slots are the runtime's errors, not the model's: the trace says so, and the answer,
    built without their evidence, is never a clean one (status "degraded", ok False, each failure in errors)."""

    def script(role, msgs):
        if role == "subagent":
            return summary_script([], fail=lambda start: start in failing)(role, msgs)
        done = sum(text_of(m["content"]).startswith("<tool_response>") for m in msgs)
        return calls_text(turns[done]) if done < len(turns) else "<think>done</think><answer>B</answer>"

    pol = ScriptedPolicy(script)
    ans = Agent(policy=pol, config=AgentConfig(mode=mode, retries=0)).answer(media["video"], "q?")
    assert ans.text == "B" and not ans.ok and ans.status == "degraded" and ans.trace.failed_calls == len(failing)
    assert not ans.trace.scorable and "DEGRADED" in ans.trace.render()
    assert [e.split(": ", 1)[1] for e in ans.trace.errors] == [f"decoder exploded at {float(s)}"
                                                               for s in sorted(failing)]
    assert all(e.startswith("turn ") and " (crop_video(" in e for e in ans.trace.errors)  # where and which call
    calls = [c for t in ans.trace.turns for c in t.calls]
    assert [c.window[0] for c in calls if c.error] == sorted(failing)
    assert all(c.runtime_error == bool(c.error) for c in calls)
    assert len(ans.trace.runtime_call_errors) == len(failing)
    read = "\n".join(text_of(m["content"]) for m in pol.calls[-1][1] if m["role"] == "user")
    assert read.count("decoder exploded") == len(failing)  # the planner answered having read every error slot


def test_a_tool_refusing_the_call_is_the_models_error_not_the_runtimes(media):
    """A tool that refuses a call (get_subtitles on a video without subtitles: a ToolError) fills its slot with
    the error, but it is the model's choice that failed — not an outage: RL scores such an episode."""
    call = '<tool_call>{"name": "get_subtitles", "arguments": {"start_time": 0, "end_time": 8}}</tool_call>'

    def script(role, msgs):
        if "<tool_response>" in text_of(msgs[-1]["content"]):
            return "<think>no subtitles</think><answer>A</answer>"
        return "<think>read the speech</think>\n" + call

    cfg = AgentConfig(retries=0, tools=["crop_video", "get_subtitles"])
    ans = Agent(policy=ScriptedPolicy(script), config=cfg).answer(media["video"], "q?")
    [slot] = ans.trace.turns[0].calls
    assert "no subtitle file" in slot.error and not slot.runtime_error
    assert ans.text == "A" and ans.trace.runtime_call_errors == []


def test_every_subagent_timing_out_still_reaches_an_answer(media):
    class Slow(ScriptedPolicy):
        async def generate(self, messages, sampling, prefix="", continuation=None, role="planner"):
            if role == "subagent":
                await asyncio.sleep(5)
            return await super().generate(messages, sampling, prefix, role=role)

    pol = Slow(summary_script(WINDOWS[:3]))
    ans = Agent(policy=pol, config=AgentConfig(subagent_timeout=0.3, retries=0)).answer(media["video"], "q?")
    calls = ans.trace.turns[0].calls
    assert ans.text == "B" and len(calls) == 3 and all("timeout" in c.error and c.runtime_error for c in calls)


def test_max_turns_then_final_answer(media):
    def script(role, msgs):
        if role == "subagent":
            return "nothing here"
        last = text_of(msgs[-1]["content"])
        if "tool budget is used up" in last:
            return "<think>fine</think><answer>C</answer>"
        return calls_text([(2, 6)])  # always wants more

    pol = ScriptedPolicy(script)
    ans = Agent(policy=pol, config=AgentConfig(max_turns=2)).answer(media["video"], "q?")
    assert [t.forced_final for t in ans.trace.turns] == [False, False, False, True]
    assert ans.trace.tool_calls == 2 and ans.text == "C"
    assert [r for r, _ in pol.calls].count("planner") == 4


def test_sequential_mode_one_call_per_turn(media):
    def script(role, msgs):
        if role == "subagent":
            return "seen"
        n_resp = sum(text_of(m["content"]).startswith("<tool_response>") for m in msgs)
        if n_resp == 2:
            return "<answer>A</answer>"
        return calls_text(WINDOWS[n_resp : n_resp + 2])  # the model asks for two; only one runs

    pol = ScriptedPolicy(script)
    ans = Agent(policy=pol, config=AgentConfig(mode="sequential")).answer(media["video"], "q?")
    t1, t2, t3 = ans.trace.turns
    assert [c.summary for c in t1.calls] == ["seen", ""] and "at most 1" in t1.calls[1].error
    assert t2.calls[0].window == (10.0, 14.0) and t3.calls == []
    assert "ONE <tool_call> per turn" in text_of(pol.calls[0][1][0]["content"])
    responses = [m for m in pol.calls[-1][1] if text_of(m["content"]).startswith("<tool_response>")]
    assert len(responses) == 2  # results accumulate turn by turn


def test_none_mode_answers_from_overview(media):
    pol = ScriptedPolicy(lambda role, msgs: calls_text(WINDOWS) + "<answer>D</answer>")
    ans = Agent(policy=pol, config=AgentConfig(mode="none")).answer(media["video"], "q?", ["a", "b", "c", "d"])
    assert len(pol.calls) == 1 and ans.trace.tool_calls == 0 and ans.choice == "D"
    assert "<tool_call>" not in text_of(pol.calls[0][1][0]["content"])


@pytest.mark.parametrize("n", [4, 8])
def test_overview_frames_in_prompt(media, n):
    pol = ScriptedPolicy(lambda role, msgs: "<answer>A</answer>")
    ans = Agent(policy=pol).answer(media["video"], "q?", n_frames=n)
    user = pol.calls[0][1][1]["content"]
    images = [p for p in user if p["type"] == "image"]
    labels = [p["text"] for p in user if p["type"] == "text" and p["text"].endswith("seconds>")]
    assert len(images) == n == len(labels) == len(ans.trace.overview_timestamps)
    assert labels[0] == "<0.0 seconds>"


def test_concurrency_k_subagents_take_about_one_delay(media):
    delay, k = 0.4, 8
    windows = [(i * 4, i * 4 + 3) for i in range(k)]
    agent = agent_with(summary_script(windows), delay=delay)
    agent.answer(media["video"], "warm-up?")  # decoders and caches warm
    t0 = time.perf_counter()
    ans = agent.answer(media["video"], "q?")
    wall = time.perf_counter() - t0
    assert ans.trace.tool_calls == k
    assert wall < 3 * delay + 0.8, wall  # planner + one sub-agent wave + answer, not k delays
    seq = agent_with(summary_script(windows), delay=delay, mode="sequential", max_turns=1)
    calls = seq.answer(media["video"], "q?").trace.turns[0].calls
    assert len(calls) == 2 and not calls[0].error  # one executed, one slot sums up the rest
    assert f"{k - 1} more tool calls not run" in calls[1].error


def test_trace_phases_say_where_the_time_went(media):
    delay = 0.3
    agent = agent_with(summary_script(WINDOWS), delay=delay)
    ans = agent.answer(media["video"], "Which colour?", ["red", "green"], n_frames=8)
    t = ans.trace
    names = [(p.name, p.turn, p.index) for p in sorted(t.phases, key=lambda p: (p.start, p.name))]
    assert names[0] == ("overview", None, None) and names[1] == ("planner", 0, None)
    assert sorted(n for n in names if n[0] in ("crop", "subagent")) == sorted(
        [("crop", 0, i) for i in range(4)] + [("subagent", 0, i) for i in range(4)])
    assert names[-2:] == [("aggregate", 0, None), ("answer", 1, None)]
    # phases are real intervals in order: the sub-agents start after the planner turn ends
    planner = next(p for p in t.phases if p.name == "planner")
    subs = [p for p in t.phases if p.name == "subagent"]
    assert all(s.start >= planner.start + planner.seconds - 1e-3 for s in subs)
    assert planner.seconds >= delay and all(s.seconds >= delay for s in subs)
    b = t.breakdown()
    on_path = (b["decode overview"] + b["planner prefill"] + b["planner decode"] + b["planner other"]
               + b["sub-agents (wall)"] + b["aggregate"] + b["answer turn"] + b["other"])
    assert on_path == pytest.approx(t.latency, abs=0.01)
    assert b["sub-agent generation (sum)"] >= 4 * delay > b["sub-agents (wall)"] >= delay  # concurrent
    assert b["decode overview"] == round(t.overview_latency, 4) and t.overview_latency > 0
    assert "sub-agents (wall)" in t.render_profile() and "subagent turn 1 call 4" in t.render_profile()
    again = Trace.from_json(t.to_json())
    assert again.breakdown() == b
    # a run from a prepared input (a GRPO rollout) did not decode the overview itself
    inp = agent.prepare(media["video"], "Which colour?", ["red", "green"], n_frames=8)
    time.sleep(0.05)
    rollout = agent.run(agent.arun(inp, seed=1)).trace
    assert rollout.overview_latency == 0 and not any(p.name == "overview" for p in rollout.phases)


def test_trace_json_roundtrip_and_render(media):
    ans = agent_with(summary_script(WINDOWS)).answer(media["video"], "Which colour?", ["red", "green"])
    data = ans.trace.to_json()
    back = Trace.from_json(data)
    assert back == ans.trace and json.loads(data)["turns"][0]["calls"][0]["window"] == [2.0, 6.0]
    text = ans.trace.render()
    assert "summary of 10-14" in text and "Answer: B" in text and "crop_video(00:02-00:06)" in text


def test_astream_events(media):
    agent = agent_with(summary_script(WINDOWS), delay=0.05)

    async def collect():
        return [e async for e in agent.astream(media["video"], "q?")]

    events = asyncio.run(collect())
    kinds = [e.kind for e in events]
    assert isinstance(events[0], OverviewEvent) and isinstance(events[-1], AnswerEvent)
    assert kinds.count("subagent") == 4 and kinds.index("planner") < kinds.index("subagent")
    assert all(isinstance(e, SubAgentEvent) and e.record.summary for e in events if e.kind == "subagent")
    planner = next(e for e in events if isinstance(e, PlannerEvent))
    assert [c.window for c in planner.calls] == [tuple(map(float, w)) for w in WINDOWS]
    assert events[-1].answer.text == "B"


def test_answer_many_with_errors_per_item(media, tmp_path):
    def script(role, messages):
        if role == "planner" and "q4" in text_of(messages[-1]["content"]):
            raise RuntimeError("a bug in a plugin")  # not a ParaVT error: still only this item's
        return summary_script(WINDOWS)(role, messages)

    agent = agent_with(script)
    items = [{"video": media["video"], "question": "q1?"}, {"video": tmp_path / "nope.mp4", "question": "q2?"},
             {"video": media["video"], "question": "q3?", "options": ["x", "y"]},
             {"video": media["video"], "question": "q4?"}]
    out = agent.answer_many(items, concurrency=2, progress=False)
    assert [a.text for a in out] == ["B", "", "B", ""]
    assert "no such file" in out[1].trace.errors[0]
    assert "RuntimeError: a bug in a plugin" in out[3].trace.errors[0]


def test_unreachable_endpoint_is_one_clear_error(media):
    agent = Agent(backend="openai", endpoint="http://127.0.0.1:9/v1", model="m",
                  config=AgentConfig(retries=0), policy_kwargs={"max_retries": 0})
    with pytest.raises(PolicyError, match="cannot reach the model endpoint.*transformers serve"):
        agent.answer(media["video"], "q?")


def test_config_yaml_and_overrides(tmp_path):
    p = tmp_path / "agent.yaml"
    p.write_text("mode: sequential\nframes:\n  n_frames: 8\n  factor: 28\nplanner_sampling:\n  temperature: 0.7\n")
    cfg = AgentConfig.from_yaml(p, ["max_turns=2", "frames.crop_max_frames=8"])
    assert (cfg.mode, cfg.frames.n_frames, cfg.frames.factor, cfg.max_turns, cfg.frames.crop_max_frames) == (
        "sequential", 8, 28, 2, 8)
    assert cfg.planner_sampling.temperature == 0.7
    from paravt_agent.errors import ConfigError

    with pytest.raises(ConfigError):
        cfg.override(["mode=diagonal"])
    with pytest.raises(ConfigError):
        cfg.override(["frames.bogus=1"])
