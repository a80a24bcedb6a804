"""VideoChat-M1's collaborative policy planning (CPP): the collaborative mode's default protocol (``collab.protocol:
cpp``; :mod:`paravt_agent.graph.collab.rounds` wires it into the same nodes as the ``rounds`` protocol).

One superstep per turn, every agent concurrently (a ``Send`` each), a barrier between turns::
    turn 0   each agent: PLAN (key info + an ordered tool list)            → runs its first tool
    turn k   each agent: reads its memory buffer and the OTHER AGENTS' OUTPUTS of turn k, DECIDES continue() or
             add tool (the new call runs next) and updates its key info    → runs its next tool,
             or, its plan done (or ``collab.turns`` tool steps taken), ANSWERS (<think> reason, <answer>)
    end      the consensus answer (a majority of the pool, ``collab.consensus``) with a REASON SUMMARY over the
             agents that gave it; without a consensus the SYNTHESIZER answers from every agent's memory

The memory buffer is keyed by agent (:meth:`~paravt_agent.trajectory.Trace.memory_buffer`): plan, key info, each
turn's tool, output and decision, the agent's answer and reason (VideoChat-M1, Appendix A.2). Every model call of
an agent is a record of role ``agent:<name>`` (its turn, index = its place in the pool); its tool calls' records
(a crop's summary, a model-backed tool's calls) carry the same turn and index, so multi-agent RL credits each
agent with its own calls. A text-only agent (``vision: false``) sees no frames: its tools do (they ask the served
policy). Agent dropout (``collab.dropout``, sampled runs only) takes agents out of the communication per episode.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import string
import time

from langgraph.runtime import Runtime
from langgraph.types import Send

from paravt_agent.graph.calls import plan_calls, run_agent_call
from paravt_agent.graph.context import tool_schemas
from paravt_agent.graph.frames import refs_of
from paravt_agent.graph.runtime import actx, ctx_of, emit, generate, phase, seeded, tool_context
from paravt_agent.graph.state import AgentState, slot_order
from paravt_agent.prompts import question_text
from paravt_agent.protocol import (
    extract_answer,
    extract_choice,
    neutralize,
    parse_span,
    parse_tool_calls,
    split_think,
)
from paravt_agent.trajectory import MemoryEntry, PlannerTurn, SubAgentRecord, agent_view
from paravt_agent.types import GenerationRecord, MemoryEvent, PlannerEvent

__all__ = ["ANSWER_PROMPT", "DECISION_PROMPT", "PLAN_PROMPT", "SUMMARY_PROMPT", "SYNTHESIZER_PROMPT", "agent_view",
           "answer_key", "answers_agree", "consensus", "cpp_agent", "cpp_finish", "cpp_route", "dropped_agents",
           "memory_views"]

#: VideoChat-M1's "Prompt for Policy Generation", for this runtime's tools
PLAN_PROMPT = """You are {name}, one of {n} video understanding agents answering a question together. Analyze the \
question and select the optimal combination of tools to answer it accurately.
1. Think in <think> </think>.
2. Write the key information necessary for the reasoning process in <info> </info>.
3. Write your plan: one or more tools (at most {k}), in the order they should run, as <tool_call> blocks. One runs per \
turn; after each, you read what every agent found and may add a tool.
{focus}
# Tools
<tools>
{tools}
</tools>"""

#: VideoChat-M1's "Prompt for Policy Communication"
DECISION_PROMPT = """You are {name}, a strategic planning assistant of a team of video agents. Your sole \
responsibility is to evaluate the current execution state and determine the immediate next step. Think in <think> \
</think>, then choose exactly ONE action:
- continue(): proceed with the next tool of your remaining plan (with none left: finish and answer). Apply this when \
the other agents offer no constructive alternative and your plan remains valid.
- add tool: ONLY if your plan is flawed and needs another tool. Write add tool, the call in a <tool_call> block (it \
runs next), and the key information necessary for the reasoning process in <info> </info>.
Tools: {tools}"""

#: VideoChat-M1's "Prompt for Answering the Question"
ANSWER_PROMPT = """You are {name}. Your plan is done: answer the question strictly from the memory below (your own \
memory buffer and the other agents' outputs); do not assume anything it does not say. Think in <think> </think> (your \
reason), then give your answer in <answer> </answer>."""

#: VideoChat-M1's "Prompt for Reason Summary" (the consensus answer is the runtime's count of the agents' answers)
SUMMARY_PROMPT = """The agents below agreed on the final answer to a question about a video. Synthesize their reasons \
into one concise paragraph that reflects the sequence of events and the core logic. Reply with the summary only."""

#: the answer without a consensus: the memory of all agents (VideoChat-M1: "a summarized answer using the memory of
#: all agents")
SYNTHESIZER_PROMPT = """You answer a question about a video from the shared memory of agents who inspected it. Use \
only what the memory says; do not assume anything it does not say. Think in <think> </think>, then give the final \
answer in <answer> </answer>."""

_TAG = {t: re.compile(rf"<{t}>(.*?)(?:</{t}>|\Z)", re.S) for t in ("info",)}
_FRAME_LABEL = re.compile(r"^<[\d.]+ seconds>$")
_CONTINUE = re.compile(r"\bcontinue\s*\(\s*\)", re.I)
_ADD = re.compile(r"\badd[ _]?tool\b", re.I)


def _info(text: str) -> str:
    m = _TAG["info"].search(split_think(text)[1] or text)
    return m.group(1).strip() if m else ""


def _clip(text: str, limit: int = 600) -> str:
    text = neutralize(" ".join(text.split()))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def memory_views(buffers: dict[str, list[MemoryEntry]], limit: int) -> str:
    """Several agents' buffers within ``limit`` characters (the last ones cut first)."""
    text = "\n".join(agent_view(n, es) for n, es in buffers.items()) if buffers else "(none)"
    return text if len(text) <= limit else text[: limit - 24] + " ... [memory cut]"


def _buffers(state: AgentState) -> dict[str, list[MemoryEntry]]:
    memory = state.get("memory", {}) or {}
    out: dict[str, list[MemoryEntry]] = {}
    for k in sorted(memory, key=slot_order):
        out.setdefault(memory[k].agent, []).append(memory[k])
    return out


def dropped_agents(state: AgentState, collab) -> set[str]:
    """The agents agent dropout takes out of this episode's communication: each with probability
    ``collab.dropout``, drawn from the run's seed (the same at every turn), only where the agents sample."""
    if not collab.dropout or collab.agent_sampling.temperature <= 0:
        return set()
    key = state.get("seed") if state.get("seed") is not None else state.get("started")
    return {a.name for i, a in enumerate(collab.agents)
            if random.Random(f"{key}:dropout:{i}").random() < collab.dropout}


def _done(entries: list[MemoryEntry]) -> bool:
    return any(e.answer is not None or e.error for e in entries)


def cpp_route(state: AgentState, runtime: Runtime):
    """The next turn's ``Send`` per agent still working, or the answer once every agent has answered."""
    ctx = ctx_of(runtime)
    c, rnd = ctx.config.collab, state.get("round", 0)
    buffers = _buffers(state)
    working = [(i, a) for i, a in enumerate(c.agents) if not _done(buffers.get(a.name, []))]
    if not working or rnd > c.turns:
        return "synthesize"
    dropped = dropped_agents(state, c)
    view = _overview(state)
    sends = []
    for i, a in working:
        peers = {} if a.name in dropped else {n: es for n, es in buffers.items() if n != a.name and n not in dropped}
        sends.append(Send("collab_agent", {
            "round": rnd, "agent": i, "name": a.name, "video": state["video"], "question": state["question"],
            "options": state.get("options"), "seed": state.get("seed"), "own": buffers.get(a.name, []),
            "peers": peers, "view": view if a.vision else [p for p in view if p.get("type") == "text"
                                                           and not _FRAME_LABEL.match(p["text"])],
            "dropped": a.name in dropped, "json_events": ctx.json_events}))
    return sends


def _overview(state: AgentState) -> list:
    first = next(m for m in state["messages"] if m["role"] == "user")
    content = first["content"]
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


async def cpp_agent(payload: dict, runtime: Runtime) -> dict:
    """One agent's turn: its plan (turn 0) or its decision on what every agent found (turn k), then its next tool,
    or its answer when its plan is done or the turns are used up."""
    ctx = await actx(runtime)
    turn = _AgentTurn(ctx, payload, await tool_context(ctx, payload["video"]))
    spec = turn.spec
    if spec.model is not None:
        turn.own_ctx = dataclasses.replace(ctx, policy=await ctx.apolicy_for(spec.model))
    entry = await (turn.plan() if turn.k == 0 else turn.decide())
    c, k, i = ctx.config.collab, turn.k, turn.i
    if entry.pending and k < c.turns:  # the next tool of the plan runs now (its records: this agent's turn k + 1)
        updates = {f"{k}:{i}": entry, f"{k + 1}:{i}": await turn.step(entry)}
    else:  # the plan is done (or the turns are used up): the agent's own answer
        updates = {f"{k}:{i}": await turn.answer(entry)}
    first = min(updates, key=slot_order)
    updates[first] = updates[first].model_copy(update={
        "latency": updates[first].latency + time.perf_counter() - turn.t0,
        "prompt_tokens": updates[first].prompt_tokens + turn.tokens[0],
        "completion_tokens": updates[first].completion_tokens + turn.tokens[1]})
    for e in updates.values():
        emit(ctx, MemoryEvent(e.round, e))
    return {"memory": updates, "records": turn.records, "phases": turn.phases}


class _AgentTurn:
    """What one agent's turn shares: its model (its own, or the served policy), its tools' context (a text-only
    agent's tools see through the served policy), the question, and the records, phases and tokens it produces."""

    def __init__(self, ctx, payload: dict, tctx):
        self.ctx, self.payload, self.tctx = ctx, payload, tctx
        self.cfg, self.c = ctx.config, ctx.config.collab
        self.k, self.i, self.name = payload["round"], payload["agent"], payload["name"]
        self.spec = self.c.agents[self.i]
        self.own_ctx = ctx
        self.seed, self.t0 = payload.get("seed"), time.perf_counter()
        self.records, self.phases, self.tokens = [], [], [0, 0]
        self.question = question_text(payload["question"], payload.get("options"), self.cfg.layout.mcq_instruction)
        self.signatures = ctx.tools.signatures()

    @property
    def own_model(self) -> bool:
        return self.spec.model is not None

    async def ask(self, system: str, user: list[dict], turn: int, slot: int) -> str:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        t1 = time.perf_counter()
        role = f"agent:{self.name}"
        gen = await generate(self.own_ctx, role, messages, seeded(self.c.agent_sampling, self.seed, turn, slot),
                             prefix=self.cfg.think_prefix)
        self.phases.append(phase("agent", t1, turn, self.i, detail=gen.timings))
        self.records.append(GenerationRecord(role, turn, self.i, gen, image_refs=refs_of(messages),
                                             trainable=not self.own_model))
        self.tokens[0] += gen.prompt_tokens
        self.tokens[1] += gen.completion_tokens
        return gen.text

    def planned(self, raw: str):
        calls = parse_tool_calls(raw, self.signatures)[:1]
        return _plan(self.ctx, calls, self.tctx, self.i) if calls else None

    async def plan(self) -> MemoryEntry:
        """Turn 0: key info and the ordered tool list (a plan that lists no tool breaks the protocol)."""
        cfg, c, spec = self.cfg, self.c, self.spec
        schemas = "\n".join(json.dumps(s, ensure_ascii=False) for s in tool_schemas(cfg, self.ctx.tools))
        system = PLAN_PROMPT.format(name=self.name, n=len(c.agents), k=max(1, c.max_calls_per_agent), tools=schemas,
                                    focus=f"Your focus: {spec.focus}\n" if spec.focus else "")
        text = await self.ask(system, [*self.payload["view"], {"type": "text", "text": "\nWrite your plan."}], 0,
                              100 + self.i)
        calls = parse_tool_calls(text, self.signatures)[: max(1, c.max_calls_per_agent)]
        labels = [p.label if p.ok else (p.raw or "invalid call") for p in
                  (_plan(self.ctx, [call], self.tctx, self.i) for call in calls)]
        return MemoryEntry(agent=self.name, round=0, plan=", ".join(labels), info=_info(text), text=text,
                           pending=[call.raw for call in calls], dropped=self.payload["dropped"], replies=1,
                           invalid=0 if any(call.ok for call in calls) else 1)

    async def decide(self) -> MemoryEntry:
        """Turn k: continue() or add tool, on the memory buffer and the other agents' outputs of this turn."""
        c, entry, own = self.c, self.payload["own"][-1], self.payload["own"]
        remaining = ", ".join(p.label if p is not None and p.ok else "invalid call"
                              for p in (self.planned(r) for r in entry.pending)) or "none"
        user = (f"Original question: {self.question}\n\n"
                f"Memory buffer:\n{memory_views({self.name: own}, c.max_memory_chars)}"
                f"\n\nOther agents' output:\n{memory_views(self.payload['peers'], c.max_memory_chars)}\n\n"
                f"Remaining plan: {remaining}")
        tool_names = ", ".join(s["function"]["name"] for s in tool_schemas(self.cfg, self.ctx.tools))
        text = await self.ask(DECISION_PROMPT.format(name=self.name, tools=tool_names),
                              [{"type": "text", "text": user}], self.k, 100 + self.i)
        body = split_think(text)[1] or text
        added = [call for call in parse_tool_calls(body, self.signatures) if call.ok][:1]
        pending, invalid = list(entry.pending), 0
        if added and _ADD.search(body):
            decision = f"add tool {_plan(self.ctx, added, self.tctx, self.i).label}"
            pending = [added[0].raw, *pending]
        elif _CONTINUE.search(body) and not added:
            decision = "continue()"
        else:
            decision, invalid = f"(neither continue() nor add tool) {_clip(body, 120)}", 1
        return entry.model_copy(update={"decision": decision, "pending": pending, "text": text,
                                        "info": _info(text) or entry.info, "replies": entry.replies + 1,
                                        "invalid": entry.invalid + invalid})

    async def step(self, entry: MemoryEntry) -> MemoryEntry:
        """The plan's next tool, run as a planner's call is; its records carry this agent's place."""
        k, i, raw = self.k, self.i, entry.pending[0]
        step = MemoryEntry(agent=self.name, round=k + 1, pending=entry.pending[1:], info=entry.info,
                           dropped=entry.dropped)
        planned = self.planned(raw)
        if planned is None:
            step.calls = [SubAgentRecord(index=i, raw=raw, label="invalid call", error="not a tool call",
                                         agent=self.name)]
            return step
        tools_ctx = self.own_ctx if self.own_model and self.spec.vision else self.ctx
        payload = {"turn": k + 1, "video": self.payload["video"], "question": self.payload["question"],
                   "seed": None if self.seed is None else self.seed * 31 + i + 1, "agent": self.name}
        out = await run_agent_call(dataclasses.replace(tools_ctx, tool_context=self.tctx), payload, planned)
        step.calls = list(out["results"].values())
        trainable = tools_ctx is self.ctx  # the served policy's calls (a text-only agent's tools included)
        self.records += [dataclasses.replace(r, trainable=r.trainable and trainable) for r in out.get("records", [])]
        self.phases += out.get("phases", [])
        return step

    async def answer(self, entry: MemoryEntry) -> MemoryEntry:
        """The agent's own answer from its memory buffer and the other agents' outputs."""
        c = self.c
        own = [*(e for e in self.payload["own"] if e.round != entry.round), entry]
        user = (f"{self.question}\n\nYour memory buffer:\n{memory_views({self.name: own}, c.max_memory_chars)}\n\n"
                f"Other agents' output:\n{memory_views(self.payload['peers'], c.max_memory_chars)}")
        text = await self.ask(ANSWER_PROMPT.format(name=self.name), [{"type": "text", "text": user}], self.k,
                              200 + self.i)
        answer = extract_answer(text) if "<answer>" in text else ""
        return entry.model_copy(update={"answer": answer, "reason": split_think(text)[0], "answer_text": text,
                                        "replies": entry.replies + 1, "invalid": entry.invalid + (not answer.strip())})


def _plan(ctx, calls: list, tctx, index: int):
    """A parsed call validated in the registry as the agent's call (its slot index: the agent's place)."""
    (planned,) = plan_calls(ctx, calls, tctx, cap=1)
    return dataclasses.replace(planned, index=index)


# --------------------------------------------------------------------------- the answer


def _words(text: str) -> str:
    return " ".join(text.lower().translate(str.maketrans("", "", string.punctuation)).split())


def answer_key(text: str, options) -> tuple | None:
    """What an answer says, for a vote: its option letter (multiple choice), its span (a grounding answer) or its
    words; None when it says nothing a vote can count."""
    if not text or not text.strip():
        return None
    if options:
        letter = extract_choice(text, options)
        return ("choice", letter) if letter else None
    span = parse_span(text)
    return ("span", tuple(sorted(span))) if span else ("words", _words(text))


def answers_agree(a: tuple | None, b: tuple | None) -> bool:
    """Two answer keys agree: the same option, the same words, or spans overlapping with IoU >= 0.5."""
    if a is None or b is None or a[0] != b[0]:
        return False
    if a[0] != "span":
        return a[1] == b[1]
    (p, q), (r, s) = a[1], b[1]
    union = max(q, s) - min(p, r)
    return union > 0 and max(0.0, min(q, s) - max(p, r)) / union >= 0.5


def consensus(answers: dict[str, str | None], options, pool: int, rule: str = "majority") -> list[str]:
    """The agents whose answers make the consensus (the largest group of agreeing answers, the earliest of equal
    ones), or [] when that group is not a strict majority of the ``pool`` (``unanimous``: the whole pool)."""
    keys = {n: answer_key(a or "", options) for n, a in answers.items()}
    best: list[str] = []
    for key in keys.values():
        group = [m for m, other in keys.items() if answers_agree(key, other)]
        if len(group) > len(best):
            best = group
    need = pool if rule == "unanimous" else pool // 2 + 1
    return best if len(best) >= need else []


async def cpp_finish(state: AgentState, runtime: Runtime) -> dict:
    """The consensus answer with a reason summary over the agreeing agents, else the synthesizer's answer from
    every agent's memory."""
    ctx = await actx(runtime)
    cfg, c = ctx.config, ctx.config.collab
    buffers = _buffers(state)
    final = {n: next((e for e in reversed(es) if e.answer is not None), None) for n, es in buffers.items()}
    answers = {n: e.answer if e is not None else None for n, e in final.items()}
    agreed = consensus(answers, state.get("options"), len(c.agents), c.consensus)
    question = question_text(state["question"], state.get("options"), cfg.layout.mcq_instruction)
    turn, t0, records = state.get("round", 0), time.perf_counter(), []  # after the agents' last turn
    if agreed:
        reasons = "\n".join(f"{n}: {_clip(final[n].reason or final[n].answer or '')}" for n in agreed)
        if c.reason_summary:
            messages = [{"role": "system", "content": SUMMARY_PROMPT}, {"role": "user", "content":
                        f"{question}\n\nFinal answer: {_clip(answers[agreed[0]])}\n\nReasons:\n{reasons}"}]
            gen = await generate(ctx, "planner", messages, seeded(cfg.planner_sampling, state.get("seed"), turn))
            records.append(GenerationRecord("planner", turn, None, gen))
            reason = split_think(gen.text)[1].strip() or gen.text.strip()
        else:
            messages, gen, reason = [], None, " ".join(reasons.splitlines())
        response = f"<think>\n{reason}</think>\n<answer>{answers[agreed[0]]}</answer>"
    else:
        body = question + "\n\nShared memory:\n" + memory_views(buffers, c.max_memory_chars)
        messages = [{"role": "system", "content": SYNTHESIZER_PROMPT}, {"role": "user", "content": body}]
        gen = await generate(ctx, "planner", messages, seeded(cfg.planner_sampling, state.get("seed"), turn),
                             prefix=cfg.think_prefix)
        records.append(GenerationRecord("planner", turn, None, gen))
        response = gen.text
    rec = PlannerTurn(turn=turn, text=response, reasoning=split_think(response)[0], consensus=agreed,
                      latency=time.perf_counter() - t0, prompt_tokens=gen.prompt_tokens if gen else 0,
                      completion_tokens=gen.completion_tokens if gen else 0, batch_size=gen.batch_size if gen else 1)
    emit(ctx, PlannerEvent(turn, response))
    return {"messages": [*messages, {"role": "assistant", "content": response}], "response": response,
            "records": records, "turns": [rec], "phases": [phase("answer", t0, turn)]}
