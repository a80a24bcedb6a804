"""The toy's traces for Weaver and VideoChat-M1 are what the runtime sends: each SFT conversation renders to exactly
the tokens and pixels of the model call the agent graph makes when the policy answers with the trace's own turns
(train/serve parity, as tests/test_toy.py checks for ParaVT's traces)."""

import pytest

from paravt_agent.agent import Agent
from paravt_agent.policy.base import Policy, text_of
from paravt_agent.types import Generation
from paravt_train.data import SFTSample, render_messages
from paravt_train.sft.trainer import build_example
from paravt_train.toy.methods import POOL, collab_calls, tool_grounding_reply, toy_method_config, weaver_trace
from paravt_train.toy.world import make_worlds


class Replay(Policy):
    """Answers each role with the trace's turns and records every request."""

    def __init__(self, reply):
        self.reply, self.calls = reply, []

    async def generate(self, messages, sampling, prefix="", continuation=None, role="planner"):
        self.calls.append((role, messages))
        return Generation(text=self.reply(role, messages))


def ids(messages, processor, frames):
    sample = SFTSample.model_validate({"messages": messages})
    ex = build_example(render_messages(sample.messages, None, frames), processor)
    return ex["input_ids"], ex.get("pixel_values")


def same(got_messages, want_messages, processor, frames):
    want_ids, want_pix = ids(want_messages, processor, frames)
    got = build_example(got_messages, processor)
    assert got["input_ids"] == want_ids
    assert (got.get("pixel_values") is None) == (want_pix is None)
    if want_pix is not None:
        assert got["pixel_values"].equal(want_pix)


def first_second(messages) -> float:
    import re

    return float(re.search(r"<([\d.]+) seconds>", text_of(messages[-1]["content"])).group(1))


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    return make_worlds([3, 7], tmp_path_factory.mktemp("methods"), mcq=1, oe=0, tvg=1)


@pytest.fixture(scope="module")
def processor(tiny_model):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_model)


def test_weaver_traces_are_what_the_agent_sends(worlds, processor):
    cfg = toy_method_config("weaver")
    for w in worlds:
        for q in w.questions:
            trace = weaver_trace(w, q, w.video, 8)
            turns = [trace[2]["content"], trace[4]["content"]]

            def reply(role, msgs, w=w, q=q, turns=turns):
                if role == "tool:temporal_grounding":
                    a = first_second(msgs)
                    return tool_grounding_reply(w, q.colour, a, a + 15)
                return turns.pop(0)

            pol = Replay(reply)
            ans = Agent(policy=pol, config=cfg).answer(w.video, q.question, q.options, n_frames=8)
            assert ans.trace.response == trace[-1]["content"] and ans.trace.scorable
            same(ans.messages, trace, processor, cfg.frames)
            tools = [m for r, m in pol.calls if r == "tool:temporal_grounding"]
            assert len(tools) == (w.duration // 16 if q.task == "tvg" else 0)
            if q.task == "tvg":
                a, b = w.span_of(q.colour)
                assert ans.span == (a, b)


def test_collaborative_traces_are_what_the_agents_send(worlds, processor):
    cfg = toy_method_config("collab")
    for w in worlds:
        for q in w.questions:
            calls = {name: collab_calls(w, q, w.video, 8, name) for name in POOL}

            def reply(role, msgs, w=w, q=q, calls=calls):
                if role.startswith("agent:"):
                    mine = calls[role.split(":")[1]]
                    system = text_of(msgs[0]["content"])
                    kind = ("decision" if "strategic planning" in system else "answer" if "plan is done" in system
                            else "plan")
                    return mine[kind][-1]["content"]
                if role == "subagent":
                    return w.summary(q, q.t, q.t + 0.5)
                if role == "tool:temporal_grounding":
                    a = first_second(msgs)
                    return tool_grounding_reply(w, q.colour, a, a + 15)
                return calls[POOL[0]]["summary"][-1]["content"]

            pol = Replay(reply)
            ans = Agent(policy=pol, config=cfg).answer(w.video, q.question, q.options, n_frames=8)
            assert ans.trace.turns[-1].consensus == list(POOL) and ans.trace.scorable
            for role, msgs in pol.calls:
                if role.startswith("agent:"):
                    name = role.split(":")[1]
                    system = text_of(msgs[0]["content"])
                    kind = ("decision" if "strategic planning" in system else "answer" if "plan is done" in system
                            else "plan")
                    same([*msgs, calls[name][kind][-1]], calls[name][kind], processor, cfg.frames)
                elif role == "planner":
                    same([*msgs, calls[POOL[0]]["summary"][-1]], calls[POOL[0]]["summary"], processor, cfg.frames)
            want = calls[POOL[0]]["answer"][-1]["content"].split("<answer>")[1].split("</answer>")[0].strip()
            assert ans.text == want


def test_method_rows_join_the_build_only_when_asked(worlds):
    """`paravt-train toy --set methods=[weaver,collab]` adds the methods' rows (each parseable by the runtime's
    protocol); without them the build and its cache key are the shipped recipe's."""
    from paravt_train.toy.build import ToyConfig
    from paravt_train.toy.methods import method_rows
    from paravt_train.toy.rows import check_trace_roundtrip

    rows = method_rows(worlds, ["weaver", "collab"], seed=0)
    check_trace_roundtrip(rows)
    kinds = {r["id"].split("-", 2)[-1].rstrip("0123456789") for r in rows}
    assert {"weaver", "wtool", "collab"} <= kinds
    assert len([r for r in rows if r["id"].endswith("-weaver")]) == sum(len(w.questions) for w in worlds)
    assert ToyConfig(out="a").digest() == ToyConfig(out="a", methods=[]).digest()
    assert ToyConfig(out="a", methods=["weaver"]).digest() != ToyConfig(out="a").digest()
