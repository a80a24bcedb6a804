"""The agent graph's state: plain data only, and the one way in and the one way out.

:class:`AgentState` is what a checkpointer saves and LangGraph Studio shows: the planner's messages with frames
referenced by content key (:mod:`paravt_agent.graph.frames`), the calls as :class:`~paravt_agent.types.PlannedCall`,
the turns and slots as the records of :mod:`paravt_agent.trajectory`, every model call as a
:class:`~paravt_agent.types.GenerationRecord`. :func:`initial_state` turns a prepared question into the first
state; :func:`trace_of` and :func:`final_answer` turn a final (or partial) state into the ``Trace`` and ``Answer``.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, TypedDict

from paravt_agent.graph.context import AgentContext
from paravt_agent.protocol import extract_answer, extract_choice, is_degenerate, parse_span
from paravt_agent.telemetry import trace_id
from paravt_agent.trajectory import MemoryEntry, Phase, PlannerTurn, SubAgentRecord, Trace
from paravt_agent.types import (
    Answer,
    Continuation,
    Generation,
    GenerationRecord,
    PlannedCall,
    RolloutInput,
)

__all__ = ["STATE_TYPES", "AgentState", "CallTask", "final_answer", "initial_state", "slot_key", "slot_order",
           "trace_of"]


def _merge(left: dict | None, right: dict | None) -> dict:
    """Keyed results merge as they arrive; a key updated to None is removed (a reviewed turn's old slots)."""
    merged = {**(left or {}), **(right or {})}
    return {k: v for k, v in merged.items() if v is not None}


def _append(left: list | None, right: list | None) -> list:
    return [*(left or []), *(right or [])]


class AgentState(TypedDict, total=False):
    """The graph's state: plain data only (what a checkpointer saves and LangGraph Studio shows)."""

    video: str  # the video's path (a resumed run and the server reopen it through the context)
    started: float  # time.time() when the question began
    question: str
    options: list[str] | None
    n_frames: int | None  # overview frames (None: the config's)
    seed: int | None  # per-rollout sampling seed (each call derives its own); None = the config's
    duration: float  # the video's length in seconds
    overview_timestamps: list[float]
    warnings: list[str]  # what decoding the overview could not give
    messages: list[dict]  # the planner's conversation; image parts hold a frame key ("ref"), never pixels
    continuation: Continuation | None  # the planner's last turn, token for token
    turn: int  # tool turns completed
    calls: list[PlannedCall]  # the current turn's calls
    results: Annotated[dict[str, SubAgentRecord], _merge]  # "turn:index" -> the slot's record
    evidence: Annotated[dict[str, dict], _merge]  # "turn:index" -> {"refs", "timestamps"}: frames-mode results
    final: bool  # the next planner response is the final one (layout.final_turn == "after_tools")
    turns: Annotated[list[PlannerTurn], _append]
    records: Annotated[list[GenerationRecord], _append]  # every model call (frames by key)
    response: str | None  # the planner's final response
    phases: Annotated[list[Phase], _append]  # timed steps; ``start`` is time.perf_counter() of the process
    trace_parent: str | None  # the question's OpenTelemetry span as a W3C traceparent (None: tracing off)
    turn_span: str | None  # the latest planner turn's span (its tool calls' parent), a traceparent
    answer: str  # set by ``finish``, with the rest of the output
    choice: str | None
    span: list[float] | None
    ok: bool
    status: str  # ok | degraded | failed (Trace.status)
    failed_calls: int
    trace_id: str
    trace: dict
    round: int  # collaborative mode: rounds completed
    memory: Annotated[dict[str, MemoryEntry], _merge]  # collaborative mode: "round:agent index" -> the entry


#: the classes a checkpoint of :class:`AgentState` holds (what a strict serializer may rebuild)
STATE_TYPES = (PlannedCall, Generation, Continuation, GenerationRecord, PlannerTurn, SubAgentRecord, Phase,
               MemoryEntry)


class CallTask(TypedDict, total=False):
    """What the fan-out's ``Send`` gives one call's node (a planner's sub-agent, or a collaborating agent's call): plain
    data, which a checkpointer saves with the pending sends; the live resources come from the run context."""

    turn: int  # the dispatching planner turn (a collaborating agent's: its round)
    call: PlannedCall  # the validated call
    video: str  # the question's video: the only file a tool may open
    question: str
    seed: int | None  # the run's seed (each call's sampling derives its own from it)
    json_events: bool  # stream events as JSON (LangGraph Server) rather than objects
    span: object | None  # the dispatching turn's tracing span
    agent: str | None  # a collaborating agent's call: the agent's name


def slot_key(turn: int, index: int) -> str:
    """A slot's key in ``results`` and ``evidence``: ``"turn:index"`` (JSON-safe)."""
    return f"{turn}:{index}"


def initial_state(inp: RolloutInput, ctx: AgentContext, seed: int | None = None,
                  trace_parent: str | None = None) -> AgentState:
    """A prepared question as the graph's first state (its frames go to the context's store); ``trace_parent``
    is the question's span (:mod:`paravt_agent.telemetry`)."""
    tr = inp.trace
    return {"video": tr.video, "question": inp.question, "options": inp.options, "n_frames": inp.n_frames,
            "trace_parent": trace_parent, "seed": seed, "duration": tr.duration,
            "overview_timestamps": list(tr.overview_timestamps),
            "warnings": list(tr.warnings), "messages": ctx.frames.to_refs(inp.messages), "turn": 0, "calls": [],
            "continuation": None, "started": time.time()}


def trace_of(state: AgentState, base: Trace | None = None, errors: list[str] = (), t0: float | None = None,
             mode: str = "parallel") -> Trace:
    """The :class:`Trace` of a (final or partial) state: ``base`` holds what the run started from."""
    trace = (base.model_copy(deep=True) if base is not None
             else Trace(id=uuid.uuid4().hex, created=state.get("started", time.time()), video=state.get("video", ""),
                        question=state.get("question", ""), mode=mode,
                        options=state.get("options"), duration=state.get("duration", 0.0),
                        overview_timestamps=list(state.get("overview_timestamps", [])),
                        warnings=[f"overview: {w}" if not w.startswith("overview:") else w
                                  for w in state.get("warnings", [])]))
    trace.otel_trace_id = trace.otel_trace_id or trace_id(state.get("trace_parent"))
    trace.errors = [*trace.errors, *errors]
    ref = t0 if t0 is not None else min((p.start for p in state.get("phases", []) or []), default=0.0)
    trace.phases = [*trace.phases, *(p.model_copy(update={"start": p.start - ref})
                                     for p in state.get("phases", []) or [])]
    results = state.get("results", {}) or {}
    turns = [t.model_copy(deep=True) for t in state.get("turns", []) or []]
    for t in turns:
        t.calls = [] if t.forced_final else [results[k] for k in sorted(results, key=slot_order)
                                             if slot_order(k)[0] == t.turn]
    trace.turns = turns
    memory = state.get("memory", {}) or {}
    trace.memory = [memory[k] for k in sorted(memory, key=slot_order)]
    # an answer built on failed work is never a clean one: each call the runtime could not run is an error
    trace.errors += [e for e in trace.runtime_call_errors if e not in trace.errors]
    response = state.get("response")
    if response is None:
        if not trace.errors:
            trace.errors.append("the planner gave no final response")
        response = turns[-1].text if turns else ""
    trace.response, trace.answer = response, extract_answer(response)
    if is_degenerate(response):
        trace.errors.append("degenerate output: the model repeats its chat template (<|im_start|> loops); "
                            "the answer is not reliable (a model that does not fit this agent's protocol?)")
    elif not trace.answer.strip():
        trace.errors.append("empty answer: the model returned no answer text")
    if trace.options:
        trace.choice = extract_choice(trace.answer, trace.options)
    else:
        trace.span = parse_span(trace.answer)
    return trace


def slot_order(key: str) -> tuple[int, int]:
    turn, index = key.split(":")
    return int(turn), int(index)


def final_answer(state: AgentState, ctx: AgentContext, trace: Trace) -> Answer:
    """The one way out: an :class:`Answer` with the frames of its records and messages materialised."""
    records = [GenerationRecord(r.role, r.turn, r.index, r.generation, images=ctx.frames.frames(r.image_refs),
                                image_refs=list(r.image_refs), trainable=r.trainable)
               for r in state.get("records", []) or []]
    return Answer(text=trace.answer, trace=trace, choice=trace.choice, span=trace.span, records=records,
                  messages=ctx.frames.materialize(list(state.get("messages", []))))
