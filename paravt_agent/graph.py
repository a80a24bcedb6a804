"""The agent as a LangGraph graph: planner → ``Send`` × K sub-agents → aggregator → planner.

::

    START → planner ─┬─ Send("subagent", call 1) ─┐
                     ├─ …                         ├─→ aggregate → planner → … → END
                     └─ Send("subagent", call K) ─┘

* ``planner`` asks the policy for one response (pinned to the think prefix; a
  later turn continues the earlier turn's exact tokens, :class:`~paravt_agent.types.Continuation`),
  parses its tool calls with :mod:`paravt_agent.protocol` and validates them in
  :meth:`tools.ToolRegistry.prepare` (invalid calls get their error slot here).
* ``subagent`` runs one tool; visual evidence is summarised by the policy.
  LangGraph's own ``RetryPolicy`` and ``timeout`` apply per attempt; when the
  last attempt fails, the node's ``error_handler`` fills the slot with an error
  text, so one failure never loses the others or the trace.
* ``results`` is a reducer-merged dict keyed by ``(turn, call index)``;
  ``aggregate`` writes ONE ``<tool_response>`` user turn holding every slot of
  the turn, in call order (:func:`paravt_agent.prompts.tool_response_message`).

Every model call is recorded as a :class:`~paravt_agent.types.GenerationRecord`
(state key ``records``); the stream writer emits the typed events of
:mod:`paravt_agent.types` (``PlannerEvent``, ``SubAgentEvent``).

Dispatch modes: ``parallel`` (all valid calls of a turn), ``sequential`` (one
call per turn: the rest of the turn gets "not run" slots), ``none`` (no tools).
``max_turns`` bounds tool turns in every mode; past it the planner is asked for
its final answer.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, TypedDict

from langgraph.config import get_stream_writer
from langgraph.errors import NodeError
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, RetryPolicy, Send

from paravt_agent.config import AgentConfig
from paravt_agent.errors import PolicyError
from paravt_agent.policy.base import Policy, images_of
from paravt_agent.prompts import (
    FINAL_ANSWER_PROMPT,
    SUBAGENT_SYSTEM_PROMPT,
    subagent_messages,
    tool_response_message,
)
from paravt_agent.protocol import parse_tool_calls, split_think
from paravt_agent.trajectory import PlannerTurn, SubAgentRecord
from paravt_agent.types import (
    CallInfo,
    Continuation,
    Generation,
    GenerationRecord,
    PlannerEvent,
    Sampling,
    SubAgentEvent,
)
from tools import PreparedCall, ToolContext, ToolRegistry

__all__ = ["AgentState", "build_graph"]


def _merge(left: dict | None, right: dict | None) -> dict:
    return {**(left or {}), **(right or {})}


def _append(left: list | None, right: list | None) -> list:
    return [*(left or []), *(right or [])]


class AgentState(TypedDict, total=False):
    question: str
    options: list[str] | None
    ctx: ToolContext
    messages: list[dict]  # the planner's conversation, neutral message layout
    continuation: Continuation | None  # the planner's last turn, token for token
    turn: int  # tool turns completed
    calls: list[PreparedCall]  # the current turn's calls
    results: Annotated[dict, _merge]  # (turn, index) -> SubAgentRecord
    turns: Annotated[list, _append]  # PlannerTurn records
    records: Annotated[list, _append]  # GenerationRecord of every model call
    seed: int | None  # per-rollout sampling seed (each call derives its own); None = the config's
    response: str | None  # the planner's final response


def _transient(exc: BaseException) -> bool:
    """Retry timeouts and endpoint failures; never bad input."""
    from langgraph.errors import NodeTimeoutError

    return isinstance(exc, NodeTimeoutError | TimeoutError | ConnectionError) or (
        isinstance(exc, PolicyError) and exc.transient
    )


def build_graph(policy: Policy, registry: ToolRegistry, config: AgentConfig):
    """Compile the agent graph for one policy, tool set and config."""
    cap = 1 if config.mode == "sequential" else config.max_calls_per_turn
    signatures = registry.signatures()
    sub_system = config.subagent_prompt or SUBAGENT_SYSTEM_PROMPT

    async def ask_planner(messages: list[dict], state: AgentState, turn: int) -> tuple[Generation, PlannerTurn]:
        t0 = time.perf_counter()
        gen = await policy.generate(messages, _seeded(config.planner_sampling, state.get("seed"), turn),
                                    prefix=config.think_prefix, continuation=state.get("continuation"))
        record = PlannerTurn(turn=turn, text=gen.text, reasoning=split_think(gen.text)[0],
                             latency=time.perf_counter() - t0, prompt_tokens=gen.prompt_tokens,
                             completion_tokens=gen.completion_tokens)
        return gen, record

    async def planner(state: AgentState) -> dict:
        writer = get_stream_writer()
        turn = state.get("turn", 0)
        messages = list(state["messages"])
        gen, record = await ask_planner(messages, state, turn)
        records = [GenerationRecord("planner", turn, None, gen, images_of(messages))]
        messages = [*messages, {"role": "assistant", "content": gen.text}]
        continuation = Continuation(len(messages) - 1, gen)
        calls = parse_tool_calls(gen.text, signatures) if config.mode != "none" else []
        if calls and turn >= config.max_turns:
            # bound reached: ask for the final answer once more, without tools
            writer(PlannerEvent(turn, gen.text))
            messages = [*messages, {"role": "user", "content": FINAL_ANSWER_PROMPT}]
            final, forced = await ask_planner(messages, {**state, "continuation": continuation}, turn + 1)
            forced.forced_final = True
            records.append(GenerationRecord("planner", turn + 1, None, final, images_of(messages)))
            messages = [*messages, {"role": "assistant", "content": final.text}]
            writer(PlannerEvent(turn + 1, final.text, forced_final=True))
            return {"records": records, "messages": messages, "turns": [record, forced], "response": final.text,
                    "calls": [], "continuation": Continuation(len(messages) - 1, final)}
        update: dict[str, Any] = {"records": records, "messages": messages, "turns": [record],
                                  "continuation": continuation}
        if not calls:
            writer(PlannerEvent(turn, gen.text))
            return {**update, "response": gen.text, "calls": []}
        prepared = registry.prepare(calls, state["ctx"], max_calls=cap)
        errors = {
            (turn, p.index): SubAgentRecord(index=p.index, raw=p.call.raw, name=getattr(p.call, "name", None),
                                            arguments=getattr(p.call, "arguments", {}), label=p.label, error=p.error)
            for p in prepared
            if not p.ok
        }
        writer(PlannerEvent(turn, gen.text, [CallInfo(p.index, p.label, _window(p), p.error) for p in prepared]))
        for rec in errors.values():
            writer(SubAgentEvent(turn, rec))
        return {**update, "calls": prepared, "results": errors}

    def route(state: AgentState):
        if state.get("response") is not None:
            return END
        turn = state.get("turn", 0)
        sends = [
            Send("subagent", {"turn": turn, "call": p, "ctx": state["ctx"], "question": state["question"],
                              "seed": state.get("seed")})
            for p in state["calls"]
            if p.ok
        ]
        return sends or "aggregate"

    async def subagent(payload: dict) -> dict:
        p: PreparedCall = payload["call"]
        ctx: ToolContext = payload["ctx"]
        turn = payload["turn"]
        t0 = time.perf_counter()
        result = await p.tool.run(p.args, ctx)
        rec = SubAgentRecord(
            index=p.index, raw=p.call.raw, name=p.call.name, arguments=dict(p.call.arguments), label=p.label,
            window=result.window, frame_timestamps=list(result.timestamps), warnings=list(result.warnings),
        )
        update: dict[str, Any] = {}
        if result.is_visual:
            question = payload["question"] if config.question_to_subagents else None
            window = result.window or (result.timestamps[0], result.timestamps[-1])
            msgs = subagent_messages(result.frames, result.timestamps, window, question, system=sub_system)
            gen = await policy.generate(msgs, _seeded(config.subagent_sampling, payload.get("seed"), turn,
                                                      p.index + 1))
            rec.summary = gen.text.strip()
            rec.prompt_tokens, rec.completion_tokens = gen.prompt_tokens, gen.completion_tokens
            update["records"] = [GenerationRecord("subagent", turn, p.index, gen, images_of(msgs))]
        else:
            rec.summary = result.text
        rec.latency = time.perf_counter() - t0
        get_stream_writer()(SubAgentEvent(turn, rec))
        return {**update, "results": {(turn, p.index): rec}}

    def subagent_failed(payload: dict, error: NodeError) -> Command:
        p: PreparedCall = payload["call"]
        exc = error.error
        msg = str(exc) or exc.__class__.__name__
        rec = SubAgentRecord(index=p.index, raw=p.call.raw, name=p.call.name, arguments=dict(p.call.arguments),
                             label=p.label, window=_window(p), error=msg)
        get_stream_writer()(SubAgentEvent(payload["turn"], rec))
        return Command(update={"results": {(payload["turn"], p.index): rec}})

    async def aggregate(state: AgentState) -> dict:
        turn = state.get("turn", 0)
        results = state.get("results", {})
        slots = [results[(turn, p.index)] for p in state["calls"]]
        message = tool_response_message([(r.label or r.name or "call", r.slot_text) for r in slots])
        return {"messages": [*state["messages"], message], "turn": turn + 1}

    retry = RetryPolicy(max_attempts=config.retries + 1, initial_interval=0.5, retry_on=_transient)
    g = StateGraph(AgentState)
    g.add_node("planner", planner, retry_policy=retry, timeout=config.planner_timeout)
    g.add_node(
        "subagent", subagent, retry_policy=retry, timeout=config.subagent_timeout, error_handler=subagent_failed
    )
    g.add_node("aggregate", aggregate)
    g.add_edge(START, "planner")
    g.add_conditional_edges("planner", route, ["subagent", "aggregate", END])
    g.add_edge("subagent", "aggregate")
    g.add_edge("aggregate", "planner")
    return g.compile()


def _seeded(sampling: Sampling, seed: int | None, turn: int, slot: int = 0) -> Sampling:
    """The sampling settings of one call: a rollout seed gives every call its own reproducible seed."""
    if seed is None:
        return sampling
    return sampling.model_copy(update={"seed": (seed * 1_000_003 + turn * 1009 + slot) % 2**31})


def _window(p: PreparedCall) -> tuple[float, float] | None:
    args = p.args
    if args is not None and hasattr(args, "start_time") and getattr(args, "end_time", None) is not None:
        return (float(args.start_time), float(args.end_time))
    return None
