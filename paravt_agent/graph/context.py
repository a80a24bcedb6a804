"""The agent graph's run context (LangGraph's ``context_schema``) and the question → first-prompt step.

Everything live a run needs — the policy, the tool registry, the agent config, the frame store, the open
video — is an :class:`AgentContext` that reaches the graph's nodes as ``Runtime.context``; the graph's
state stays plain data (:mod:`paravt_agent.graph`). :func:`prepare_input` decodes the overview and builds
the planner's first messages; ``Agent.prepare`` and the graph's ``overview`` node both use it.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from paravt_agent.config import AgentConfig
from paravt_agent.errors import ParaVTError, PromptTooLong
from paravt_agent.graph.frames import FrameStore
from paravt_agent.policy.base import Policy
from paravt_agent.policy.registry import make_policy
from paravt_agent.prompts import NO_TOOL_SYSTEM_PROMPT, layout_planner_messages, layout_system_prompt
from paravt_agent.protocol.presets import TOOL_SCHEMAS
from paravt_agent.trajectory import Trace
from paravt_agent.types import RolloutInput, ToolContext
from paravt_agent.video import VideoReader
from paravt_agent.video.fetch import local_video

_OTHERS_LOCK = threading.Lock()

__all__ = ["AgentContext", "check_input", "check_prompt", "prepare_input", "system_prompt", "tool_schemas"]


@dataclass
class AgentContext:
    """The live resources of a run: what nodes get as ``runtime.context`` and never find in the state.

    ``tools`` is the tool registry the agent was given (the graph reaches tools only through it);
    ``tool_context`` the open video and its frame protocol (opened from the state's ``video`` on first
    use when not given); ``frames`` holds the pixels the state's messages reference by key; ``json_events``
    makes the stream's custom events JSON dicts (LangGraph Server's clients) instead of the typed events."""

    policy: Policy
    tools: Any
    config: AgentConfig
    frames: FrameStore = field(default_factory=FrameStore)
    tool_context: ToolContext | None = None
    json_events: bool = False
    #: turns a video named by the input into one this process may open (LangGraph Server's PARAVT_VIDEO_ROOT)
    video_resolver: Callable[[str], str] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    #: policies of other models the config names (tools' ``tool_models``, collaborating agents'): the Agent's
    #: cache, so each is made once per agent (and closed by ``Agent.aclose``)
    others: dict = field(default_factory=dict, repr=False)
    #: the model model-backed tools ask when the config names none for them (``tool_models``): RL's frozen tools,
    #: the starting weights (:class:`~paravt_agent.agent.Agent`'s ``tool_policy``); None: ``policy``
    tool_default: Policy | None = field(default=None, repr=False)

    def resolve(self) -> AgentContext:
        return self

    def check_input(self, question: str, options: Sequence[str] | None = None) -> None:
        check_input(self.config, self.policy, question, options)

    def policy_for(self, spec) -> Policy:
        """The policy of another model (a :class:`~paravt_agent.config.ModelSpec`), made on first use (it may load
        a model: async callers use :meth:`apolicy_for`)."""
        key = spec.model_dump_json(exclude={"box_coordinates"})
        with _OTHERS_LOCK:
            if key not in self.others:
                api_key = os.environ.get(spec.api_key_env) if spec.api_key_env else None
                self.others[key] = make_policy(spec.backend, model=spec.model, endpoint=spec.endpoint,
                                               api_key=api_key)
            return self.others[key]

    async def apolicy_for(self, spec) -> Policy:
        key = spec.model_dump_json(exclude={"box_coordinates"})
        known = self.others.get(key)
        return known if known is not None else await asyncio.to_thread(self.policy_for, spec)

    async def tool_policy(self, tool: str) -> tuple[Policy, bool]:
        """The model a model-backed tool asks, and whether its calls are the trained policy's: the model the config
        names for it, else the frozen tool model (``tool_default``), else the policy (the only trainable case)."""
        spec = self.config.tool_models.get(tool)
        if spec is not None:
            return await self.apolicy_for(spec), False
        return (self.policy, True) if self.tool_default is None else (self.tool_default, False)

    def resolve_video(self, video: str) -> str:
        return self.video_resolver(video) if self.video_resolver is not None else video

    def video(self, path: str) -> ToolContext:
        """The run's tool context, opening ``path`` the first time (a resumed run, LangGraph Server)."""
        with self._lock:
            if self.tool_context is None:
                f = self.config.frames
                reader = VideoReader(local_video(path), backend=f.backend)
                self.tool_context = ToolContext(video=reader, frames=f,
                                                strict_video_path=self.config.strict_video_path)
            return self.tool_context


def tool_schemas(config: AgentConfig, tools) -> list[dict]:
    """The tools as the planner's prompt describes them: where the config's layout names a literal schema
    (a released protocol's exact wording), it replaces the native schema of the tool it names."""

    literal = TOOL_SCHEMAS.get(config.layout.tool_schema)
    named = (literal or {}).get("function", {}).get("name")
    return [literal if named is not None and t.name == named else t.schema() for t in tools]


def system_prompt(config: AgentConfig, tools) -> str:
    if config.mode == "none":
        return config.system_prompt or NO_TOOL_SYSTEM_PROMPT
    if config.system_prompt:
        return config.system_prompt
    return layout_system_prompt(config.layout, tool_schemas(config, tools), sequential=config.mode == "sequential")


def check_input(config: AgentConfig, policy: Policy, question: str, options: Sequence[str] | None = None) -> None:
    """Refuse (:class:`PromptTooLong`) a question or option over its token limit, before any model work: a text no
    longer in UTF-8 bytes than its limit passes untokenised (a token is at least one byte), one over 16 bytes per
    token of its limit is refused untokenised, the rest are counted with the model's tokenizer file alone (no model
    loads). Each refusal says how to raise the limit."""
    if not question or not question.strip():
        raise ParaVTError("the question is empty: ask something about the video")
    items = [("question", question, config.max_question_tokens, "max_question_tokens")]
    items += [(f"option {chr(65 + i)}", str(o), config.max_option_tokens, "max_option_tokens")
              for i, o in enumerate(options or ())]
    for what, text, limit, key in items:
        if not text.strip():
            raise ParaVTError(f"the {what} is empty: give every option some text")
        size = len(text.encode("utf-8", "replace"))
        if size <= limit:
            continue
        n = None if size > 16 * limit else policy.count_text_tokens(text)
        n = -(-size // 2) if n is None and size <= 16 * limit else n
        if n is not None and n <= limit:
            continue
        count = f"{n} tokens" if n is not None else f"{size} bytes, far over {limit} tokens"
        need = n if n is not None else size
        raise PromptTooLong(f"the {what} is {len(text)} characters ({count}); the limit is {limit} tokens ({key}). "
                            f"Shorten it, or raise the limit: `paravt answer --set {key}={need}` (as `paravt api "
                            f"--set`), AgentConfig({key}={need}) in the SDK")


def check_prompt(config: AgentConfig, policy: Policy, messages: list[dict]) -> None:
    """The planner's first prompt and its answer budget must fit the model's context (where known)."""
    window = policy.context_length
    if not window:
        return
    budget = config.planner_sampling.max_new_tokens
    bound = policy.prompt_token_bound(messages)
    if bound is not None and bound + budget <= window:  # fits for sure: no encoding here
        return
    n = policy.count_tokens(messages)
    if n is not None and n + budget > window:
        raise PromptTooLong(f"the prompt is {n} tokens; with the {budget}-token answer budget it is over the "
                            f"model's {window}-token context (use fewer frames or a shorter question)")


def prepare_input(config: AgentConfig, policy: Policy, tools, video: str | os.PathLike, question: str,
                  options: Sequence[str] | None = None, n_frames: int | None = None) -> RolloutInput:
    """Decode the overview and build the planner's first messages (no model call)."""

    check_input(config, policy, question, options)
    f = config.frames
    reader = VideoReader(local_video(video), backend=f.backend)
    t_overview = time.perf_counter()
    overview = reader.overview(n_frames, f)
    overview_latency = time.perf_counter() - t_overview
    info = overview.info
    ctx = ToolContext(video=reader, frames=f, strict_video_path=config.strict_video_path)
    messages = layout_planner_messages(
        config.layout, system_prompt(config, tools), overview.frames, overview.timestamps, info.duration, question,
        options, video_name=os.path.basename(os.fspath(video)),
    )
    check_prompt(config, policy, messages)
    trace = Trace(
        video=os.fspath(video), question=question, options=list(options) if options else None,
        mode=config.mode, duration=info.duration, overview_timestamps=list(overview.timestamps),
        warnings=[f"overview: {w}" for w in overview.warnings], overview_latency=overview_latency,
    )
    return RolloutInput(question, list(options) if options else None, messages, ctx, trace,
                        n_frames if n_frames is not None else f.n_frames, overview_started=t_overview)
