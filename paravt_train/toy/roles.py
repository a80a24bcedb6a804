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
from paravt_agent.prompts import SUBAGENT_SYSTEM_PROMPT, subagent_messages, tool_response_message
from paravt_agent.protocol import parse_tool_calls
from paravt_train.rewards import accuracy_reward
from paravt_train.toy.world import World, answer_turn, call_label, planner_turn, windows_for

__all__ = ["role_accuracy", "score"]


def score(response: str, q) -> float:
    """The task's reward of a response to question ``q``: MCQ letter, OE token F1, grounding IoU."""
    truth = [int(x) for x in q.span] if q.task == "tvg" else q.answer
    return accuracy_reward(response, truth, q.task, q.options)


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
    inp = await asyncio.to_thread(agent.prepare, w.video, q.question, q.options, n)
    messages, ctx = inp.messages, inp.context
    wins = windows_for(w, q)
    plan = planner_turn(q, wins, w.duration)

    async def planner():
        gen = await agent.policy.generate(messages, cfg.planner_sampling, prefix=cfg.think_prefix)
        scores["planner", q.task].append(float(_windows(gen.text) == [(float(a), float(b)) for a, b in wins]))

    async def subagent(p, a: int, b: int):
        # the correct plan's calls through the runtime's registry and crop tool, as the graph runs them
        result = await p.tool.run(p.args, ctx)
        question = q.question if cfg.question_to_subagents else None
        msgs = subagent_messages(result.frames, result.timestamps, result.window, question,
                                 system=cfg.subagent_prompt or SUBAGENT_SYSTEM_PROMPT)
        gen = await agent.policy.generate(msgs, cfg.subagent_sampling)
        scores["subagent", q.task].append(float(gen.text.strip() == w.summary(q, a, b)))

    async def answer():
        msgs = [*messages, {"role": "assistant", "content": plan},
                tool_response_message([(call_label(w, a, b), w.report(q, a, b)) for a, b in wins])]
        gen = await agent.policy.generate(msgs, cfg.planner_sampling, prefix=cfg.think_prefix)
        scores["answer", q.task].append(score(gen.text, q))
        if q.task == "tvg":  # the best the answer step can do: [first, last + 1] of the seconds seen
            scores["answer (oracle)", q.task].append(score(answer_turn(w, q), q))

    calls = agent.registry.prepare(parse_tool_calls(plan), ctx, cfg.max_calls_per_turn)
    if not all(p.ok for p in calls) or len(calls) != len(wins):
        raise AssertionError(f"{q.qid}: the taught plan does not validate: {[p.error for p in calls]}")
    await asyncio.gather(planner(), answer(), *(subagent(p, a, b) for p, (a, b) in zip(calls, wins, strict=True)))


def role_accuracy(agent: Agent, worlds: list[World], n: int = 8, concurrency: int = 4, progress: bool = True) -> dict:
    """``{(role, task): mean score}`` over every question of ``worlds`` (overview of ``n`` frames)."""
    from tqdm.auto import tqdm

    scores: dict = defaultdict(list)
    items = [(w, q) for w in worlds for q in w.questions]
    bar = tqdm(total=len(items), desc="roles", disable=not progress, leave=False)

    async def run():
        sem = asyncio.Semaphore(concurrency)

        async def guarded(w, q):
            async with sem:
                await _one(agent, w, q, n, scores)
                bar.update(1)

        await asyncio.gather(*(guarded(w, q) for w, q in items))

    try:
        agent.run(run())
    finally:
        bar.close()
    return {k: sum(v) / len(v) for k, v in sorted(scores.items())}
