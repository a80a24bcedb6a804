"""One tool call, validated and run: what the graph's sub-agent nodes (and each collaborating agent) do with a
planned call. :func:`plan_calls` validates a turn's calls in the registry, :func:`run_call` runs one: the tool,
the model session a model-backed tool asks through (its calls recorded as ``tool:<name>``), and the sub-agent's
summary of visual evidence, or the frames themselves for the planner."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from langgraph.errors import NodeTimeoutError

from paravt_agent import telemetry
from paravt_agent.errors import PolicyError, ToolError
from paravt_agent.graph.context import AgentContext
from paravt_agent.graph.frames import refs_of
from paravt_agent.graph.runtime import (
    ToolSession,
    emit,
    generate,
    offload,
    phase,
    seeded,
    tool_context,
    within_work_budget,
)
from paravt_agent.graph.state import CallTask, slot_key
from paravt_agent.prompts import SUBAGENT_SYSTEM_PROMPT, layout_subagent_messages
from paravt_agent.protocol import subagent_report
from paravt_agent.trajectory import SubAgentRecord
from paravt_agent.types import GenerationRecord, PlannedCall, SubAgentEvent

__all__ = ["ToolCallError", "plan_calls", "run_agent_call", "run_call", "slot_record", "transient_error"]


def plan_calls(ctx: AgentContext, calls: list, tool_context, cap: int | None = None) -> list[PlannedCall]:
    """Validate one turn's calls in the registry; each becomes a :class:`PlannedCall` (plain data). ``cap``:
    calls one turn may make (default: one in sequential mode, else ``max_calls_per_turn``)."""
    cfg = ctx.config
    if cap is None:
        cap = 1 if cfg.mode == "sequential" else cfg.max_calls_per_turn
    prepared = ctx.tools.prepare(calls, tool_context, max_calls=cap,
                                 drop_extra=cfg.layout.extra_calls == "drop")
    out = []
    for p in prepared:
        ok = p.ok
        out.append(PlannedCall(
            index=p.index, raw=p.call.raw, name=getattr(p.call, "name", None),
            arguments=dict(getattr(p.call, "arguments", {}) or {}), run_args=p.args.model_dump() if ok else None,
            label=p.label, window=p.tool.window(p.args) if ok else None, error=p.error))
    return out


def transient_error(exc: BaseException) -> bool:
    """Retry timeouts and endpoint failures; never bad input."""
    if isinstance(exc, ToolCallError):
        exc = exc.error
    return isinstance(exc, NodeTimeoutError | TimeoutError | ConnectionError) or (
        isinstance(exc, PolicyError) and exc.transient
    )


def slot_record(call: PlannedCall, **kw) -> SubAgentRecord:
    return SubAgentRecord(index=call.index, raw=call.raw, name=call.name, arguments=dict(call.arguments),
                          label=call.label, **kw)


class ToolCallError(Exception):
    """A tool raised after its model session made calls: ``records`` keeps them (the slot gets the error, the
    trace and RL still see every model call made); ``error`` is what the tool raised."""

    def __init__(self, error: BaseException, records: list[GenerationRecord]):
        super().__init__(str(error))
        self.error, self.records = error, records


async def run_call(ctx: AgentContext, payload: CallTask, call: PlannedCall, summarise: bool = False) -> dict:
    """Run one valid call (``payload``: its :class:`~paravt_agent.graph.state.CallTask`; ``agent``: the collaborating
    agent that made it): the tool, its model session (a model-backed tool), and a sub-agent's summary of visual
    evidence, or the frames themselves for the planner (the layout's ``evidence: frames`` or a frames tool, unless
    ``summarise``: a reader of text only, the collaborative mode's memory); the state update: ``results`` (the
    slot's record), ``records`` (every model call), ``phases``, ``evidence``."""
    turn = payload["turn"]
    tool = ctx.tools.get(call.name)
    t0 = time.perf_counter()
    tctx, session = await tool_context(ctx, payload["video"]), None
    if tool.uses_model:  # the call's own model session: its model calls are recorded under the call's slot
        session = ToolSession(ctx, tool.name, turn, call.index, payload.get("seed"))
        tctx = dataclasses.replace(tctx, model=session)
    try:
        result = await tool.run(tool.Args.model_validate(call.run_args), tctx)
    except Exception as exc:
        if session is not None and session.records:
            raise ToolCallError(exc, session.records) from exc
        raise
    phases = [phase("crop", t0, turn, call.index)]
    rec = slot_record(call, window=result.window, frame_timestamps=list(result.timestamps),
                      warnings=list(result.warnings), agent=payload.get("agent"))
    update: dict[str, Any] = {"records": list(session.records)} if session is not None else {}
    if session is not None:
        phases.extend(session.phases)
        rec.prompt_tokens = sum(r.generation.prompt_tokens for r in session.records)
        rec.completion_tokens = sum(r.generation.completion_tokens for r in session.records)
    layout = ctx.config.layout
    # optional frames (a grounded clip) are evidence only for a planner that reads frames; elsewhere the text is all
    visual = result.is_visual and not (result.frames_optional and (summarise or layout.evidence != "frames"))
    if visual:  # an optional clip (a grounded span) is described by its own frames, not the window searched
        window = (result.timestamps[0], result.timestamps[-1]) if result.frames_optional else (
            result.window or (result.timestamps[0], result.timestamps[-1]))
        frames = await offload(ctx, lambda: [ctx.frames.put(f) for f in result.frames])
    if visual and not summarise and (layout.evidence == "frames" or tool.evidence == "frames"):
        rec.evidence = "frames"
        rec.summary = _with_text(result.text, layout.evidence_text.format(n=len(result.timestamps), start=window[0],
                                                                          end=window[1]))
        update["evidence"] = {slot_key(turn, call.index): {"refs": frames, "timestamps": list(result.timestamps)}}
    elif visual:
        cfg = ctx.config
        question = payload["question"] if cfg.question_to_subagents else None
        msgs = await offload(ctx, lambda: ctx.frames.to_refs(layout_subagent_messages(
            layout, result.frames, result.timestamps, window, question, system=cfg.subagent_prompt
            or SUBAGENT_SYSTEM_PROMPT)))
        t_gen = time.perf_counter()
        with telemetry.span("invoke_agent paravt.subagent", attributes={
                "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "paravt.subagent"}):
            gen = await generate(ctx, "subagent", msgs,
                                  seeded(cfg.subagent_sampling, payload.get("seed"), turn, call.index + 1))
        phases.append(phase("subagent", t_gen, turn, call.index, detail=gen.timings))
        rec.summary = _with_text(result.text, subagent_report(gen.text, cfg.subagent_report))
        if rec.summary != gen.text.strip():
            rec.reply = gen.text.strip()
        rec.prompt_tokens += gen.prompt_tokens
        rec.completion_tokens += gen.completion_tokens
        rec.batch_size = gen.batch_size
        update["records"] = [*update.get("records", []),
                             GenerationRecord("subagent", turn, call.index, gen, image_refs=refs_of(msgs))]
    else:
        rec.evidence, rec.summary = "text", result.text
    rec.latency = time.perf_counter() - t0
    emit(ctx, SubAgentEvent(turn, rec))
    return {**update, "results": {slot_key(turn, call.index): rec}, "phases": phases}


async def run_agent_call(ctx: AgentContext, payload: CallTask, call: PlannedCall) -> dict:
    """One of an agent's calls, as a planner's sub-agent runs it: an invalid call is its error slot; the
    runtime's failures are retried (``retries``, transient ones only) within ``subagent_timeout`` per attempt;
    a tool refusing the call is the model's error, anything else the runtime's. The round goes on either way."""
    if not call.ok:
        return {"results": {"x": slot_record(call, error=call.error, agent=payload["agent"])}}
    cfg = ctx.config
    for attempt in range(cfg.retries + 1):
        try:
            return await within_work_budget(run_call(ctx, payload, call, summarise=True), cfg.subagent_timeout,
                                            f"{payload['agent']}'s call {call.index + 1}")
        except Exception as exc:
            if attempt < cfg.retries and transient_error(exc):
                await asyncio.sleep(0.5 * 2 ** attempt)
                continue
            records = exc.records if isinstance(exc, ToolCallError) else []
            cause = exc.error if isinstance(exc, ToolCallError) else exc
            msg = str(cause) or type(cause).__name__
            if isinstance(cause, TimeoutError):
                msg = f"timed out: {cause}" if str(cause) else f"timed out after {cfg.subagent_timeout:g}s of work"
            rec = slot_record(call, window=call.window, error=msg, runtime_error=not isinstance(cause, ToolError),
                              agent=payload["agent"])
            return {"results": {"x": rec}, "records": records}
    raise AssertionError("unreachable")


def _with_text(tool_text: str, evidence: str) -> str:
    """A visual result's slot: the tool's own text (a selected frame's time, the boxes found) before what was
    made of its frames."""
    return f"{tool_text.strip()}\n{evidence}" if tool_text.strip() else evidence
