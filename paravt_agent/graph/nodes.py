"""The agent graph's nodes and routing: planner → ``Send`` × K sub-agents → aggregator → planner → … → finish.

::
    START ─┬─ overview ─┐ (LangGraph Server: from a bare question)
           └────────────┴→ planner ─┬─ [review] ─┬─ Send("subagent", call 1) ─┐
                                    │            ├─ …                         ├─→ aggregate → planner …
                                    │            └─ Send("subagent", call K) ─┘
                                    └─ finish → END

**The state is plain data** (:class:`AgentState`): the planner's messages with frames referenced by content key
(:mod:`paravt_agent.graph.frames`), the turns and sub-agent results as the typed records of
:mod:`paravt_agent.trajectory`, the calls as :class:`~paravt_agent.types.PlannedCall`, every model call as a
:class:`~paravt_agent.types.GenerationRecord`. Any checkpointer can save it, so a run with one is durable: a
process that dies after m of K sub-agents finished resumes from its thread and runs only the K − m left
(LangGraph's pending writes). **Live resources** — policy, tool registry, agent config, frame store, the open
video — are the run's :class:`~paravt_agent.graph.context.AgentContext` (``context_schema``), reaching nodes as
``runtime.context``; nothing live is in the state or a ``Send``.

Nodes are the module-level functions below; a config's behaviour is chosen by small named routing functions
(:func:`route_after_planner`, :func:`route_calls`, :func:`past_bound`). :func:`initial_state` is the one way
in (a prepared question → state) and :func:`final_answer` the one way out (state → ``Answer``).

* ``planner`` asks the policy for one response (pinned to the think prefix; a later turn continues the
  earlier turn's exact tokens, :class:`~paravt_agent.types.Continuation`), parses its tool calls and validates
  them in the registry (invalid calls get their error slot here).
* ``review`` (``config.review_windows``) pauses with LangGraph's ``interrupt`` so the planned calls can be
  approved or edited; ``Command(resume=calls)`` continues.
* ``subagent`` runs one tool; visual evidence is summarised by the policy (``layout.evidence: summary``) or
  goes to the planner as frames (``frames``). LangGraph's ``RetryPolicy`` and ``timeout`` apply per attempt;
  after the last, the ``error_handler`` fills the slot with an error (``runtime_error``) and goes on, so one
  failure never loses the others.
* ``aggregate`` writes the turn's results in call order, laid out by the config's layout: by default ONE
  ``<tool_response>`` user turn holding every slot. ``finish`` extracts the answer and writes the output keys.

Dispatch modes: ``parallel`` (all valid calls of a turn), ``sequential`` (one per turn), ``none`` (no tools),
``collaborative`` (a pool of agents sharing a memory, a synthesizer answering from it:
:mod:`paravt_agent.graph.collab`; the nodes ``collab_agent`` → ``collab_merge`` → … → ``synthesize`` → ``finish``).
``max_turns`` bounds tool turns; past it ``layout.final_turn`` says what happens: ``ask`` (a response that still
calls tools is followed by the final prompt), ``after_tools`` (the final prompt follows the last tool turn's
results) or ``none`` (the episode ends with that response).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from langgraph.config import get_stream_writer
from langgraph.errors import NodeError, NodeTimeoutError
from langgraph.runtime import Runtime
from langgraph.types import Command, Send, interrupt

from paravt_agent import telemetry
from paravt_agent.errors import ConfigError, ToolError
from paravt_agent.graph.calls import ToolCallError, plan_calls, run_call, slot_record
from paravt_agent.graph.collab import route_collab
from paravt_agent.graph.context import AgentContext, prepare_input
from paravt_agent.graph.frames import refs_of
from paravt_agent.graph.runtime import (
    actx,
    ctx_of,
    emit,
    event_json,
    generate,
    offload,
    phase,
    seeded,
    tool_context,
)
from paravt_agent.graph.state import (
    AgentState,
    CallTask,
    initial_state,
    slot_key,
    slot_order,
    trace_of,
)
from paravt_agent.prompts import (
    error_slot_text,
    final_prompt,
    tool_response_messages,
)
from paravt_agent.protocol import (
    ToolCall,
    parse_tool_calls,
    split_think,
)
from paravt_agent.trajectory import Phase, PlannerTurn
from paravt_agent.types import (
    CallInfo,
    Continuation,
    GenerationRecord,
    OverviewEvent,
    PlannedCall,
    PlannerEvent,
    Sampling,
    SubAgentEvent,
)

__all__ = ["aggregate", "failure_text", "finish", "overview", "past_bound", "planner", "review", "route_after_planner",
           "route_begin", "route_calls", "route_start", "subagent", "subagent_failed"]

# --------------------------------------------------------------------------- nodes


async def overview(state: AgentState, runtime: Runtime) -> dict:
    """A bare question (LangGraph Server): decode the overview and build the planner's first messages."""
    ctx = await actx(runtime)
    if not state.get("video") or not str(state.get("question") or "").strip():
        raise ConfigError("the input needs `video` (a path or an http(s) URL) and `question`")

    def prepare():
        ctx.check_input(state["question"], state.get("options") or None)  # before any download
        inp = prepare_input(ctx.config, ctx.policy, ctx.tools, ctx.resolve_video(state["video"]), state["question"],
                            state.get("options") or None, state.get("n_frames"))
        return inp, initial_state(inp, ctx, seed=state.get("seed"))

    # LangGraph Server: the question's span opens here (it cannot stay open across nodes), the rest goes under it
    with telemetry.span("invoke_agent paravt", state.get("trace_parent"), {
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "paravt"}, current=False) as root:
        parent = telemetry.traceparent(root) or state.get("trace_parent")
        with telemetry.span("paravt.overview", parent, {"paravt.n_frames": state.get("n_frames")}, current=False):
            inp, first = await asyncio.to_thread(prepare)
    first["trace_parent"] = parent
    ctx.tool_context = inp.context
    emit(ctx, OverviewEvent(list(inp.trace.overview_timestamps), inp.trace.duration))
    return first


def _final_sampling(ctx: AgentContext, state: AgentState) -> Sampling:
    layout = ctx.config.layout
    cap = layout.final_max_new_tokens if state.get("options") else (layout.final_max_new_tokens_open
                                                                     or layout.final_max_new_tokens)
    s = ctx.config.planner_sampling
    return s.model_copy(update={"max_new_tokens": cap}) if cap else s


async def _ask(ctx: AgentContext, state: AgentState, messages: list[dict], turn: int, continuation,
               sampling: Sampling, forced: bool) -> tuple[dict, PlannerTurn, GenerationRecord, Phase]:
    """One planner call: the new assistant message, its turn record, its model-call record and its phase."""
    t0 = time.perf_counter()
    gen = await generate(ctx, "planner", messages, seeded(sampling, state.get("seed"), turn),
                          prefix=ctx.config.think_prefix, continuation=continuation)
    rec = PlannerTurn(turn=turn, text=gen.text, reasoning=split_think(gen.text)[0], forced_final=forced,
                      latency=time.perf_counter() - t0, prompt_tokens=gen.prompt_tokens,
                      completion_tokens=gen.completion_tokens, batch_size=gen.batch_size)
    record = GenerationRecord("planner", turn, None, gen, image_refs=refs_of(messages))
    return {"role": "assistant", "content": gen.text}, rec, record, phase("planner", t0, turn, detail=gen.timings)


def past_bound(ctx: AgentContext, turn: int, has_calls: bool) -> str | None:
    """What a response that calls tools at ``turn`` leads to past ``max_turns``: ``end`` (it is the last),
    ``ask`` (the final prompt follows), or None (within the bound: the calls run)."""
    if not has_calls or turn < ctx.config.max_turns:
        return None
    return "end" if ctx.config.layout.final_turn == "none" else "ask"


async def planner(state: AgentState, runtime: Runtime) -> dict:
    """One planner turn (a ``paravt.planner_turn`` span when tracing is on: its calls' parent)."""
    ctx = await actx(runtime)
    turn = state.get("turn", 0)
    with telemetry.span("paravt.planner_turn", state.get("trace_parent"), {"paravt.turn": turn}) as sp:
        update = await _planner_turn(ctx, state)
        if sp is not None:
            telemetry.set_attributes(sp, {"paravt.tool_calls": len(update.get("calls") or []),
                                          "paravt.final": update.get("response") is not None})
            update["turn_span"] = telemetry.traceparent(sp)
    return update


async def _planner_turn(ctx: AgentContext, state: AgentState) -> dict:
    cfg, turn, forced = ctx.config, state.get("turn", 0), bool(state.get("final"))
    messages = list(state["messages"])
    msg, rec, record, phase = await _ask(ctx, state, messages, turn, state.get("continuation"),
                                         _final_sampling(ctx, state) if forced else cfg.planner_sampling, forced)
    messages.append(msg)
    cont = Continuation(len(messages) - 1, record.generation)
    update: dict[str, Any] = {"records": [record], "turns": [rec], "phases": [phase], "calls": []}
    signatures = ctx.tools.signatures()
    calls = parse_tool_calls(rec.text, signatures) if cfg.mode != "none" and not forced else []
    bound = past_bound(ctx, turn, bool(calls))
    if bound == "ask":  # ask for the final answer once more, without tools
        emit(ctx, PlannerEvent(turn, rec.text))
        messages.append({"role": "user", "content": final_prompt(cfg.layout, bool(state.get("options")))})
        msg, rec2, record2, phase2 = await _ask(ctx, state, messages, turn + 1, cont, _final_sampling(ctx, state),
                                                True)
        messages.append(msg)
        emit(ctx, PlannerEvent(turn + 1, rec2.text, forced_final=True))
        return {**update, "records": [record, record2], "turns": [rec, rec2], "phases": [phase, _answered(phase2)],
                "messages": messages, "response": rec2.text,
                "continuation": Continuation(len(messages) - 1, record2.generation)}
    update.update(messages=messages, continuation=cont)
    if not calls or bound == "end":
        emit(ctx, PlannerEvent(turn, rec.text, forced_final=forced and not calls))
        return {**update, "response": rec.text, "phases": [_answered(phase)]}
    planned = plan_calls(ctx, calls, await tool_context(ctx, state["video"]))
    emit(ctx, PlannerEvent(turn, rec.text, [CallInfo(c.index, c.label, c.window, c.error) for c in planned]))
    errors = {slot_key(turn, c.index): slot_record(c, error=c.error) for c in planned if not c.ok}
    for r in errors.values():
        emit(ctx, SubAgentEvent(turn, r))
    return {**update, "calls": planned, "results": errors}


def _answered(phase: Phase) -> Phase:
    """The planner call that gave the final response is the ``answer`` phase."""
    return phase.model_copy(update={"name": "answer"})


async def review(state: AgentState, runtime: Runtime) -> dict:
    """Pause before the turn's calls run (LangGraph ``interrupt``); the resume value is the calls to run:
    ``None``/``True`` (as planned) or a list of ``{"name"?, "arguments"}`` / ``{"start_time", "end_time"}``."""
    ctx = await actx(runtime)
    turn = state.get("turn", 0)
    pending = [c for c in state["calls"] if c.ok]
    value = interrupt({"turn": turn, "calls": [_call_json(c) for c in pending]})
    if value is None or value is True:
        return {}

    default = pending[0].name if pending else None  # a bare window edits the turn's (first) tool
    edited = []
    for item in value if isinstance(value, list) else [value]:
        item = dict(item)
        name = item.pop("name", None) or default
        if name is None:
            raise ConfigError("a reviewed call needs its tool's name: {'name': ..., 'arguments': {...}}")
        args = item.pop("arguments", None) or item
        edited.append(ToolCall(name, dict(args), raw=f"(reviewed) {name}({args})"))
    planned = plan_calls(ctx, edited, await tool_context(ctx, state["video"]))
    stale = {k: None for k in state.get("results", {}) if slot_order(k)[0] == turn}
    errors = {slot_key(turn, c.index): slot_record(c, error=c.error) for c in planned if not c.ok}
    return {"calls": planned, "results": {**stale, **errors}}


def _call_json(c: PlannedCall) -> dict:
    return {"index": c.index, "name": c.name, "arguments": c.run_args, "label": c.label,
            "window": list(c.window) if c.window else None}


async def subagent(payload: CallTask, runtime: Runtime) -> dict:
    """One tool call (:class:`~paravt_agent.graph.state.CallTask`); an ``execute_tool`` span when tracing is on."""
    ctx = await actx(runtime)
    call: PlannedCall = payload["call"]
    attrs = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": call.name, "gen_ai.tool.type": "function",
             "gen_ai.tool.call.id": slot_key(payload["turn"], call.index),
             "paravt.window": list(call.window) if call.window else None}
    with telemetry.span(f"execute_tool {call.name}", payload.get("span"), attrs):
        return await run_call(ctx, payload, call)


def failure_text(exc: BaseException) -> str:
    """A node's final failure as its slot says it: a timeout names its budget and what it counts."""
    if isinstance(exc, NodeTimeoutError):
        if exc.kind == "idle":
            return (f"timed out: the {exc.node} worked {exc.timeout:g}s without finishing (its timeout counts work, "
                    "not time queued for the model)")
        return f"timed out: the {exc.node} ran past {exc.timeout:g}s"
    return str(exc) or exc.__class__.__name__


def subagent_failed(payload: CallTask, error: NodeError) -> Command:
    """The last attempt failed: the slot gets the error (the runtime's, unless a tool refused the call) and the
    run goes on to ``aggregate`` (the handler is its own node: without a destination a turn whose every call
    failed would never be aggregated)."""
    call: PlannedCall = payload["call"]
    exc, records = error.error, []
    if isinstance(exc, ToolCallError):  # the tool's model calls before it failed are kept
        exc, records = exc.error, exc.records
    rec = slot_record(call, window=call.window, error=failure_text(exc), runtime_error=not isinstance(exc, ToolError))
    writer = get_stream_writer()
    json_events = payload.get("json_events", False)
    writer(event_json(SubAgentEvent(payload["turn"], rec)) if json_events else SubAgentEvent(payload["turn"], rec))
    return Command(update={"results": {slot_key(payload["turn"], call.index): rec}, "records": records},
                   goto="aggregate")


async def aggregate(state: AgentState, runtime: Runtime) -> dict:
    ctx = await actx(runtime)
    layout, t0, turn = ctx.config.layout, time.perf_counter(), state.get("turn", 0)
    results, evidence = state.get("results", {}), state.get("evidence", {}) or {}
    slots = []
    for c in state["calls"]:
        r = results[slot_key(turn, c.index)]
        slot = {"label": r.label or r.name or "call", "text": r.slot_text}
        if r.error and layout.tool_response != "turn":
            slot["text"] = error_slot_text(layout.error_text, r.error, r.window)
        ev = evidence.get(slot_key(turn, c.index))
        if ev is not None and not r.error:
            slot["frames"], slot["timestamps"] = await offload(ctx, ctx.frames.frames, ev["refs"]), ev["timestamps"]
        slots.append(slot)
    messages = [*state["messages"], *await offload(ctx, lambda: ctx.frames.to_refs(
        tool_response_messages(layout, slots)))]
    update: dict[str, Any] = {"turn": turn + 1}
    if layout.final_turn == "after_tools" and turn + 1 >= ctx.config.max_turns:
        messages.append({"role": "user", "content": final_prompt(layout, bool(state.get("options")))})
        update["final"] = True
    return {**update, "messages": messages, "phases": [phase("aggregate", t0, turn)]}


async def finish(state: AgentState, runtime: Runtime) -> dict:
    """The output keys: answer, choice, span, ok, trace id and the trace as JSON."""
    trace = trace_of(state, mode=(await actx(runtime)).config.mode)
    trace.latency = time.time() - state.get("started", trace.created)
    return {"answer": trace.answer, "choice": trace.choice, "span": list(trace.span) if trace.span else None,
            "ok": trace.ok, "status": trace.status, "failed_calls": trace.failed_calls, "trace_id": trace.id,
            "trace": trace.model_dump(mode="json")}


# --------------------------------------------------------------------------- routing and wiring


def route_start(state: AgentState, runtime: Runtime):
    """A prepared question starts at the planner (the agents' first round in the collaborative mode); a bare
    one (LangGraph Server) decodes its overview first."""
    return route_begin(state, runtime) if state.get("messages") else "overview"


def route_begin(state: AgentState, runtime: Runtime):
    """After the overview: the planner, or the collaborating agents' first round."""
    return route_collab(state, runtime) if ctx_of(runtime).config.mode == "collaborative" else "planner"


def route_after_planner(state: AgentState, runtime: Runtime):
    """The answer ends the run; calls go to review when it is on, else straight to their sub-agents."""
    if state.get("response") is not None:
        return "finish"
    if ctx_of(runtime).config.review_windows and any(c.ok for c in state["calls"]):
        return "review"
    return route_calls(state, runtime)


def route_calls(state: AgentState, runtime: Runtime):
    """One ``Send`` per valid call (plain payloads); a turn with none goes straight to ``aggregate``."""
    json_events = ctx_of(runtime).json_events
    sends = [Send("subagent", CallTask(turn=state.get("turn", 0), call=c, video=state["video"],
                                       question=state["question"], seed=state.get("seed"), json_events=json_events,
                                       span=state.get("turn_span")))
             for c in state["calls"] if c.ok]
    return sends or "aggregate"
