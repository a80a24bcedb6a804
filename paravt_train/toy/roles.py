"""Per-role accuracy of a toy policy: where an end-to-end error comes from.

Each role is scored in isolation on held-out worlds, with its inputs built by
the runtime's own code (the agent's initial state, the crop tool, the one
``<tool_response>`` turn) and, where a role depends on another, the *correct*
output of that other role:

* ``planner``: the first planner turn; exact match of the parsed windows with
  the ones the traces teach (in order).
* ``subagent``: one sub-agent per window of the correct plan; exact match of its
  summary with what the frames show.
* ``answer``: the planner's answer turn after the correct plan and the correct
  summaries; the task's reward (MCQ letter, OE token F1, grounding IoU).

End-to-end accuracy is roughly their product; a role far below the others is
the bottleneck.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

from paravt_agent.agent import Agent
from paravt_agent.prompts import subagent_messages, tool_response_message
from paravt_agent.protocol import parse_tool_calls
from paravt_train.rewards import accuracy_reward
from paravt_train.toy.world import World, answer_turn, call_label, planner_turn, windows_for

__all__ = ["role_accuracy"]


def _windows(text: str) -> list[tuple[float, float]]:
    out = []
    for c in parse_tool_calls(text):
        if not c.ok:
            out.append((-1.0, -1.0))
            continue
        try:
            out.append((float(c.arguments["start_time"]), float(c.arguments["end_time"])))
        except (KeyError, TypeError, ValueError):
            out.append((-1.0, -1.0))
    return out


async def _one(agent: Agent, w: World, q, n: int, scores: dict) -> None:
    cfg = agent.config
    state, _ = await asyncio.to_thread(agent.initial_state, w.video, q.question, q.options, n)
    messages = state["messages"]
    wins = windows_for(w, q)

    async def planner():
        gen = await agent.policy.generate(messages, cfg.planner_sampling, prefix=cfg.think_prefix)
        scores["planner", q.task].append(float(_windows(gen.text) == [(float(a), float(b)) for a, b in wins]))

    async def subagent(a: int, b: int):
        clip = await asyncio.to_thread(state["ctx"].video.crop, a, min(b, w.duration),
                                       max_frames=cfg.frames.crop_max_frames, fps=cfg.frames.crop_fps,
                                       max_pixels=cfg.frames.max_pixels, factor=cfg.frames.factor)
        msgs = subagent_messages(clip.frames, clip.timestamps, (a, min(b, w.duration)), q.question)
        gen = await agent.policy.generate(msgs, cfg.subagent_sampling)
        scores["subagent", q.task].append(float(gen.text.strip() == w.summary(q, a, b)))

    async def answer():
        msgs = [*messages, {"role": "assistant", "content": planner_turn(q, wins)},
                tool_response_message([(call_label(w, a, b), w.summary(q, a, b)) for a, b in wins])]
        gen = await agent.policy.generate(msgs, cfg.planner_sampling, prefix=cfg.think_prefix)
        truth = list(q.span) if q.task == "tvg" else q.answer
        scores["answer", q.task].append(accuracy_reward(gen.text, truth, q.task, q.options))
        if q.task == "tvg":  # the best the answer step can do: [first, last] second seen
            scores["answer (oracle)", q.task].append(accuracy_reward(answer_turn(w, q), truth, q.task))

    await asyncio.gather(planner(), answer(), *(subagent(a, b) for a, b in wins))


def role_accuracy(agent: Agent, worlds: list[World], n: int = 8, concurrency: int = 4) -> dict:
    """``{(role, task): mean score}`` over every question of ``worlds`` (overview of ``n`` frames)."""
    scores: dict = defaultdict(list)

    async def run():
        sem = asyncio.Semaphore(concurrency)

        async def guarded(w, q):
            async with sem:
                await _one(agent, w, q, n, scores)

        await asyncio.gather(*(guarded(w, q) for w in worlds for q in w.questions))

    agent.run(run())
    return {k: sum(v) / len(v) for k, v in sorted(scores.items())}
