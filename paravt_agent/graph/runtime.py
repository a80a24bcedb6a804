"""What the agent graph's nodes share: the run context, the event stream, timed phases, per-call seeds and
the model call itself (:func:`generate`: frames materialised at the policy's door, a ``chat`` span).
:mod:`paravt_agent.graph` holds the nodes and the wiring."""

from __future__ import annotations

import asyncio
import contextvars
import time

from langgraph.config import get_config, get_stream_writer
from langgraph.runtime import Runtime, get_runtime
from langgraph.types import TimeoutPolicy

from paravt_agent import telemetry
from paravt_agent.errors import ConfigError
from paravt_agent.graph.context import AgentContext
from paravt_agent.graph.frames import refs_of
from paravt_agent.policy.base import (
    SERVE_CLOCK,
    ServeClock,
    box_coordinates_of,
    model_type_of_dir,
    takes_role,
)
from paravt_agent.policy.families import geometry_of_dir
from paravt_agent.trajectory import Phase
from paravt_agent.types import (
    Generation,
    GenerationRecord,
    MemoryEvent,
    OverviewEvent,
    PlannerEvent,
    Sampling,
    ToolModel,
)

__all__ = ["DEFAULT_CONTEXT", "ToolSession", "actx", "ctx_of", "emit", "event_json", "generate", "node_timeout",
           "offload", "phase", "seeded", "served", "tool_context", "within_work_budget"]


#: ``config["configurable"]`` key of a zero-argument factory of the run context, for runs started without
#: one (LangGraph Server's runs that pass no ``context``)
DEFAULT_CONTEXT = "paravt_default_context"


def ctx_of(runtime: Runtime) -> AgentContext:
    """The run's :class:`AgentContext` (a server's settings resolve to one; routing functions use this)."""
    context = runtime.context
    if context is None:
        factory = get_config().get("configurable", {}).get(DEFAULT_CONTEXT)
        if factory is None:
            raise ConfigError("the agent graph runs with context=AgentContext(...) (Agent does this)")
        context = factory()
    return context.resolve()


async def actx(runtime: Runtime) -> AgentContext:
    """:func:`ctx_of` for nodes: resolving server settings may load a model, so it runs off the event loop."""
    if isinstance(runtime.context, AgentContext):
        return runtime.context
    return await asyncio.to_thread(ctx_of, runtime)


async def tool_context(ctx: AgentContext, path: str):
    """The run's tool context; opening the video (a resumed run, the server) runs off the event loop."""
    return ctx.tool_context if ctx.tool_context is not None else await asyncio.to_thread(ctx.video, path)


def emit(ctx: AgentContext, event) -> None:
    get_stream_writer()(event_json(event) if ctx.json_events else event)


def event_json(event) -> dict:
    """A stream event as LangGraph Server's clients get it: ``{"event": kind, ...}`` of JSON values."""
    if isinstance(event, OverviewEvent):
        return {"event": "overview", "timestamps": event.timestamps, "duration": event.duration}
    if isinstance(event, PlannerEvent):
        return {"event": "planner", "turn": event.turn, "text": event.text, "forced_final": event.forced_final,
                "calls": [{"index": c.index, "label": c.label, "window": c.window, "error": c.error}
                          for c in event.calls]}
    if isinstance(event, MemoryEvent):
        return {"event": "memory", "round": event.round, **event.entry.model_dump(mode="json")}
    r = event.record
    return {"event": "subagent", "turn": event.turn, "index": r.index, "agent": r.agent, "tool": r.name,
            "window": r.window, "summary": r.summary, "error": r.error, "latency": r.latency}


def phase(name: str, t0: float, turn: int | None = None, index: int | None = None,
           detail: dict | None = None) -> Phase:
    """A timed step from ``t0`` (``time.perf_counter()``) to now."""
    return Phase(name=name, start=t0, seconds=time.perf_counter() - t0, turn=turn, index=index,
                 detail=dict(detail or {}))


def seeded(sampling: Sampling, seed: int | None, turn: int, slot: int = 0) -> Sampling:
    """The sampling settings of one call: a rollout seed gives every call its own reproducible seed."""
    if seed is None:
        return sampling
    return sampling.model_copy(update={"seed": (seed * 1_000_003 + turn * 1009 + slot) % 2**31})


async def generate(ctx: AgentContext, role: str, messages: list[dict], sampling: Sampling, policy=None,
                   **kw) -> Generation:
    """One model call: frames materialised from the store at the policy's door, the caller's role stated; a
    ``chat`` span under the current one when tracing is on. ``policy``: another model than the run's (a tool's
    or a collaborating agent's own endpoint)."""
    policy = policy or ctx.policy
    if takes_role(type(policy)):
        kw["role"] = role
    attrs = telemetry.generation_attributes(policy, sampling) if telemetry.enabled() else None
    with telemetry.span(f"chat {telemetry.model_name(policy)}", attributes=attrs) as sp:
        msgs = await offload(ctx, ctx.frames.materialize, messages)
        gen = await served(policy, policy.generate(msgs, sampling, **kw))
        telemetry.set_attributes(sp, {**telemetry.usage_attributes(gen.prompt_tokens, gen.completion_tokens),
                                      "paravt.role": role, "paravt.batch_size": gen.batch_size})
    return gen


# --------------------------------------------------------------------------- time budgets: work, not queueing
#
# A node's timeout (``subagent_timeout``, ``planner_timeout``) is LangGraph's ``TimeoutPolicy(idle_timeout=...,
# refresh_on="heartbeat")``: the node fails when it has gone that long without a heartbeat. While one of its model
# calls waits in the backend's queue (behind other questions' calls on a busy machine), :func:`served` keeps
# beating, and it beats once more when the call starts being served; so the budget is the node's own work since it
# last waited for the model, never the time other questions held the model. Work that is slow because the machine
# is slow still runs out of budget, and then the answer says so (``Trace.status`` "degraded").

#: how often a queued model call beats (well under any sensible timeout)
HEARTBEAT_EVERY = 0.1

#: extra heartbeat receivers of the current context (:func:`within_work_budget`: budgets inside one node)
_BEATS: contextvars.ContextVar[tuple] = contextvars.ContextVar("paravt_heartbeats", default=())


def _heartbeat():
    """What to call to say "this node is waiting, not working": the node's LangGraph heartbeat (a no-op outside a
    timed node) and the budgets opened in this context."""
    try:
        runtime = get_runtime()
    except RuntimeError:  # outside a graph run (a tool driven directly)
        runtime = None
    beat = runtime.heartbeat if runtime is not None else None
    extra = _BEATS.get()

    def heartbeat() -> None:
        if beat is not None:
            beat()
        for b in extra:
            b()

    return heartbeat


async def served(policy, call):
    """Await a policy call, beating while it waits in the backend's queue (:class:`ServeClock`), so the caller's
    time budget counts only its service. A backend that does not report service (``reports_service``) has its
    whole call counted."""
    beat = _heartbeat()
    clock = ServeClock(on_start=beat)
    token = SERVE_CLOCK.set(clock)
    try:
        task = asyncio.ensure_future(call)  # the task's context holds the clock
    finally:
        SERVE_CLOCK.reset(token)
    if not getattr(policy, "reports_service", False):
        clock.start()
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=HEARTBEAT_EVERY)
            if clock.started is None:
                beat()
        return task.result()
    finally:
        if not task.done():
            task.cancel()


async def within_work_budget(coro, seconds: float, what: str = "the call"):
    """``await coro`` with a budget of ``seconds`` of work: the clock restarts whenever one of its model calls
    waits in a queue (:func:`served`), as LangGraph's idle timeout does for whole nodes. Raises ``TimeoutError``."""
    last = [time.monotonic()]

    def touch() -> None:
        last[0] = time.monotonic()

    token = _BEATS.set((*_BEATS.get(), touch))
    try:
        task = asyncio.ensure_future(coro)
    finally:
        _BEATS.reset(token)
    try:
        while not task.done():
            left = last[0] + seconds - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{what} worked longer than its {seconds:g}s budget (time queued for the model "
                                   "is not counted)")
            await asyncio.wait({task}, timeout=left)
        return task.result()
    finally:
        if not task.done():
            task.cancel()


def node_timeout(seconds: float | None):
    """A node's LangGraph timeout counting work, not queueing (see above); None: no timeout."""
    if seconds is None:
        return None
    return TimeoutPolicy(idle_timeout=seconds, refresh_on="heartbeat")


async def offload(ctx: AgentContext, fn, *args):
    """``fn(*args)`` off the event loop when the frame store touches disk (a durable run's), else inline."""
    if ctx.frames.directory is None:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


class ToolSession(ToolModel):
    """The model a model-backed tool's call asks (:class:`~paravt_agent.types.ToolModel`): the endpoint the
    agent config names for the tool (``tool_models``), else the run's policy. Every call is kept as a
    :class:`GenerationRecord` of role ``tool:<name>`` (the call's turn and slot; ``trainable`` only when the
    run's own policy answered), in the order the tool asked, and as a ``tool_model`` phase."""

    #: the seed slot of a tool's k-th model call: far from the planner's (0) and sub-agents' (index + 1) slots
    SEED_SLOT = 10_000_000

    def __init__(self, ctx: AgentContext, tool: str, turn: int, index: int, seed: int | None):
        self.ctx, self.tool, self.turn, self.index, self.seed = ctx, tool, turn, index, seed
        self._done: list[tuple[int, GenerationRecord]] = []
        self._next = 0
        self.phases: list[Phase] = []
        spec = ctx.config.tool_models.get(tool)
        self.box_coordinates = (spec.box_coordinates if spec is not None and spec.box_coordinates
                                else ctx.config.box_coordinates)
        if self.box_coordinates == "auto":  # by the family of the model that will answer
            family = ctx.policy.model_type if spec is None else (model_type_of_dir(spec.model or "")
                                                                  or (spec.model or "").lower())
            self.box_coordinates = box_coordinates_of(family)
        # the size the answering model sees an image at (a pixel box is in its pixels); None when unknown
        if spec is not None:
            self.geometry = geometry_of_dir(spec.model) if spec.model else None
        else:
            self.geometry = (ctx.tool_default or ctx.policy).frame_geometry

    @property
    def records(self) -> list[GenerationRecord]:
        return [r for _, r in sorted(self._done, key=lambda kr: kr[0])]

    async def ask(self, messages: list[dict], max_new_tokens: int | None = None) -> str:
        k, self._next = self._next, self._next + 1  # reserved before any await: concurrent asks differ
        ctx = self.ctx
        policy, trainable = await ctx.tool_policy(self.tool)
        sampling = ctx.config.tool_sampling
        if max_new_tokens:  # what the tool's answer needs at least (a box per object); never less than configured,
            # so a reply that reasons before it answers is not cut (frame_selection asks 16: "confidence 0" otherwise)
            sampling = sampling.model_copy(update={"max_new_tokens": max(max_new_tokens, sampling.max_new_tokens)})
        sampling = seeded(sampling, self.seed, self.turn, self.SEED_SLOT + 10_000 * self.index + k)
        msgs = await offload(ctx, ctx.frames.to_refs, messages)
        t0 = time.perf_counter()
        gen = await generate(ctx, f"tool:{self.tool}", msgs, sampling, policy=policy)
        self.phases.append(phase("tool_model", t0, self.turn, self.index, detail=gen.timings))
        self._done.append((k, GenerationRecord(f"tool:{self.tool}", self.turn, self.index, gen,
                                               image_refs=refs_of(msgs), trainable=trainable)))
        return gen.text
