"""``Agent``: the public entry point. ``Agent(model=...).answer(video, question)``."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from paravt_agent import telemetry
from paravt_agent.config import AgentConfig
from paravt_agent.defaults import resolve_model
from paravt_agent.errors import ConfigError, ParaVTError, PolicyError
from paravt_agent.graph import build_graph, final_answer, initial_state, trace_of
from paravt_agent.graph.advice import advice_for
from paravt_agent.graph.checkpoints import open_checkpointer
from paravt_agent.graph.context import AgentContext, check_input, prepare_input, system_prompt, tool_schemas
from paravt_agent.graph.frames import FrameStore, refs_of
from paravt_agent.plugins import toolset
from paravt_agent.policy.base import Policy
from paravt_agent.policy.registry import make_policy
from paravt_agent.trajectory import Phase, Trace
from paravt_agent.types import Answer, AnswerEvent, OverviewEvent, ReviewEvent, RolloutInput, StreamEvent

__all__ = ["Agent", "Answer", "make_policy"]


class Agent:
    """A planner and K parallel sub-agents over one policy.

    >>> agent = Agent()                                             # the shipped toy policy (local)
    >>> agent = Agent(model="runs/toy/model")                       # a local transformers model directory
    >>> agent = Agent(backend="openai", endpoint="http://127.0.0.1:30000/v1", model="ParaVT-8B")
    >>> ans = agent.answer("talk.mp4", "When does the speaker pick up the cup?")
    >>> print(ans.text); print(ans.trace.render())

    ``config`` defaults to the model directory's ``agent_config.yaml`` when it has one
    (:meth:`AgentConfig.for_model`), else to the paper's protocol. ``tools`` is a tool registry or a list
    of tool instances (default: the built-ins and every ``paravt.tools`` plugin, reached through the
    ``paravt.toolsets`` entry point: :func:`paravt_agent.plugins.toolset`); ``config.tools`` picks the ones offered.

    ``checkpointer`` makes runs durable (LangGraph's checkpointers): a saver object, or ``"memory"``,
    ``"sqlite:///path.db"`` or a ``postgresql://`` URL. A run then has a ``thread_id`` (``answer(...,
    thread_id=...)``); a process that dies mid-run resumes it by calling the same again (only the work
    left is done), and a finished thread gives its answer back. ``frames_dir`` keeps the frames a
    durable run references on disk, so another process can resume it. ``tool_policy`` is the model the
    model-backed tools ask when ``config.tool_models`` names none for them (default: ``policy``; RL passes the
    frozen starting weights for ``tool_model_calls: freeze``).
    """

    def __init__(
        self,
        model: str | None = None,
        backend: str = "local",
        endpoint: str | None = None,
        config: AgentConfig | None = None,
        *,
        policy: Policy | None = None,
        tools: Any = None,
        api_key: str | None = None,
        store: Any = None,
        policy_kwargs: dict | None = None,
        checkpointer: Any = None,
        frames_dir: str | os.PathLike | None = None,
        tool_policy: Policy | None = None,
    ):
        if policy is None:  # Agent() and Agent(model="toy"): the shipped toy policy, from any directory
            model = resolve_model(backend, model)
        if config is None and policy is None:
            config = AgentConfig.for_model(model)  # a model directory's protocol (local, sglang); None otherwise
        self.policy = policy or make_policy(backend, model, endpoint, api_key, **(policy_kwargs or {}))
        # the frame protocol bound to the model's own geometry (its unit, its max pixels): a config stating a frame
        # factor the model contradicts is refused here, naming both
        self.config = (config or AgentConfig()).bound_to(self.policy.frame_geometry)
        if self.config.think_prefix and not self.policy.supports_prefix:
            raise ConfigError(f"the {self.policy.name} policy cannot pin the think prefix "
                              f"{self.config.think_prefix!r}; set think_prefix: '' in the agent config "
                              "or use a backend that can (local, sglang, openai with prefill)")
        registry = toolset()(tools)  # the tools package's registry_of, by its entry point
        if tools is not None and registry is not tools and \
                self.config.tools == AgentConfig.model_fields["tools"].default_factory():
            self.config = self.config.model_copy(update={"tools": registry.names()})
        self.registry = registry.subset(self.config.tools if self.config.mode != "none" else [])
        self.store = store
        self.frames = FrameStore(frames_dir)
        self._others: dict = {}  # other models the config names (tool_models, collab agents), made once per agent
        #: the model model-backed tools ask when the config names none for them (tool_models): RL's frozen tools (the
        #: starting weights, :mod:`paravt_train.rl.frozen_tools`); None: the agent's policy
        self.tool_policy = tool_policy
        self.checkpointer = checkpointer if checkpointer is not None or not self.config.review_windows else "memory"
        self._savers: dict[int, Any] = {}
        self._graph = None
        self._lock = threading.Lock()
        self._runner = _LoopThread()

    # ------------------------------------------------------------------ graph

    @property
    def graph(self):
        """The compiled agent graph (without a checkpointer; :meth:`graph_for` adds the agent's)."""
        with self._lock:
            if self._graph is None:
                c = self.config
                self._graph = build_graph(c.retries, c.planner_timeout, c.subagent_timeout)
            return self._graph

    async def graph_for_loop(self):
        """The graph with this agent's checkpointer, opened in the running event loop (savers are bound to one)."""
        if self.checkpointer is None:
            return self.graph
        # a saver with a connection (SQLite, PostgreSQL) belongs to its event loop; one in memory serves them all
        per_loop = isinstance(self.checkpointer, str) and self.checkpointer != "memory"
        key = id(asyncio.get_running_loop()) if per_loop else 0
        if key not in self._savers:
            saver = await open_checkpointer(self.checkpointer)
            c = self.config
            self._savers[key] = build_graph(c.retries, c.planner_timeout, c.subagent_timeout, checkpointer=saver)
        return self._savers[key]

    def context(self, tool_context=None) -> AgentContext:
        """A run's context: this agent's policy, tools, config and frame store."""
        return AgentContext(self.policy, self.registry, self.config, self.frames, tool_context, others=self._others,
                            tool_default=self.tool_policy)

    def tool_schemas(self) -> list[dict]:
        """The tools as the planner's prompt describes them (:func:`paravt_agent.graph.context.tool_schemas`)."""
        return tool_schemas(self.config, self.registry)

    def system_prompt(self) -> str:
        return system_prompt(self.config, self.registry)

    def prepare(self, video: str | os.PathLike, question: str, options: Sequence[str] | None = None,
                n_frames: int | None = None) -> RolloutInput:
        """Decode the overview and build the planner's first messages (no model call)."""
        return prepare_input(self.config, self.policy, self.registry, video, question, options, n_frames)

    def check_input(self, question: str, options: Sequence[str] | None = None) -> None:
        """Refuse an empty question, or one or an option over its token limit
        (:func:`paravt_agent.graph.context.check_input`)."""
        check_input(self.config, self.policy, question, options)

    def _graph_config(self, thread_id: str | None = None) -> dict:
        conf: dict[str, Any] = {"max_concurrency": self.config.max_concurrency,
                                "recursion_limit": 8 * (self.config.max_turns + 3)}
        if thread_id is not None:
            conf["configurable"] = {"thread_id": thread_id}
        return conf

    # ------------------------------------------------------------------ answering

    async def astream(
        self, video: str | os.PathLike, question: str, options: Sequence[str] | None = None,
        *, n_frames: int | None = None, thread_id: str | None = None, trace_parent: str | None = None,
    ) -> AsyncIterator[StreamEvent]:
        """Typed events as they happen (:mod:`paravt_agent.types`): an ``OverviewEvent``, a
        ``PlannerEvent`` per turn, a ``SubAgentEvent`` as each slot fills, and finally an ``AnswerEvent``
        (or a ``ReviewEvent`` when ``review_windows`` pauses the run).

        With a checkpointer, ``thread_id`` names the run: a thread with work left is resumed (no overview
        event then), a finished one yields its answer again. A question that fails before any answer (a bad
        video, an endpoint down) raises; with a store, the failure is stored too, with its error.

        With tracing on (:mod:`paravt_agent.telemetry`), the question's span goes under ``trace_parent`` (a
        W3C ``traceparent``, e.g. the caller's HTTP header), else under the current span."""
        t0 = time.perf_counter()
        try:
            if self.checkpointer is not None and thread_id is not None:
                snap = await (await self.graph_for_loop()).aget_state(self._graph_config(thread_id))
                if snap.values:
                    async for event in self.astream_resume(thread_id):
                        yield event
                    return
            with telemetry.span("invoke_agent paravt", trace_parent, self._span_attributes(question),
                                current=False) as root:
                parent = telemetry.traceparent(root)
                with telemetry.span("paravt.overview", parent, {"paravt.n_frames": n_frames}, current=False):
                    inp = await asyncio.to_thread(self.prepare, video, question, options, n_frames)
                yield OverviewEvent(list(inp.trace.overview_timestamps), inp.trace.duration)
                async for event in self.astream_input(inp, t0=t0, thread_id=thread_id, trace_parent=parent):
                    if isinstance(event, AnswerEvent):
                        self._end_span(root, event.answer)
                    yield event
        except Exception as exc:
            if self.store is not None:
                kind = "" if isinstance(exc, ParaVTError) else f"{exc.__class__.__name__}: "
                self.store.add(Trace(video=os.fspath(video), question=question or "",
                                     options=list(options) if options else None, mode=self.config.mode,
                                     errors=[f"{kind}{exc}"], latency=time.perf_counter() - t0))
            raise

    async def astream_input(self, inp: RolloutInput, *, seed: int | None = None, t0: float | None = None,
                            thread_id: str | None = None, trace_parent: str | None = None
                            ) -> AsyncIterator[StreamEvent]:
        """Run the graph from a prepared :class:`RolloutInput` (e.g. one prompt shared by G rollouts).

        ``seed`` gives this run its own reproducible sampling seeds; ``trace_parent`` (a W3C traceparent) the
        span its spans go under. Yields the events of :meth:`astream` after the overview."""

        t0 = time.perf_counter() if t0 is None else t0
        ctx = self.context(inp.context)
        trace = inp.trace.model_copy(deep=True, update={"id": uuid.uuid4().hex})
        if inp.overview_started is not None and inp.overview_started >= t0:  # the overview was decoded in this run
            trace.phases = [Phase(name="overview", start=inp.overview_started - t0, seconds=trace.overview_latency)]
        else:
            trace.overview_latency = 0.0
        if self.checkpointer is not None and thread_id is None:
            thread_id = trace.id
        trace.otel_trace_id = telemetry.trace_id(trace_parent)
        async for event in self._run(initial_state(inp, ctx, seed=seed, trace_parent=trace_parent), ctx, trace, t0,
                                     thread_id):
            yield event

    def _span_attributes(self, question: str) -> dict | None:
        """The question span's attributes (None when tracing is off: nothing is built)."""
        if not telemetry.enabled():
            return None
        attrs = {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "paravt",
                 "gen_ai.provider.name": self.policy.name, "gen_ai.request.model": telemetry.model_name(self.policy),
                 "paravt.mode": self.config.mode}
        if telemetry.capture_content():
            attrs["gen_ai.input.messages"] = telemetry.messages_attr("user", question)
        return attrs

    @staticmethod
    def _end_span(root, answer: Answer) -> None:
        """The question span's outcome: our trace id, turns, calls, tokens, and the answer text when captured."""
        if root is None:
            return
        tr = answer.trace
        root.set_attributes({"paravt.trace_id": tr.id, "paravt.turns": len(tr.turns),
                             "paravt.tool_calls": sum(len(t.calls) for t in tr.turns), "paravt.ok": tr.ok,
                             **telemetry.usage_attributes(tr.prompt_tokens, tr.completion_tokens)})
        if telemetry.capture_content():
            root.set_attribute("gen_ai.output.messages", telemetry.messages_attr("assistant", tr.answer))

    async def astream_resume(self, thread_id: str, calls: Any = None) -> AsyncIterator[StreamEvent]:
        """Go on with the run of ``thread_id``: after a crash (only the work left is done), or after a
        ``ReviewEvent`` with ``calls`` (None: as planned; or the calls to run, edited: ``[{"start_time",
        "end_time"}, ...]`` or ``[{"name", "arguments"}, ...]``). A finished thread yields its answer again."""
        from langgraph.types import Command


        if self.checkpointer is None:
            raise ConfigError("resuming needs a checkpointer: Agent(checkpointer=...)")
        t0 = time.perf_counter()
        graph = await self.graph_for_loop()
        snap = await graph.aget_state(self._graph_config(thread_id))
        values = snap.values
        if not values:
            raise ParaVTError(f"no run under thread {thread_id!r}")
        ctx = self.context()
        await asyncio.to_thread(self._restore_frames, values)
        trace = trace_of(values, mode=self.config.mode)
        trace.id = values.get("trace_id") or thread_id
        trace.errors.clear()
        trace.turns, trace.phases = [], []
        if not snap.next:  # finished: the same answer again
            yield AnswerEvent(self._finish(values, ctx, trace, values.get("trace", {}).get("latency", 0.0), None))
            return
        # LangGraph takes Command(resume=None) for "no resume value" and fails; the review node reads True as "run
        # the calls as planned"
        command = Command(resume=True if calls is None else calls) if snap.interrupts else None
        async for event in self._run(command, ctx, trace, t0, thread_id, resumed=True):
            yield event

    def _restore_frames(self, values: dict) -> None:
        """A resumed run's overview frames: decoded again when this process has not got them (the same video
        and frame count give the same pixels, hence the same keys)."""

        if all(k in self.frames for k in refs_of(values.get("messages", [])[:2])):
            return
        inp = self.prepare(values["video"], values["question"], values.get("options"), values.get("n_frames"))
        self.frames.to_refs(inp.messages)

    async def _run(self, graph_input, ctx: AgentContext, trace: Trace, t0: float, thread_id: str | None,
                   resumed: bool = False) -> AsyncIterator[StreamEvent]:
        """Stream the graph to its answer (or its pause), keeping what finished when the run fails or times out."""
        graph = await self.graph_for_loop()
        config = self._graph_config(thread_id)
        last: dict = {}
        loop, task, expired = asyncio.get_running_loop(), asyncio.current_task(), []
        left = self.config.request_timeout - (time.perf_counter() - t0)
        deadline = loop.call_later(max(left, 0.001), lambda: (expired.append(True), task.cancel()))
        kw = {"durability": "sync"} if thread_id is not None else {}
        try:
            async for mode, chunk in graph.astream(graph_input, config, context=ctx, stream_mode=["custom", "values"],
                                                   **kw):
                if mode == "values":
                    last = chunk
                else:
                    yield chunk
        except asyncio.CancelledError:
            if not expired:
                raise
            trace.errors.append(f"the question took longer than request_timeout ({self.config.request_timeout:g}s)")
            if not (last.get("turns") or last.get("memory")):
                raise PolicyError(trace.errors[-1], transient=True) from None
        except Exception as exc:  # keep everything done so far
            if not (last.get("turns") or last.get("memory")):
                raise  # nothing to keep: the planner never answered
            trace.errors.append(f"{exc.__class__.__name__}: {exc}")
        finally:
            deadline.cancel()
        if thread_id is not None and not trace.errors:
            snap = await graph.aget_state(config)
            if snap.interrupts:
                pending = snap.values.get("calls", [])
                yield ReviewEvent(snap.values.get("turn", 0), [c for c in pending if c.ok], thread_id)
                return
            last = snap.values or last
        yield AnswerEvent(self._finish(last, ctx, trace, time.perf_counter() - t0, None if resumed else t0))

    async def arun(self, inp: RolloutInput, *, seed: int | None = None) -> Answer:
        """:meth:`astream_input` to its answer."""
        answer = None
        async for event in self.astream_input(inp, seed=seed):
            if isinstance(event, AnswerEvent):
                answer = event.answer
        return answer

    async def aanswer(
        self, video: str | os.PathLike, question: str, options: Sequence[str] | None = None,
        *, n_frames: int | None = None, thread_id: str | None = None, review=None,
        trace_parent: str | None = None,
    ) -> Answer:
        """:meth:`astream` to its answer. With ``review_windows`` on, ``review(event) -> calls`` is asked at
        each pause (a :class:`ReviewEvent`; return None to run the calls as planned)."""
        answer, events = None, self.astream(video, question, options, n_frames=n_frames, thread_id=thread_id,
                                            trace_parent=trace_parent)
        while answer is None:
            paused = None
            async for event in events:
                if isinstance(event, AnswerEvent):
                    answer = event.answer
                elif isinstance(event, ReviewEvent):
                    paused = event
            if paused is None:
                break
            if review is None:
                raise ConfigError("review_windows is on: pass review=callable to answer(), or use astream() and "
                                  "astream_resume()")
            events = self.astream_resume(paused.thread_id, review(paused))
        return answer

    def answer(
        self, video: str | os.PathLike, question: str, options: Sequence[str] | None = None,
        *, n_frames: int | None = None, thread_id: str | None = None, review=None,
    ) -> Answer:
        """Answer one question about one video (blocking)."""
        return self.run(self.aanswer(video, question, options, n_frames=n_frames, thread_id=thread_id,
                                     review=review))

    async def aanswer_many(
        self, items: Iterable[dict], concurrency: int = 4, progress: bool = True, desc: str = "answering",
        reruns: int = 0,
    ) -> list[Answer]:
        """:meth:`answer_many` in the caller's loop. ``reruns``: an answer the runtime spoiled (a run error, a
        tool call that failed: not :attr:`Trace.scorable`) is asked again up to this many times; the last try is
        kept either way (its trace says what failed)."""
        from tqdm.auto import tqdm

        items = list(items)
        sem = asyncio.Semaphore(concurrency)
        bar = tqdm(total=len(items), desc=desc, disable=not progress, leave=False)

        async def attempt(item: dict) -> Answer:
            try:
                return await self.aanswer(item["video"], item["question"], item.get("options"),
                                          n_frames=item.get("n_frames"))
            except Exception as exc:  # this item's error, in its own answer; the others are kept
                kind = "" if isinstance(exc, ParaVTError) else f"{exc.__class__.__name__}: "
                trace = Trace(video=str(item["video"]), question=item["question"],
                              options=item.get("options"), errors=[f"{kind}{exc}"])
                return Answer(text="", trace=trace)

        async def one(item: dict) -> Answer:
            async with sem:
                try:
                    ans = await attempt(item)
                    for _ in range(reruns):
                        if ans.trace.scorable:
                            break
                        ans = await attempt(item)
                    return ans
                finally:
                    bar.update(1)

        try:
            return list(await asyncio.gather(*(one(it) for it in items)))
        finally:
            bar.close()

    def answer_many(self, items: Iterable[dict], concurrency: int = 4, progress: bool = True,
                    reruns: int = 0, desc: str = "answering") -> list[Answer]:
        """Answer ``[{"video", "question", "options"?, "n_frames"?}, ...]`` with a progress bar; errors per item
        (each answer's ``status``); ``reruns``: tries again for answers the runtime spoiled
        (see :meth:`aanswer_many`); ``desc`` labels the progress bar."""
        return self.run(self.aanswer_many(items, concurrency=concurrency, progress=progress, reruns=reruns, desc=desc))

    def _finish(self, state: dict, ctx: AgentContext, trace: Trace, latency: float, t0: float | None) -> Answer:
        done = trace_of(state, base=trace, t0=t0, mode=self.config.mode)
        done.latency = latency
        done.advice = advice_for(done, self.config)  # which time budget ran out, and what to raise it to
        if self.store is not None:
            self.store.add(done)
        return final_answer(state, ctx, done)

    def feedback(self, trace_id: str, answer: str | None = None, reward: float | None = None,
                 thumbs: bool | None = None, note: str | None = None, user: str | None = None,
                 principal: str | None = None) -> int:
        """Attach feedback to a stored trace (needs ``store=``): an answer, a reward or thumbs, and who gave it:
        ``principal``, the voter the online learner counts (``store.principals``; None: ``sdk:USER``; neither: your
        own label, never capped). An answer the question cannot have, or one contradicting earlier ones, raises."""
        if self.store is None:
            raise ParaVTError("this agent has no trajectory store; pass store=TrajectoryStore(path)")
        return self.store.feedback(trace_id, answer=answer, reward=reward, thumbs=thumbs, note=note,
                                   user=None if user is None else f"sdk:{user}", principal=principal)

    def run(self, coro):
        """Run a coroutine on this agent's event loop (where its clients live) and return its result."""
        return self._runner.run(coro)

    async def aclose(self) -> None:
        await self.policy.aclose()
        if self.tool_policy is not None and self.tool_policy is not self.policy:
            await self.tool_policy.aclose()
        for other in list(self._others.values()):  # the tools' and agents' own models (tool_models, collab)
            await other.aclose()
        self._others.clear()


class _LoopThread:
    """One event loop in a daemon thread per Agent: the sync API submits to it, so clients bound to a
    loop (HTTP connection pools) live as long as the agent and are reused across calls."""

    def __init__(self):
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def run(self, coro):
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="paravt-agent-loop", daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()


