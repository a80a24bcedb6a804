"""The ParaVT agent graph as LangGraph Server serves it (``langgraph.json`` at the repository root).

``langgraph dev`` (``pip install 'langgraph-cli[inmem]'``) serves it with LangGraph's own API (threads,
runs, streaming, LangGraph Studio); LangGraph's server deployment (PostgreSQL + Redis) runs the same
graph with durable runs and horizontal scale.

This is the agent's own graph (:mod:`paravt_agent.graph`: overview → planner → K sub-agents → aggregate →
… → finish), not a wrapper: the thread's state shows the planner turns, the calls and the sub-agents' results
as they happen, and the server's checkpointer makes each run durable (frames are referenced by content key,
never stored in the state). Input: ``{"video", "question", "options"?, "n_frames"?}``. Output: ``answer``,
``choice``, ``span``, ``ok``, ``status`` (``ok``, ``degraded``: answered from tool calls that failed in the
runtime, ``failed``), ``failed_calls``, ``trace_id`` and the whole ``trace`` (JSON). Stream with
``stream_mode=["custom", "values"]``: ``{"event": "overview" | "planner" | "subagent", ...}`` custom events,
then the values.

Which model answers comes from the server's environment (``langgraph.json`` may set it in ``env``):
``PARAVT_MODEL`` (a model directory, or the served name for ``openai``; default the shipped toy policy),
``PARAVT_BACKEND`` (``local``, ``openai``, ``sglang``), ``PARAVT_ENDPOINT``, ``PARAVT_PRESET``, and
``PARAVT_VIDEO_ROOT`` (when set, videos named by path must lie under it, as with ``paravt api``). A run's
``context`` (or, as before, ``config.configurable``) may set ``mode``, ``max_turns`` and ``review_windows``.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, TypedDict

from paravt_agent.agent import Agent
from paravt_agent.config import resolve_agent_config
from paravt_agent.defaults import default_model_dir
from paravt_agent.errors import VideoError
from paravt_agent.graph import DEFAULT_CONTEXT, build_graph
from paravt_agent.serving.request import ApiError, ApiSettings, resolve_video

__all__ = ["ParaVTInput", "ParaVTOutput", "ServerContext", "make_graph"]


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
    status: str  # ok | degraded (answered from failed tool calls) | failed
    failed_calls: int
    trace_id: str
    trace: dict[str, Any]


_agents: dict[tuple, Any] = {}
_lock = threading.Lock()


def _agent(mode: str | None, max_turns: int | None, review: bool = False):
    """One agent per (model, backend, endpoint, preset, mode, max_turns, review), all over one policy per model
    and one frame store per process."""

    backend = os.environ.get("PARAVT_BACKEND", "local")
    model = os.environ.get("PARAVT_MODEL") or None
    endpoint = os.environ.get("PARAVT_ENDPOINT") or None
    preset = os.environ.get("PARAVT_PRESET") or None
    if backend == "local" and not model:
        model = default_model_dir()
    base_key = (backend, model, endpoint, preset)
    key = (*base_key, mode, max_turns, review)
    with _lock:
        if key not in _agents:
            overrides = ([f"mode={mode}"] if mode else []) + ([f"max_turns={max_turns}"] if max_turns else [])
            overrides += ["review_windows=true"] if review else []
            cfg = resolve_agent_config(None, model if backend != "openai" else None, overrides, preset=preset)
            base = _agents.get((*base_key, None, None, False))
            _agents[key] = (Agent(config=cfg, policy=base.policy) if base is not None
                            else Agent(model=model, backend=backend, endpoint=endpoint, config=cfg))
            if base is not None:
                _agents[key].frames = base.frames
            _agents.setdefault((*base_key, None, None, False), _agents[key])
        return _agents[key]


def _video(video: str) -> str:
    root = os.environ.get("PARAVT_VIDEO_ROOT")
    if not root:
        return video

    try:
        return resolve_video(video, ApiSettings(video_root=root))
    except ApiError as exc:
        raise VideoError(exc.message) from None


@dataclass
class ServerContext:
    """What a server run may set in its ``context``; the live resources come from :func:`_agent`'s cache.
    Unset fields fall back to the run's ``config.configurable`` (how earlier clients set them)."""

    mode: str | None = None
    max_turns: int | None = None
    review_windows: bool | None = None

    def resolve(self):
        """The run's :class:`~paravt_agent.graph.context.AgentContext`, built on first use (kept on this instance,
        outside the dataclass fields: the context schema stays three plain settings)."""
        if "_resolved" not in self.__dict__:
            from langgraph.config import get_config

            conf = get_config().get("configurable", {}) or {}
            mode = self.mode or conf.get("mode")
            max_turns = self.max_turns or conf.get("max_turns")
            review = self.review_windows if self.review_windows is not None else conf.get("review_windows")
            agent = _agent(mode, max_turns, bool(review))
            ctx = agent.context()
            ctx.json_events, ctx.video_resolver = True, _video
            self.__dict__["_resolved"] = ctx
        return self.__dict__["_resolved"]


def make_graph(config=None):
    """The graph factory ``langgraph.json`` names (LangGraph's server calls it with the run's config)."""

    graph = build_graph(context_schema=ServerContext, input_schema=ParaVTInput, output_schema=ParaVTOutput)
    return graph.with_config({"configurable": {DEFAULT_CONTEXT: ServerContext}})
