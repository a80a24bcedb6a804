"""Tool calls as the model writes them, through the agent: the coordinates a model-backed tool asks for follow the
model family, a tool's own token budget never cuts the configured one, and an argument that is not JSON is an
invalid call answered in its slot."""

from __future__ import annotations

import json

from paravt_agent.agent import Agent
from paravt_agent.config import AgentConfig
from paravt_agent.policy.base import text_of
from paravt_agent.policy.scripted import ScriptedPolicy
from paravt_agent.protocol import parse_tool_calls


def test_box_coordinates_follow_the_model_family(red_video):
    """``box_coordinates: auto`` (the default): a Qwen3-VL model is asked for 0-1000 boxes, a Qwen2.5-VL one for
    pixels; an explicit setting wins."""
    call = '<tool_call>{"name": "spatial_grounding", "arguments": {"objects": ["red"], "time": 18}}</tool_call>'
    asked = []

    def script(role, msgs):
        if role.startswith("tool:"):
            asked.append(text_of(msgs[-1]["content"]))
            return "[]"
        if "<tool_response>" in text_of(msgs[-1]["content"]):
            return "<think>ok</think><answer>A</answer>"
        return "<think>\nlook</think>" + call

    for name, want in (("Qwen/Qwen3-VL-8B-Instruct", "from 0 to 1000"), ("Qwen/Qwen2.5-VL-7B-Instruct", "pixel")):
        pol = ScriptedPolicy(script)
        pol.model = name
        Agent(policy=pol, config=AgentConfig(tools=["spatial_grounding"])).answer(red_video, "Where?")
        assert want in asked[-1]
    pol = ScriptedPolicy(script)
    pol.model = "Qwen/Qwen2.5-VL-7B-Instruct"
    Agent(policy=pol, config=AgentConfig(tools=["spatial_grounding"], box_coordinates="relative-1000")).answer(
        red_video, "Where?")
    assert "from 0 to 1000" in asked[-1]


def test_a_tools_own_token_budget_never_cuts_the_configured_one(red_video):
    """frame_selection asks 16 tokens for its confidence; the configured tool_sampling (128) wins, so a reply
    that reasons first is not cut before its number."""
    seen = []

    class Recording(ScriptedPolicy):
        async def generate(self, messages, sampling, prefix="", continuation=None, role="planner"):
            if role.startswith("tool:"):
                seen.append(sampling.max_new_tokens)
            return await super().generate(messages, sampling, prefix, continuation, role)

    call = ('<tool_call>{"name": "frame_selection", "arguments": {"query": "red", "start_time": 16, '
            '"end_time": 20}}</tool_call>')

    def script(role, msgs):
        if role.startswith("tool:"):
            return "It looks red. 0.9"
        if "<tool_response>" in text_of(msgs[-1]["content"]):
            return "<think>ok</think><answer>A</answer>"
        return "<think>\nlook</think>" + call

    Agent(policy=Recording(script), config=AgentConfig(tools=["frame_selection"])).answer(red_video, "When red?")
    assert seen and min(seen) == AgentConfig().tool_sampling.max_new_tokens


def test_an_ellipsis_in_call_arguments_is_an_invalid_call_not_a_crash(media):
    """A model that writes ``...`` (Python's Ellipsis under literal parsing) makes an invalid call, answered in
    its slot as the model's error; the episode's trace serialises."""
    for text in ("<tool_call>{'name': 'crop_video', 'arguments': {'start_time': ..., 'end_time': 5}}</tool_call>",
                 "<tool_call>crop_video(start_time=..., end_time=5)</tool_call>"):
        [c] = parse_tool_calls(text)
        assert not c.ok
    call = "<tool_call>crop_video(start_time=..., end_time=5)</tool_call>"

    def script(role, msgs):
        if "<tool_response>" in text_of(msgs[-1]["content"]):
            return "<think>that call was wrong</think><answer>A</answer>"
        return "<think>\nlook</think>" + call

    ans = Agent(policy=ScriptedPolicy(script), config=AgentConfig(retries=0)).answer(media["video"], "q?")
    [slot] = ans.trace.turns[0].calls
    assert slot.error and "JSON" in slot.error and not slot.runtime_error and ans.trace.scorable
    json.loads(ans.trace.to_json())
