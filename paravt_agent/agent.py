"""``Agent``: the public entry point. ``Agent(model=...).answer(video, question)``."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from paravt_agent.config import AgentConfig
from paravt_agent.errors import ConfigError, ParaVTError, PolicyError, PromptTooLong
from paravt_agent.policy.base import Policy
from paravt_agent.policy.registry import make_policy
from paravt_agent.prompts import NO_TOOL_SYSTEM_PROMPT, layout_planner_messages, layout_system_prompt
from paravt_agent.protocol import extract_answer, extract_choice, is_degenerate, parse_span
from paravt_agent.trajectory import Phase, Trace
from paravt_agent.types import Answer, AnswerEvent, OverviewEvent, RolloutInput, StreamEvent
from paravt_agent.video import VideoReader

__all__ = ["Agent", "Answer", "make_policy"]


class Agent:
    """A planner and K parallel sub-agents over one policy.

    >>> agent = Agent(model="runs/toy/model")                       # local transformers model
    >>> agent = Agent(backend="openai", endpoint="http://127.0.0.1:30000/v1", model="ParaVT-8B")
    >>> ans = agent.answer("talk.mp4", "When does the speaker pick up the cup?")
    >>> print(ans.text); print(ans.trace.render())

    ``config`` defaults to the model directory's ``agent_config.yaml`` when it has one
    (:meth:`AgentConfig.for_model`), else to the paper's protocol. ``tools`` is a
    :class:`tools.ToolRegistry` or a list of :class:`tools.Tool` instances (default: the
    built-ins and every ``paravt.tools`` plugin); ``config.tools`` picks the ones offered.
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
    ):
        from tools import Tool, ToolRegistry

        if config is None and policy is None:
            config = AgentConfig.for_model(model)  # a model directory's protocol (local, sglang); None otherwise
        self.config = config or AgentConfig()
        self.policy = policy or make_policy(backend, model, endpoint, api_key, **(policy_kwargs or {}))
        if self.config.think_prefix and not self.policy.supports_prefix:
            raise ConfigError(f"the {self.policy.name} policy cannot pin the think prefix "
                              f"{self.config.think_prefix!r}; set think_prefix: '' in the agent config "
                              "or use a backend that can (local, sglang, openai with prefill)")
        if tools is None:
            registry = ToolRegistry.default()
        elif isinstance(tools, ToolRegistry):
            registry = tools
        else:
            tools = list(tools)
            bad = [t for t in tools if not isinstance(t, Tool)]
            if bad:
                raise ConfigError(f"tools must be paravt Tool instances, got {bad[0]!r}")
            registry = ToolRegistry(tools)
            if self.config.tools == AgentConfig.model_fields["tools"].default_factory():
                self.config = self.config.model_copy(update={"tools": registry.names()})
        self.registry = registry.subset(self.config.tools) if self.config.mode != "none" else ToolRegistry()
        self.store = store
        self._graph = None
        self._lock = threading.Lock()
        self._runner = _LoopThread()

    # ------------------------------------------------------------------ graph

    @property
    def graph(self):
        with self._lock:
            if self._graph is None:
                from paravt_agent.graph import build_graph

                self._graph = build_graph(self.policy, self.registry, self.config)
            return self._graph

    def tool_schemas(self) -> list[dict]:
        """The tools as the planner's prompt describes them: a preset's literal ``crop_video`` schema
        (``layout.tool_schema``), the native schema of every other tool."""
        from paravt_agent.presets import TOOL_SCHEMAS

        literal = TOOL_SCHEMAS.get(self.config.layout.tool_schema)
        return [literal if literal is not None and t.name == "crop_video" else t.schema() for t in self.registry]

    def system_prompt(self) -> str:
        cfg = self.config
        if cfg.mode == "none":
            return cfg.system_prompt or NO_TOOL_SYSTEM_PROMPT
        if cfg.system_prompt:
            return cfg.system_prompt
        return layout_system_prompt(cfg.layout, self.tool_schemas(), sequential=cfg.mode == "sequential")

    def prepare(self, video: str | os.PathLike, question: str, options: Sequence[str] | None = None,
                n_frames: int | None = None) -> RolloutInput:
        """Decode the overview and build the planner's first messages (no model call)."""
        from paravt_agent.video.fetch import local_video
        from tools import ToolContext

        if not question or not question.strip():
            raise ParaVTError("the question is empty")
        self.check_input(question, options)
        f = self.config.frames
        reader = VideoReader(local_video(video), backend=f.backend)
        t_overview = time.perf_counter()
        overview = reader.overview(n_frames, f)
        overview_latency = time.perf_counter() - t_overview
        info = overview.info
        ctx = ToolContext(video=reader, frames=f, strict_video_path=self.config.strict_video_path)
        messages = layout_planner_messages(
            self.config.layout, self.system_prompt(), overview.frames, overview.timestamps, info.duration, question,
            options, video_name=os.path.basename(os.fspath(video)),
        )
        self._check_prompt(messages)
        trace = Trace(
            video=os.fspath(video), question=question, options=list(options) if options else None,
            mode=self.config.mode, duration=info.duration, overview_timestamps=list(overview.timestamps),
            warnings=[f"overview: {w}" for w in overview.warnings], overview_latency=overview_latency,
        )
        return RolloutInput(question, list(options) if options else None, messages, ctx, trace,
                            n_frames if n_frames is not None else f.n_frames, overview_started=t_overview)

    def check_input(self, question: str, options: Sequence[str] | None = None) -> None:
        """Refuse (:class:`PromptTooLong`) a question or option over its token limit, cheaply: a text no longer
        in UTF-8 bytes than its limit passes untokenised (a token is at least one byte), one over 16 bytes per
        token of its limit is refused untokenised, the rest are counted with the model's tokenizer."""
        cfg = self.config
        items = [("question", question, cfg.max_question_tokens, "max_question_tokens")]
        items += [(f"option {chr(65 + i)}", str(o), cfg.max_option_tokens, "max_option_tokens")
                  for i, o in enumerate(options or ())]
        for what, text, limit, key in items:
            size = len(text.encode("utf-8", "replace"))
            if size <= limit:
                continue
            if size > 16 * limit:
                raise PromptTooLong(f"the {what} is {size} bytes, far over its limit of {limit} tokens ({key})")
            n = self.policy.count_text_tokens(text)
            n = -(-size // 2) if n is None else n
            if n > limit:
                raise PromptTooLong(f"the {what} is {n} tokens; the limit is {limit} ({key})")

    def _check_prompt(self, messages: list[dict]) -> None:
        """The planner's first prompt and its answer budget must fit the model's context (where known)."""
        window = self.policy.context_length
        if not window:
            return
        budget = self.config.planner_sampling.max_new_tokens
        bound = getattr(self.policy, "prompt_token_bound", None)
        if bound is not None and bound(messages) + budget <= window:  # fits for sure: no encoding here
            return
        n = self.policy.count_tokens(messages)
        if n is not None and n + budget > window:
            raise PromptTooLong(f"the prompt is {n} tokens; with the {budget}-token answer budget it is over the "
                                f"model's {window}-token context (use fewer frames or a shorter question)")

    def _graph_config(self) -> dict:
        return {"max_concurrency": self.config.max_concurrency, "recursion_limit": 6 * (self.config.max_turns + 3)}

    # ------------------------------------------------------------------ answering

    async def astream(
        self, video: str | os.PathLike, question: str, options: Sequence[str] | None = None,
        *, n_frames: int | None = None,
    ) -> AsyncIterator[StreamEvent]:
        """Typed events as they happen (:mod:`paravt_agent.types`): an ``OverviewEvent``, a
        ``PlannerEvent`` per turn, a ``SubAgentEvent`` as each slot fills, and finally an ``AnswerEvent``.

        A question that fails before any answer (a bad video, an endpoint down) raises; with a store,
        the failure is stored too, with its error, so an operator sees it."""
        t0 = time.perf_counter()
        try:
            inp = await asyncio.to_thread(self.prepare, video, question, options, n_frames)
            yield OverviewEvent(list(inp.trace.overview_timestamps), inp.trace.duration)
            async for event in self.astream_input(inp, t0=t0):
                yield event
        except Exception as exc:
            if self.store is not None:
                kind = "" if isinstance(exc, ParaVTError) else f"{exc.__class__.__name__}: "
                self.store.add(Trace(video=os.fspath(video), question=question or "",
                                     options=list(options) if options else None, mode=self.config.mode,
                                     errors=[f"{kind}{exc}"], latency=time.perf_counter() - t0))
            raise

    async def astream_input(self, inp: RolloutInput, *, seed: int | None = None, t0: float | None = None
                            ) -> AsyncIterator[StreamEvent]:
        """Run the graph from a prepared :class:`RolloutInput` (e.g. one prompt shared by G rollouts).

        ``seed`` gives this run its own reproducible sampling seeds. Yields the events of
        :meth:`astream` after the overview."""
        t0 = time.perf_counter() if t0 is None else t0
        state = {"question": inp.question, "options": inp.options, "ctx": inp.context, "messages": inp.messages,
                 "turn": 0, "calls": [], "results": {}, "turns": [], "records": [], "seed": seed,
                 "continuation": None, "phases": []}
        trace = inp.trace.model_copy(deep=True, update={"id": uuid.uuid4().hex})
        if inp.overview_started is not None and inp.overview_started >= t0:  # the overview was decoded in this run
            trace.phases = [Phase(name="overview", start=inp.overview_started - t0, seconds=trace.overview_latency)]
        else:
            trace.overview_latency = 0.0
        last = state
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        expired = []
        left = self.config.request_timeout - (time.perf_counter() - t0)
        deadline = loop.call_later(max(left, 0.001), lambda: (expired.append(True), task.cancel()))
        try:
            async for mode, chunk in self.graph.astream(state, self._graph_config(), stream_mode=["custom", "values"]):
                if mode == "values":
                    last = chunk
                else:
                    yield chunk
        except asyncio.CancelledError:
            if not expired:
                raise
            trace.errors.append(f"the question took longer than request_timeout ({self.config.request_timeout:g}s)")
            if not last.get("turns"):
                raise PolicyError(trace.errors[-1], transient=True) from None
        except Exception as exc:  # keep everything done so far
            if not last.get("turns"):
                raise  # nothing to keep: the planner never answered
            trace.errors.append(f"{exc.__class__.__name__}: {exc}")
        finally:
            deadline.cancel()
        yield AnswerEvent(self._finish(last, trace, time.perf_counter() - t0, t0))

    async def arun(self, inp: RolloutInput, *, seed: int | None = None) -> Answer:
        """:meth:`astream_input` to its answer."""
        answer = None
        async for event in self.astream_input(inp, seed=seed):
            if isinstance(event, AnswerEvent):
                answer = event.answer
        return answer

    async def aanswer(
        self, video: str | os.PathLike, question: str, options: Sequence[str] | None = None,
        *, n_frames: int | None = None,
    ) -> Answer:
        answer = None
        async for event in self.astream(video, question, options, n_frames=n_frames):
            if isinstance(event, AnswerEvent):
                answer = event.answer
        return answer

    def answer(
        self, video: str | os.PathLike, question: str, options: Sequence[str] | None = None,
        *, n_frames: int | None = None,
    ) -> Answer:
        """Answer one question about one video (blocking)."""
        return self.run(self.aanswer(video, question, options, n_frames=n_frames))

    async def aanswer_many(
        self, items: Iterable[dict], concurrency: int = 4, progress: bool = True, desc: str = "answering"
    ) -> list[Answer]:
        from tqdm.auto import tqdm

        items = list(items)
        sem = asyncio.Semaphore(concurrency)
        bar = tqdm(total=len(items), desc=desc, disable=not progress, leave=False)

        async def one(item: dict) -> Answer:
            async with sem:
                try:
                    return await self.aanswer(item["video"], item["question"], item.get("options"),
                                              n_frames=item.get("n_frames"))
                except Exception as exc:  # this item's error, in its own answer; the others are kept
                    kind = "" if isinstance(exc, ParaVTError) else f"{exc.__class__.__name__}: "
                    trace = Trace(video=str(item["video"]), question=item["question"],
                                  options=item.get("options"), errors=[f"{kind}{exc}"])
                    return Answer(text="", trace=trace)
                finally:
                    bar.update(1)

        try:
            return list(await asyncio.gather(*(one(it) for it in items)))
        finally:
            bar.close()

    def answer_many(self, items: Iterable[dict], concurrency: int = 4, progress: bool = True) -> list[Answer]:
        """Answer ``[{"video", "question", "options"?, "n_frames"?}, ...]`` with a progress bar; errors per item."""
        return self.run(self.aanswer_many(items, concurrency=concurrency, progress=progress))

    def _finish(self, state: dict, trace: Trace, latency: float, t0: float = 0.0) -> Answer:
        results = state.get("results", {}) or {}
        trace.phases = [*trace.phases, *(Phase(**{**p, "start": p["start"] - t0})
                                         for p in state.get("phases", []) or [])]
        turns = [t.model_copy(deep=True) for t in state.get("turns", []) or []]
        for t in turns:
            t.calls = [results[k] for k in sorted(results) if k[0] == t.turn and not t.forced_final]
        trace.turns = turns
        response = state.get("response")
        if response is None:
            if not trace.errors:
                trace.errors.append("the planner gave no final response")
            response = turns[-1].text if turns else ""
        trace.response = response
        trace.answer = extract_answer(response)
        if is_degenerate(response):
            trace.errors.append("degenerate output: the model repeats its chat template (<|im_start|> loops); "
                                "the answer is not reliable (a model that does not fit this agent's protocol?)")
        elif not trace.answer.strip():
            trace.errors.append("empty answer: the model returned no answer text")
        if trace.options:
            trace.choice = extract_choice(trace.answer, trace.options)
        else:
            trace.span = parse_span(trace.answer)
        trace.latency = latency
        if self.store is not None:
            self.store.add(trace)
        return Answer(text=trace.answer, trace=trace, choice=trace.choice, span=trace.span,
                      records=list(state.get("records", []) or []), messages=list(state.get("messages", [])))

    def feedback(self, trace_id: str, answer: str | None = None, reward: float | None = None,
                 thumbs: bool | None = None, note: str | None = None) -> int:
        """Attach feedback to a stored trace (needs ``store=``): a correct answer, a reward, or thumbs."""
        if self.store is None:
            raise ParaVTError("this agent has no trajectory store; pass store=TrajectoryStore(path)")
        return self.store.feedback(trace_id, answer=answer, reward=reward, thumbs=thumbs, note=note)

    def run(self, coro):
        """Run a coroutine on this agent's event loop (where its clients live) and return its result."""
        return self._runner.run(coro)

    async def aclose(self) -> None:
        await self.policy.aclose()


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


