"""``Agent``: the public entry point. ``Agent(model=...).answer(video, question)``."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paravt_agent.config import AgentConfig
from paravt_agent.errors import ParaVTError, VideoError
from paravt_agent.policy.base import Policy
from paravt_agent.prompts import NO_TOOL_SYSTEM_PROMPT, planner_messages, tool_system_prompt
from paravt_agent.protocol import extract_answer, extract_choice, parse_span
from paravt_agent.trajectory import Trace
from paravt_agent.video import VideoReader

__all__ = ["Agent", "Answer", "make_policy"]


@dataclass
class Answer:
    """The final answer text, the parsed choice or span where the question asks for one, and the trace."""

    text: str
    trace: Trace
    choice: str | None = None
    span: tuple[float, float] | None = None
    generations: list | None = None  # token-level records (role, turn, index, Generation)
    messages: list[dict] | None = None  # the planner's final conversation (frames included)

    def __str__(self) -> str:
        return self.choice or self.text


def make_policy(
    backend: str, model: str | None = None, endpoint: str | None = None, api_key: str | None = None, **kw
) -> Policy:
    """A policy by backend name: ``local`` (a model directory), ``openai`` or ``sglang`` (an endpoint)."""
    if backend == "local":
        from paravt_agent.policy.local import LocalPolicy

        if not model:
            raise ParaVTError("the local backend needs model=<path of a model directory>")
        return LocalPolicy(model, **kw)
    if backend == "openai":
        from paravt_agent.policy.openai_backend import OpenAIPolicy

        return OpenAIPolicy(model=model, endpoint=endpoint, api_key=api_key, **kw)
    if backend == "sglang":
        from paravt_agent.policy.sglang_backend import SGLangPolicy

        if not model:
            raise ParaVTError("the sglang backend needs model=<path or name of the served model's processor>")
        return SGLangPolicy(model=model, endpoint=endpoint, **kw)
    raise ParaVTError(f"unknown backend {backend!r}; choose local, openai or sglang")


class Agent:
    """A planner and K parallel sub-agents over one policy.

    >>> agent = Agent(model="runs/toy/model")                       # local transformers model
    >>> agent = Agent(backend="openai", endpoint="http://127.0.0.1:30000/v1", model="ParaVT-8B")
    >>> ans = agent.answer("talk.mp4", "When does the speaker pick up the cup?")
    >>> print(ans.text); print(ans.trace.render())
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
        from tools import ToolRegistry

        if config is None and backend == "local" and model and (Path(model) / "agent_config.yaml").is_file():
            config = AgentConfig.from_yaml(Path(model) / "agent_config.yaml")  # the protocol it was trained with
        self.config = config or AgentConfig()
        self.policy = policy or make_policy(backend, model, endpoint, api_key, **(policy_kwargs or {}))
        registry = tools if isinstance(tools, ToolRegistry) else ToolRegistry.default()
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

    def system_prompt(self) -> str:
        cfg = self.config
        if cfg.mode == "none":
            return cfg.system_prompt or NO_TOOL_SYSTEM_PROMPT
        if cfg.system_prompt:
            return cfg.system_prompt
        return tool_system_prompt(self.registry.schemas(), sequential=cfg.mode == "sequential")

    def initial_state(
        self, video: str | os.PathLike, question: str, options: Sequence[str] | None = None,
        n_frames: int | None = None,
    ) -> tuple[dict, Trace]:
        """Decode the overview and build the planner's first messages (no model call)."""
        from tools import ToolContext

        if not question or not question.strip():
            raise ParaVTError("the question is empty")
        f = self.config.frames
        reader = VideoReader(video, backend=f.backend)
        overview = reader.overview(
            n=n_frames or f.n_frames, fps=f.fps, max_frames=f.max_frames, max_pixels=f.max_pixels,
            factor=f.factor, fast=f.fast_overview,
        )
        info = overview.info
        ctx = ToolContext(
            video=reader, crop_max_frames=f.crop_max_frames, crop_fps=f.crop_fps, max_pixels=f.max_pixels,
            factor=f.factor, strict_video_path=self.config.strict_video_path,
        )
        messages = planner_messages(
            self.system_prompt(), overview.frames, overview.timestamps, info.duration, question, options,
            video_name=os.path.basename(os.fspath(video)),
        )
        trace = Trace(
            video=os.fspath(video), question=question, options=list(options) if options else None,
            mode=self.config.mode, duration=info.duration, overview_timestamps=list(overview.timestamps),
        )
        state = {"question": question, "options": list(options) if options else None, "ctx": ctx,
                 "messages": messages, "turn": 0, "calls": [], "results": {}, "turns": [], "generations": []}
        return state, trace

    def _graph_config(self) -> dict:
        return {"max_concurrency": self.config.max_concurrency, "recursion_limit": 6 * (self.config.max_turns + 3)}

    # ------------------------------------------------------------------ answering

    async def astream(
        self, video: str | os.PathLike, question: str, options: Sequence[str] | None = None,
        *, n_frames: int | None = None,
    ) -> AsyncIterator[dict]:
        """Events as they happen: ``overview``, ``planner`` (per turn), ``subagent`` (as each finishes),
        and finally ``answer`` carrying the :class:`Answer`."""
        t0 = time.perf_counter()
        state, trace = await asyncio.to_thread(self.initial_state, video, question, options, n_frames)
        yield {"event": "overview", "timestamps": trace.overview_timestamps, "duration": trace.duration}
        async for event in self.astream_state(state, trace, t0=t0):
            yield event

    async def astream_state(self, state: dict, trace: Trace, *, seed: int | None = None, t0: float | None = None):
        """Run the graph from a prepared :meth:`initial_state` (e.g. one prompt shared by G rollouts).

        ``seed`` gives this run its own reproducible sampling seeds. Yields the same events as
        :meth:`astream` after ``overview``."""
        t0 = time.perf_counter() if t0 is None else t0
        state = {**state, "seed": seed, "generations": [], "results": {}, "turns": [], "calls": []}
        trace = trace.model_copy(deep=True, update={"id": uuid.uuid4().hex})
        last = state
        try:
            async for mode, chunk in self.graph.astream(state, self._graph_config(), stream_mode=["custom", "values"]):
                if mode == "values":
                    last = chunk
                else:
                    yield chunk
        except Exception as exc:  # keep everything done so far
            if not last.get("turns"):
                raise  # nothing to keep: the planner never answered
            trace.errors.append(f"{exc.__class__.__name__}: {exc}")
        answer = self._finish(last, trace, time.perf_counter() - t0)
        yield {"event": "answer", "answer": answer}

    async def arun_state(self, state: dict, trace: Trace, *, seed: int | None = None) -> Answer:
        """:meth:`astream_state` to its answer."""
        answer = None
        async for event in self.astream_state(state, trace, seed=seed):
            if event["event"] == "answer":
                answer = event["answer"]
        return answer

    async def aanswer(
        self, video: str | os.PathLike, question: str, options: Sequence[str] | None = None,
        *, n_frames: int | None = None,
    ) -> Answer:
        answer = None
        async for event in self.astream(video, question, options, n_frames=n_frames):
            if event["event"] == "answer":
                answer = event["answer"]
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
                except (VideoError, ParaVTError) as exc:
                    trace = Trace(video=str(item["video"]), question=item["question"], errors=[str(exc)])
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

    def _finish(self, state: dict, trace: Trace, latency: float) -> Answer:
        results = state.get("results", {}) or {}
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
        if trace.options:
            trace.choice = extract_choice(trace.answer, trace.options)
        else:
            trace.span = parse_span(trace.answer)
        trace.latency = latency
        if self.store is not None:
            self.store.add(trace)
        return Answer(text=trace.answer, trace=trace, choice=trace.choice, span=trace.span,
                      generations=list(state.get("generations", []) or []), messages=list(state.get("messages", [])))

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
