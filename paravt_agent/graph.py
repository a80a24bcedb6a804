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
  text (``runtime_error``: the runtime failed, not the model's call) and routes on
  to ``aggregate``, so one failure — or every call of a turn failing — never loses
  the others, the trace or the planner's next turn.
* ``results`` is a reducer-merged dict keyed by ``(turn, call index)``;
  ``aggregate`` writes the turn's results in call order, laid out by the config's
  :class:`~paravt_agent.config.Layout` (:func:`paravt_agent.prompts.tool_response_messages`):
  by default ONE ``<tool_response>`` user turn holding every slot.

Evidence modes (``layout.evidence``): ``summary`` (a sub-agent sharing the policy
summarises a crop into text: ParaVT) or ``frames`` (no sub-agent: the crop's frames
go to the planner inside its tool response, keyed in ``evidence``).

Every model call is recorded as a :class:`~paravt_agent.types.GenerationRecord`
(state key ``records``); the stream writer emits the typed events of
:mod:`paravt_agent.types` (``PlannerEvent``, ``SubAgentEvent``).

Dispatch modes: ``parallel`` (all valid calls of a turn), ``sequential`` (one
call per turn: the rest of the turn gets "not run" slots), ``none`` (no tools).
``max_turns`` bounds tool turns in every mode; past it ``layout.final_turn`` says
what happens: ``ask`` (a response that still calls tools is followed by the final
prompt), ``after_tools`` (the final prompt follows the last tool turn's results)
or ``none`` (the episode ends with that response).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, TypedDict

from langgraph.config import get_stream_writer
from langgraph.errors import NodeError
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, RetryPolicy, Send

from paravt_agent.config import AgentConfig
from paravt_agent.errors import PolicyError, ToolError
from paravt_agent.policy.base import Policy, images_of
from paravt_agent.prompts import (
    SUBAGENT_SYSTEM_PROMPT,
    final_prompt,
    layout_subagent_messages,
    tool_response_messages,
)
from paravt_agent.protocol import parse_tool_calls, split_think, subagent_report
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
    evidence: Annotated[dict, _merge]  # (turn, index) -> (frames, timestamps): frames-mode results
    final: bool  # the next planner response is the final one (layout.final_turn == "after_tools")
    turns: Annotated[list, _append]  # PlannerTurn records
    records: Annotated[list, _append]  # GenerationRecord of every model call
    seed: int | None  # per-rollout sampling seed (each call derives its own); None = the config's
    response: str | None  # the planner's final response
    phases: Annotated[list, _append]  # timed steps: dicts with name, start (perf_counter), seconds, turn, index


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
    layout = config.layout

    def final_sampling(state: AgentState) -> Sampling:
        mcq = bool(state.get("options"))
        cap_tokens = layout.final_max_new_tokens if mcq else (layout.final_max_new_tokens_open
                                                              or layout.final_max_new_tokens)
        s = config.planner_sampling
        return s.model_copy(update={"max_new_tokens": cap_tokens}) if cap_tokens else s

    async def ask_planner(messages: list[dict], state: AgentState, turn: int, phases: list,
                          sampling: Sampling | None = None) -> tuple[Generation, PlannerTurn]:
        t0 = time.perf_counter()
        gen = await policy.generate(messages, _seeded(sampling or config.planner_sampling, state.get("seed"), turn),
                                    prefix=config.think_prefix, continuation=state.get("continuation"))
        record = PlannerTurn(turn=turn, text=gen.text, reasoning=split_think(gen.text)[0],
                             latency=time.perf_counter() - t0, prompt_tokens=gen.prompt_tokens,
                             completion_tokens=gen.completion_tokens, batch_size=gen.batch_size)
        phases.append(_phase("planner", t0, turn, detail=gen.timings))
        return gen, record

    async def planner(state: AgentState) -> dict:
        writer = get_stream_writer()
        turn = state.get("turn", 0)
        messages = list(state["messages"])
        forced_now = bool(state.get("final"))
        phases: list[dict] = []
        gen, record = await ask_planner(messages, state, turn, phases, final_sampling(state) if forced_now else None)
        record.forced_final = forced_now
        records = [GenerationRecord("planner", turn, None, gen, images_of(messages))]
        messages = [*messages, {"role": "assistant", "content": gen.text}]
        continuation = Continuation(len(messages) - 1, gen)
        calls = parse_tool_calls(gen.text, signatures) if config.mode != "none" and not forced_now else []
        if calls and turn >= config.max_turns and layout.final_turn == "none":
            writer(PlannerEvent(turn, gen.text))  # bound reached: the episode ends with this response
            return {"records": records, "messages": messages, "turns": [record], "response": gen.text,
                    "calls": [], "continuation": continuation, "phases": _answered(phases)}
        if calls and turn >= config.max_turns:
            # bound reached: ask for the final answer once more, without tools
            writer(PlannerEvent(turn, gen.text))
            messages = [*messages, {"role": "user", "content": final_prompt(layout, bool(state.get("options")))}]
            final, forced = await ask_planner(messages, {**state, "continuation": continuation}, turn + 1, phases,
                                              final_sampling(state))
            forced.forced_final = True
            records.append(GenerationRecord("planner", turn + 1, None, final, images_of(messages)))
            messages = [*messages, {"role": "assistant", "content": final.text}]
            writer(PlannerEvent(turn + 1, final.text, forced_final=True))
            return {"records": records, "messages": messages, "turns": [record, forced], "response": final.text,
                    "calls": [], "continuation": Continuation(len(messages) - 1, final), "phases": _answered(phases)}
        update: dict[str, Any] = {"records": records, "messages": messages, "turns": [record],
                                  "continuation": continuation, "phases": phases}
        if not calls:
            writer(PlannerEvent(turn, gen.text, forced_final=forced_now))
            return {**update, "response": gen.text, "calls": [], "phases": _answered(phases)}
        prepared = registry.prepare(calls, state["ctx"], max_calls=cap, drop_extra=layout.extra_calls == "drop")
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
        phases = [_phase("crop", t0, turn, p.index)]
        rec = SubAgentRecord(
            index=p.index, raw=p.call.raw, name=p.call.name, arguments=dict(p.call.arguments), label=p.label,
            window=result.window, frame_timestamps=list(result.timestamps), warnings=list(result.warnings),
        )
        update: dict[str, Any] = {}
        if result.is_visual and layout.evidence == "frames":
            window = result.window or (result.timestamps[0], result.timestamps[-1])
            rec.evidence = "frames"
            rec.summary = layout.evidence_text.format(n=len(result.timestamps), start=window[0], end=window[1])
            update["evidence"] = {(turn, p.index): (result.frames, list(result.timestamps))}
        elif result.is_visual:
            question = payload["question"] if config.question_to_subagents else None
            window = result.window or (result.timestamps[0], result.timestamps[-1])
            msgs = layout_subagent_messages(layout, result.frames, result.timestamps, window, question,
                                            system=sub_system)
            t_gen = time.perf_counter()
            gen = await policy.generate(msgs, _seeded(config.subagent_sampling, payload.get("seed"), turn,
                                                      p.index + 1))
            phases.append(_phase("subagent", t_gen, turn, p.index, detail=gen.timings))
            rec.summary = subagent_report(gen.text, config.subagent_report)
            if rec.summary != gen.text.strip():
                rec.reply = gen.text.strip()
            rec.prompt_tokens, rec.completion_tokens = gen.prompt_tokens, gen.completion_tokens
            rec.batch_size = gen.batch_size
            update["records"] = [GenerationRecord("subagent", turn, p.index, gen, images_of(msgs))]
        else:
            rec.evidence = "text"
            rec.summary = result.text
        rec.latency = time.perf_counter() - t0
        get_stream_writer()(SubAgentEvent(turn, rec))
        return {**update, "results": {(turn, p.index): rec}, "phases": phases}

    def subagent_failed(payload: dict, error: NodeError) -> Command:
        p: PreparedCall = payload["call"]
        exc = error.error
        msg = str(exc) or exc.__class__.__name__
        rec = SubAgentRecord(index=p.index, raw=p.call.raw, name=p.call.name, arguments=dict(p.call.arguments),
                             label=p.label, window=_window(p), error=msg,
                             runtime_error=not isinstance(exc, ToolError))  # a tool refusing the call: the model's
        get_stream_writer()(SubAgentEvent(payload["turn"], rec))
        # the handler runs as its own node: without a destination the turn would never be aggregated when no
        # sub-agent of it succeeded (LangGraph runs ``aggregate`` once per step however many ask for it)
        return Command(update={"results": {(payload["turn"], p.index): rec}}, goto="aggregate")

    async def aggregate(state: AgentState) -> dict:
        t0 = time.perf_counter()
        turn = state.get("turn", 0)
        results = state.get("results", {})
        evidence = state.get("evidence", {}) or {}
        slots = []
        for p in state["calls"]:
            r = results[(turn, p.index)]
            slot = {"label": r.label or r.name or "call", "text": r.slot_text}
            if r.error and layout.tool_response != "turn":
                slot["text"] = _error_text(layout.error_text, r.error, r.window)
            if (turn, p.index) in evidence and not r.error:
                slot["frames"], slot["timestamps"] = evidence[(turn, p.index)]
            slots.append(slot)
        messages = [*state["messages"], *tool_response_messages(layout, slots)]
        update: dict[str, Any] = {"turn": turn + 1}
        if layout.final_turn == "after_tools" and turn + 1 >= config.max_turns:
            messages.append({"role": "user", "content": final_prompt(layout, bool(state.get("options")))})
            update["final"] = True
        return {**update, "messages": messages, "phases": [_phase("aggregate", t0, turn)]}

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


def _phase(name: str, t0: float, turn: int | None = None, index: int | None = None,
           detail: dict | None = None) -> dict:
    """A timed step from ``t0`` (``time.perf_counter()``) to now."""
    return {"name": name, "start": t0, "seconds": time.perf_counter() - t0, "turn": turn, "index": index,
            "detail": dict(detail or {})}


def _answered(phases: list[dict]) -> list[dict]:
    """The planner call that gave the final response is the ``answer`` phase."""
    if phases and phases[-1]["name"] == "planner":
        phases[-1] = {**phases[-1], "name": "answer"}
    return phases


def _error_text(template: str, error: str, window: tuple[float, float] | None) -> str:
    """A failed call's text under a layout's ``error_text`` (``{error}``, ``{start}``, ``{end}``)."""
    try:
        start, end = window if window is not None else (None, None)
        if start is None and ("{start" in template or "{end" in template):
            raise KeyError("start")
        return template.format(error=error, start=start, end=end)
    except (KeyError, ValueError, IndexError):
        return f"[Error: {error}]"


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
