"""The collaborative mode's nodes (:mod:`paravt_agent.graph.collab`): the fan-out to the pool's agents, their merge,
the synthesizer and the routing both protocols share, and the ``rounds`` protocol itself — each round every agent
sees the overview and the question, reads the shared memory of the rounds before (its own entries and those the
others chose to share), writes its plan, calls tools (run exactly as a planner's calls:
:func:`paravt_agent.graph.calls.run_call`), notes the key information it has so far, and decides whether to share
its entry; a synthesizer answers strictly from the memory. The ``cpp`` protocol's turns are
:mod:`paravt_agent.graph.collab.cpp`."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time

from langgraph.errors import NodeError
from langgraph.runtime import Runtime
from langgraph.types import Command, Send

from paravt_agent.graph.calls import plan_calls, run_agent_call
from paravt_agent.graph.collab.cpp import cpp_agent, cpp_finish, cpp_route
from paravt_agent.graph.context import tool_schemas
from paravt_agent.graph.frames import refs_of
from paravt_agent.graph.runtime import (
    actx,
    ctx_of,
    emit,
    event_json,
    generate,
    phase,
    seeded,
    tool_context,
)
from paravt_agent.graph.state import AgentState, slot_order
from paravt_agent.prompts import question_text
from paravt_agent.protocol import parse_tool_calls, split_think
from paravt_agent.trajectory import MemoryEntry, PlannerTurn
from paravt_agent.types import GenerationRecord, MemoryEvent, PlannerEvent

__all__ = ["AGENT_PROMPT", "SYNTHESIZER_PROMPT", "collab_agent", "collab_failed", "collab_merge", "memory_view",
           "route_collab", "synthesize"]

AGENT_PROMPT = """You are {name}, one of {n} agents answering a question about a video together. You see overview \
frames of the video, the question, and the shared memory: what the agents found in earlier rounds.

In each round:
1. Think in <think> </think>.
2. Write your plan in <plan> </plan>. If the memory shows that another agent already covers part of the task, revise \
your plan and take another part.
3. Call tools to inspect the video: at most {k} <tool_call> blocks. Their outputs go to the shared memory.
4. Write the key information you have so far, with times, in <info> </info>.
5. Say whether the other agents should read your entry: <share>yes</share> or <share>no</share>.
{focus}
# Tools
<tools>
{tools}
</tools>"""

SYNTHESIZER_PROMPT = """You answer a question about a video from the shared memory of agents who inspected it. Use \
only what the memory says; do not assume anything it does not say. Think in <think> </think>, then give the final \
answer in <answer> </answer>."""

_TAG = {t: re.compile(rf"<{t}>(.*?)(?:</{t}>|\Z)", re.S) for t in ("plan", "info", "share")}


def _tag(text: str, tag: str) -> str:
    m = _TAG[tag].search(split_think(text)[1] or text)
    return m.group(1).strip() if m else ""


def memory_view(entries: list[MemoryEntry], limit: int) -> str:
    """The memory as text, newest entries kept within ``limit`` characters (older ones counted, left out)."""
    blocks, kept, used = [e.render() for e in entries], [], 0
    for b in reversed(blocks):
        if used + len(b) + 1 > limit:
            break
        kept.append(b)
        used += len(b) + 1
    if not kept:
        return "(empty)" if not blocks else f"({len(blocks)} entries, too long to show)"
    head = [f"({len(blocks) - len(kept)} older entries left out)"] if len(kept) < len(blocks) else []
    return "\n".join([*head, *reversed(kept)])


def _visible(state: AgentState, name: str, before: int) -> list[MemoryEntry]:
    """What agent ``name`` reads in round ``before``: its own entries and the shared ones of earlier rounds."""
    memory = state.get("memory", {}) or {}
    return [memory[k] for k in sorted(memory, key=slot_order)
            if memory[k].round < before and (memory[k].agent == name or memory[k].share)]


def route_collab(state: AgentState, runtime: Runtime):
    """The next round's ``Send`` per agent, or the synthesizer once every round ran (``cpp``: :func:`cpp_route`)."""
    ctx = ctx_of(runtime)
    c, rnd = ctx.config.collab, state.get("round", 0)
    if c.protocol == "cpp":
        return cpp_route(state, runtime)
    if rnd >= c.turns:
        return "synthesize"
    return [Send("collab_agent", {"round": rnd, "agent": i, "name": a.name, "video": state["video"],
                                  "question": state["question"], "seed": state.get("seed"),
                                  "memory": _visible(state, a.name, rnd), "view": _overview(state),
                                  "json_events": ctx.json_events})
            for i, a in enumerate(c.agents)]


def _overview(state: AgentState) -> list:
    """The first user message's parts (overview frames by key, then the question)."""
    first = next(m for m in state["messages"] if m["role"] == "user")
    content = first["content"]
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


async def collab_agent(payload: dict, runtime: Runtime) -> dict:
    """One agent's round: plan, tool calls, key info and share decision into its memory entry (``cpp``: one
    agent's turn, :func:`cpp_agent`)."""
    ctx = await actx(runtime)
    if ctx.config.collab.protocol == "cpp":
        return await cpp_agent(payload, runtime)
    cfg, c = ctx.config, ctx.config.collab
    rnd, idx = payload["round"], payload["agent"]
    spec = c.agents[idx]
    own = spec.model is not None  # its turns and its crops' summaries go to its own model
    actx_ = dataclasses.replace(ctx, policy=await ctx.apolicy_for(spec.model)) if own else ctx
    t0 = time.perf_counter()
    schemas = "\n".join(json.dumps(s, ensure_ascii=False) for s in tool_schemas(cfg, ctx.tools))
    system = AGENT_PROMPT.format(name=spec.name, n=len(c.agents), k=c.max_calls_per_agent, tools=schemas,
                                 focus=f"Your focus: {spec.focus}\n" if spec.focus else "")
    note = (f"Shared memory:\n{memory_view(payload['memory'], c.max_memory_chars)}\n\n"
            f"Round {rnd + 1} of {c.turns}." + (" This is the last round." if rnd + 1 == c.turns else ""))
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": [*payload["view"], {"type": "text", "text": "\n" + note}]}]
    seed = payload.get("seed")
    gen = await generate(actx_, f"agent:{spec.name}", messages,
                         seeded(c.agent_sampling, seed, rnd, 100 + idx), prefix=cfg.think_prefix)
    phases = [phase("agent", t0, rnd, idx, detail=gen.timings)]
    records = [GenerationRecord(f"agent:{spec.name}", rnd, idx, gen, image_refs=refs_of(messages),
                                trainable=not own)]
    text = gen.text
    calls = parse_tool_calls(text, ctx.tools.signatures()) if c.max_calls_per_agent else []
    planned = plan_calls(ctx, calls, await tool_context(ctx, payload["video"]), cap=c.max_calls_per_agent) \
        if calls else []
    call_seed = None if seed is None else seed * 31 + idx + 1
    call_payload = {"turn": rnd, "video": payload["video"], "question": payload["question"], "seed": call_seed,
                    "agent": spec.name}
    outs = await asyncio.gather(*(run_agent_call(actx_, call_payload, call) for call in planned))
    slots = []
    for out in outs:
        slots.extend(out["results"].values())
        records += [dataclasses.replace(r, trainable=r.trainable and not own) for r in out.get("records", [])]
        phases += out.get("phases", [])
    share = _tag(text, "share").lower()
    entry = MemoryEntry(agent=spec.name, round=rnd, plan=_tag(text, "plan"), calls=slots, info=_tag(text, "info"),
                        share=not share.startswith("no"), text=text, latency=time.perf_counter() - t0,
                        prompt_tokens=gen.prompt_tokens, completion_tokens=gen.completion_tokens)
    emit(ctx, MemoryEvent(rnd, entry))
    return {"memory": {f"{rnd}:{idx}": entry}, "records": records, "phases": phases}


def collab_failed(payload: dict, error: NodeError) -> Command:
    """An agent's round failed after its retries: its entry says so, and the round goes on without it."""
    from langgraph.config import get_stream_writer

    rnd, idx = payload["round"], payload["agent"]
    exc = error.error
    why = str(exc) or exc.__class__.__name__
    own = [e for e in payload.get("own") or [] if e.round == rnd]  # cpp: this turn's entry (its tool) keeps its calls
    entry = own[-1].model_copy(update={"error": why}) if own else \
        MemoryEntry(agent=payload.get("name", str(idx)), round=rnd, error=why)
    event = MemoryEvent(rnd, entry)
    get_stream_writer()(event_json(event) if payload.get("json_events") else event)
    return Command(update={"memory": {f"{rnd}:{idx}": entry}}, goto="collab_merge")


async def collab_merge(state: AgentState, runtime: Runtime) -> dict:
    """A round is over (every agent wrote its entry): count it."""
    return {"round": state.get("round", 0) + 1}


async def synthesize(state: AgentState, runtime: Runtime) -> dict:
    """The answer, strictly from the memory: the agent's policy as the planner, without frames or tools (``cpp``:
    the consensus or the synthesizer, :func:`cpp_finish`)."""
    ctx = await actx(runtime)
    if ctx.config.collab.protocol == "cpp":
        return await cpp_finish(state, runtime)
    cfg, c = ctx.config, ctx.config.collab
    memory = state.get("memory", {}) or {}
    entries = [memory[k] for k in sorted(memory, key=slot_order)]
    body = (question_text(state["question"], state.get("options"), cfg.layout.mcq_instruction)
            + f"\n\nShared memory:\n{memory_view(entries, c.max_memory_chars)}")
    messages = [{"role": "system", "content": SYNTHESIZER_PROMPT}, {"role": "user", "content": body}]
    t0 = time.perf_counter()
    gen = await generate(ctx, "planner", messages, seeded(cfg.planner_sampling, state.get("seed"), c.turns),
                         prefix=cfg.think_prefix)
    turn = PlannerTurn(turn=c.turns, text=gen.text, reasoning=split_think(gen.text)[0],
                       latency=time.perf_counter() - t0, prompt_tokens=gen.prompt_tokens,
                       completion_tokens=gen.completion_tokens, batch_size=gen.batch_size)
    emit(ctx, PlannerEvent(c.turns, gen.text))
    return {"messages": [*messages, {"role": "assistant", "content": gen.text}], "response": gen.text,
            "records": [GenerationRecord("planner", c.turns, None, gen)], "turns": [turn],
            "phases": [phase("answer", t0, c.turns, detail=gen.timings)]}
