"""The ParaVT agent as a LangGraph Server graph (``langgraph.json`` at the repository root).

``langgraph dev`` (``pip install 'langgraph-cli[inmem]'``) serves it with LangGraph's own API (threads,
runs, streaming, LangGraph Studio); LangGraph's server deployment (PostgreSQL + Redis) runs the same
graph with durable runs and horizontal scale.

Input: ``{"video", "question", "options"?, "n_frames"?}``. Output adds ``answer``, ``choice``, ``span``,
``ok``, ``trace_id`` and the whole ``trace`` (JSON). Stream with ``stream_mode=["custom", "values"]`` to get
the run as it happens: ``{"event": "overview" | "planner" | "subagent", ...}`` custom events, then the values.

The server-facing graph has one node, ``paravt``, which runs the agent's own graph (planner → K
sub-agents → aggregator → planner) inside it. That inner state holds decoded frames and open decoders:
it lives in memory for the run and is never checkpointed; the checkpoints hold the JSON above.

Which model answers comes from the server's environment (``langgraph.json`` may set it in ``env``):
``PARAVT_MODEL`` (a model directory, or the served name for ``openai``; default the shipped toy policy),
``PARAVT_BACKEND`` (``local``, ``openai``, ``sglang``), ``PARAVT_ENDPOINT``, ``PARAVT_PRESET``, and
``PARAVT_VIDEO_ROOT`` (when set, videos named by path must lie under it, as with ``paravt api``). A run's
``config.configurable`` may set ``mode`` and ``max_turns``.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import threading
from typing import Any, TypedDict

from langgraph.config import get_stream_writer
from langgraph.graph import END, START, StateGraph

from paravt_agent.types import OverviewEvent, PlannerEvent, SubAgentEvent

__all__ = ["ParaVTInput", "ParaVTOutput", "make_graph"]


class ParaVTInput(TypedDict, total=False):
    video: str
    question: str
    options: list[str] | None
    n_frames: int | None


class ParaVTOutput(TypedDict, total=False):
    answer: str
    choice: str | None
    span: list[float] | None
    ok: bool
    trace_id: str
    trace: dict[str, Any]


class ParaVTState(ParaVTInput, ParaVTOutput):
    pass


_agents: dict[tuple, Any] = {}
_lock = threading.Lock()


def _agent(mode: str | None, max_turns: int | None):
    """One agent per (model, backend, endpoint, preset, mode, max_turns), all over one policy per model."""
    from paravt_agent.agent import Agent
    from paravt_agent.config import resolve_agent_config

    backend = os.environ.get("PARAVT_BACKEND", "local")
    model = os.environ.get("PARAVT_MODEL") or None
    endpoint = os.environ.get("PARAVT_ENDPOINT") or None
    preset = os.environ.get("PARAVT_PRESET") or None
    if backend == "local" and not model:
        from paravt_agent.defaults import default_model_dir

        model = default_model_dir()
    base_key = (backend, model, endpoint, preset)
    key = (*base_key, mode, max_turns)
    with _lock:
        if key not in _agents:
            overrides = ([f"mode={mode}"] if mode else []) + ([f"max_turns={max_turns}"] if max_turns else [])
            cfg = resolve_agent_config(None, model if backend != "openai" else None, overrides, preset=preset)
            base = _agents.get((*base_key, None, None))
            policy = base.policy if base is not None else None
            _agents[key] = (Agent(config=cfg, policy=policy) if policy is not None
                            else Agent(model=model, backend=backend, endpoint=endpoint, config=cfg))
            _agents.setdefault((*base_key, None, None), _agents[key])
        return _agents[key]


def _video(video: str) -> str:
    root = os.environ.get("PARAVT_VIDEO_ROOT")
    if not root:
        return video
    from paravt_agent.api import ApiError, ApiSettings, resolve_video
    from paravt_agent.errors import VideoError

    try:
        return resolve_video(video, ApiSettings(video_root=root))
    except ApiError as exc:
        raise VideoError(exc.message) from None


async def run_paravt(state: ParaVTState, config) -> ParaVTOutput:
    from paravt_agent.errors import ParaVTError
    from paravt_agent.types import AnswerEvent

    if not state.get("video") or not str(state.get("question") or "").strip():
        raise ParaVTError("the input needs `video` (a path or an http(s) URL) and `question`")
    conf = (config or {}).get("configurable", {}) or {}
    agent = await asyncio.to_thread(_agent, conf.get("mode"), conf.get("max_turns"))
    await asyncio.to_thread(agent.check_input, state["question"], state.get("options") or None)  # before a download
    video = await asyncio.to_thread(_video, state["video"])
    writer = get_stream_writer()
    answer = None
    async for ev in _isolated(agent.astream(video, state["question"], state.get("options") or None,
                                            n_frames=state.get("n_frames"))):
        if isinstance(ev, OverviewEvent):
            writer({"event": "overview", "timestamps": ev.timestamps, "duration": ev.duration})
        elif isinstance(ev, PlannerEvent):
            writer({"event": "planner", "turn": ev.turn, "text": ev.text, "forced_final": ev.forced_final,
                    "calls": [{"index": c.index, "label": c.label, "window": c.window, "error": c.error}
                              for c in ev.calls]})
        elif isinstance(ev, SubAgentEvent):
            r = ev.record
            writer({"event": "subagent", "turn": ev.turn, "index": r.index, "tool": r.name, "window": r.window,
                    "summary": r.summary, "error": r.error, "latency": r.latency})
        elif isinstance(ev, AnswerEvent):
            answer = ev.answer
    tr = answer.trace
    return {"answer": answer.text, "choice": answer.choice, "span": list(answer.span) if answer.span else None,
            "ok": answer.ok, "trace_id": tr.id, "trace": tr.model_dump(mode="json")}


async def _isolated(events):
    """Iterate ``events`` in a task with a fresh context. Inside a LangGraph node the context carries the
    server run's config, and the agent's own graph would run as a subgraph of it: checkpointed by the
    server (frames and decoders included) and streaming its values to the outer run instead of to the
    agent. A fresh context makes it the standalone run it is everywhere else; its events come through a
    queue, and cancelling the node (the run is cancelled on the server) cancels it."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump():
        try:
            async for ev in events:
                queue.put_nowait(ev)
        except Exception as exc:  # noqa: BLE001 (re-raised in the node)
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(end)

    task = asyncio.get_running_loop().create_task(pump(), context=contextvars.Context())
    try:
        while (item := await queue.get()) is not end:
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        task.cancel()
        await asyncio.wait({task})


def make_graph(config=None):
    """The graph factory ``langgraph.json`` names (LangGraph's server calls it with the run's config)."""
    g = StateGraph(ParaVTState, input_schema=ParaVTInput, output_schema=ParaVTOutput)
    g.add_node("paravt", run_paravt)
    g.add_edge(START, "paravt")
    g.add_edge("paravt", END)
    return g.compile(name="paravt")
