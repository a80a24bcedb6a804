"""The public types that cross ParaVT's layers, in one module.

What a policy returns (:class:`Generation`), what the graph records of every
model call (:class:`GenerationRecord`), how a later planner turn continues from
the exact tokens of an earlier one (:class:`Continuation`), what
``Agent.astream`` yields (the :data:`StreamEvent` types), what a prepared prompt
is (:class:`RolloutInput`) and what an answer is (:class:`Answer`). The graph,
``Agent``, the Gradio page, evaluation and the RL rollout all speak these types;
nothing travels in string-keyed dicts or tuple positions between them.

::
    video + question ──Agent.prepare──► RolloutInput (overview frames, first messages, tool context)
        │
        ▼  graph: planner ─► sub-agents ─► aggregate ─► planner ...   (each model call: Generation)
        │        stream:  OverviewEvent, PlannerEvent, SubAgentEvent ..., AnswerEvent
        ▼
    Answer (text, choice/span, Trace, records: [GenerationRecord], messages)
        │
        ▼  paravt_train.rl.rollout: records → token sequences → rewards → GRPO
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from paravt_agent.trajectory import MemoryEntry, SubAgentRecord, Trace
from paravt_agent.video import FrameConfig, FrameGeometry, VideoReader

__all__ = [
    "Answer",
    "AnswerEvent",
    "CallInfo",
    "Continuation",
    "Generation",
    "GenerationRecord",
    "MemoryEvent",
    "OverviewEvent",
    "PlannedCall",
    "PlannerEvent",
    "ReviewEvent",
    "RolloutInput",
    "Sampling",
    "StreamEvent",
    "SubAgentEvent",
    "ToolContext",
]


class Sampling(BaseModel):
    """Decoding settings of one model call. ``temperature=0`` is greedy."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(0.0, ge=0, description="0 = greedy; the paper samples RL rollouts at τ = 0.7.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (1 = off).")
    top_k: int = Field(0, ge=0, description="Top-k sampling (0 = off).")
    min_p: float = Field(0.0, ge=0, le=1, description="Min-p sampling: tokens below min_p x the top token's "
                                                       "probability are dropped (0 = off).")
    max_new_tokens: int = Field(1024, ge=1, description="Tokens generated at most.")
    seed: int | None = Field(None, description="Sampling seed (reproducible sampling where the backend honours it).")
    stop: list[str] = Field(default_factory=list, description="Stop strings (the generation ends after them).")


@dataclass
class Generation:
    """What a policy returns for one call. ``text`` is the whole response, forced prefix included.

    Token-level fields are filled where the backend can (``local``, ``sglang``):
    ``prompt_ids`` are the exact tokens the model consumed (image placeholders
    expanded, as in the model's forward pass), ``prefix_ids`` the forced prefix's
    tokens (not sampled, never trained), ``output_ids`` the sampled tokens with
    their ``logprobs`` under ``logprob_temperature``; ``image_grid_thw`` are the
    (t, h, w) patch grids of the prompt's images as the processor computed them.
    ``retokenized`` says the prompt's earlier turns were not continued from their
    exact ids (a full re-render, or a server that re-tokenises).
    """

    text: str
    prefix: str = ""
    finish_reason: str = "stop"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency: float = 0.0
    prompt_ids: list[int] | None = None
    prefix_ids: list[int] | None = None
    output_ids: list[int] | None = None
    logprobs: list[float] | None = None
    logprob_temperature: float | None = None
    image_grid_thw: list[tuple[int, int, int]] | None = None
    retokenized: bool = False
    #: where ``prompt_ids`` come from: ``client`` (tokenised here, exactly what the model got), ``server`` (the
    #: ids the server reported consuming) or ``round_trip`` (emulating an old SGLang that re-tokenised them)
    prompt_source: Literal["client", "server", "round_trip"] = "client"
    #: the serving engine's weight version of the reply (SGLang: the string its last update named) and, for a
    #: reply an update interrupted, ``(version, start, end)`` spans over ``output_ids``
    weight_version: str | None = None
    weight_versions: list[tuple[str, int, int]] = field(default_factory=list)
    batch_size: int = 1
    #: where the call's time went, where the backend can tell: ``encode`` (chat template, processor),
    #: ``prefill`` (vision tower + prompt, to the first token), ``decode`` (the other tokens)
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):  # a checkpoint gives tuples back as lists
        if self.image_grid_thw is not None:
            self.image_grid_thw = [tuple(g) for g in self.image_grid_thw]
        self.weight_versions = [tuple(w) for w in self.weight_versions]

    @property
    def has_tokens(self) -> bool:
        return self.prompt_ids is not None and self.output_ids is not None and self.logprobs is not None


@dataclass(frozen=True)
class Continuation:
    """The conversation up to and including assistant message ``message_index`` was, token for token,
    ``generation``'s prompt ids + prefix ids + output ids (+ the end-of-turn token).

    A token backend renders only the messages after it and appends their tokens, so
    model output is never decoded and re-encoded. The graph passes the planner's
    last turn; backends without token ids ignore it."""

    message_index: int
    generation: Generation


@dataclass
class GenerationRecord:
    """One model call of an episode: who made it (``planner`` turn ``turn``, or the sub-agent of call
    ``index`` of that turn), the :class:`Generation`, and the prompt's frames in order (what a training
    forward pass needs besides the ids). In the graph's state a record holds its frames' content keys
    (``image_refs``, :mod:`paravt_agent.graph.frames`); the :class:`Answer` has the pixels in ``images``."""

    role: str  # "planner", "subagent", "tool:<name>" (a model-backed tool's call) or "agent:<name>" (collaborative)
    turn: int
    index: int | None
    generation: Generation
    images: list[np.ndarray] = field(default_factory=list)
    image_refs: list[str] = field(default_factory=list)
    #: the call went to the served policy (the weights RL trains); False: another model an operator named
    #: (a tool's or a collaborating agent's own endpoint), recorded but never trained
    trainable: bool = True


@dataclass
class ToolModel:
    """The model a model-backed tool calls (the served policy, or the endpoint the agent config names for the
    tool). ``await model.ask(messages, max_new_tokens=...)`` returns the reply's text; every call is recorded
    as a :class:`GenerationRecord` with role ``tool:<name>`` (token ids and logprobs where the backend gives
    them), so RL can train it or leave it frozen."""

    #: how the model writes boxes: ``pixels`` of the image it was shown, or ``relative-1000`` (the graph resolves the
    #: config's ``auto`` by the answering model's family)
    box_coordinates: str = "pixels"
    #: the answering model's frame geometry (:class:`~paravt_agent.video.FrameGeometry`: the size it sees an image at,
    #: which its pixel boxes are in); None when unknown (then the image's own size)
    geometry: FrameGeometry | None = None

    async def ask(self, messages: list[dict], max_new_tokens: int | None = None) -> str:  # pragma: no cover
        raise NotImplementedError


@dataclass
class ToolContext:
    """The session a tool call runs in: the one video it may read, the frame protocol
    (:class:`~paravt_agent.video.FrameConfig`) and whether a ``video_path`` argument must name that video."""

    video: VideoReader
    frames: FrameConfig = field(default_factory=FrameConfig)
    strict_video_path: bool = True
    #: what a model-backed tool asks its model through (:class:`ToolModel`); the graph gives each call its own
    model: ToolModel | None = None

    @property
    def duration(self) -> float:
        return self.video.info.duration


@dataclass
class PlannedCall:
    """One tool call of a planner turn after validation, as plain data (what the graph's state and a
    ``Send`` carry): its slot ``index``, the model's ``raw`` text, the tool ``name`` and ``arguments`` as the
    model wrote them, and either ``run_args`` (validated and checked against the video: what the tool runs
    with) or the ``error`` that fills its slot instead; ``label`` is a readable form, ``window`` the time
    window the tool declares for these arguments (``Tool.window``)."""

    index: int
    raw: str = ""
    name: str | None = None
    arguments: dict = field(default_factory=dict)
    run_args: dict | None = None
    label: str = ""
    window: tuple[float, float] | None = None
    error: str | None = None

    def __post_init__(self):
        if self.window is not None:  # a checkpoint gives sequences back as lists
            self.window = (float(self.window[0]), float(self.window[1]))

    @property
    def ok(self) -> bool:
        return self.error is None


# --------------------------------------------------------------------------- stream events


@dataclass(frozen=True)
class CallInfo:
    """One tool call of a planner turn as dispatched: its slot ``index``, label, time window (when it
    has one) and the error that replaced it (an invalid call)."""

    index: int
    label: str
    window: tuple[float, float] | None = None
    error: str | None = None


@dataclass(frozen=True)
class OverviewEvent:
    """The overview was decoded: the planner sees frames at ``timestamps`` of a ``duration``-second video."""

    kind: ClassVar[str] = "overview"
    timestamps: list[float]
    duration: float


@dataclass(frozen=True)
class PlannerEvent:
    """A planner turn finished: its text and the calls it dispatched (none when it answered)."""

    kind: ClassVar[str] = "planner"
    turn: int
    text: str
    calls: list[CallInfo] = field(default_factory=list)
    forced_final: bool = False


@dataclass(frozen=True)
class SubAgentEvent:
    """A tool call's slot is filled (a summary, a tool's text, or an error), as each finishes."""

    kind: ClassVar[str] = "subagent"
    turn: int
    record: SubAgentRecord


@dataclass(frozen=True)
class AnswerEvent:
    """The run ended; the last event of every stream."""

    kind: ClassVar[str] = "answer"
    answer: Answer


@dataclass(frozen=True)
class ReviewEvent:
    """The run paused before turn ``turn``'s tool calls ran (``AgentConfig.review_windows``): ``calls`` are the
    planned calls; resume the thread ``thread_id`` with ``Agent.astream_resume(thread_id, calls)`` (the
    calls as they are, edited, or fewer)."""

    kind: ClassVar[str] = "review"
    turn: int
    calls: list[PlannedCall]
    thread_id: str


@dataclass(frozen=True)
class MemoryEvent:
    """A collaborating agent finished its round (the collaborative mode): ``entry`` is what it wrote to the shared
    memory (a :class:`~paravt_agent.trajectory.MemoryEntry`: plan, tool outputs, key info, share decision)."""

    kind: ClassVar[str] = "memory"
    round: int
    entry: MemoryEntry


StreamEvent = OverviewEvent | PlannerEvent | SubAgentEvent | MemoryEvent | ReviewEvent | AnswerEvent


# --------------------------------------------------------------------------- inputs and results


@dataclass
class RolloutInput:
    """A prepared question: the decoded overview turned into the planner's first messages, and the tool
    context the calls run in. Built once by ``Agent.prepare`` and run any number of times (the G
    rollouts of a GRPO group share one)."""

    question: str
    options: list[str] | None
    messages: list[dict]
    context: ToolContext
    trace: Trace  # the trace every run starts from (video, question, overview timestamps)
    n_frames: int | None = None
    overview_started: float | None = None  # time.perf_counter() when decoding the overview began


@dataclass
class Answer:
    """The final answer text, the parsed choice or span where the question asks for one, the trace,
    every model call's record, and the planner's final conversation (frames included)."""

    text: str
    trace: Trace
    choice: str | None = None
    span: tuple[float, float] | None = None
    records: list[GenerationRecord] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)

    def __str__(self) -> str:
        return self.choice or self.text

    @property
    def ok(self) -> bool:
        """An answer came back and nothing went wrong (``trace.errors`` is empty; ``status == "ok"``)."""
        return self.trace.ok

    @property
    def status(self) -> str:
        """``ok``, ``degraded`` (answered, but ``trace.failed_calls`` tool calls failed in the runtime: the model
        answered from their error slots) or ``failed`` (no usable answer); see :attr:`Trace.status`."""
        return self.trace.status

    def planner_records(self) -> list[GenerationRecord]:
        return sorted((r for r in self.records if r.role == "planner"), key=lambda r: r.turn)

    def subagent_records(self) -> list[GenerationRecord]:
        return [r for r in self.records if r.role == "subagent"]

    def other_records(self) -> list[GenerationRecord]:
        """Model calls besides the planner's and the sub-agents': model-backed tools (``tool:<name>``) and
        collaborating agents (``agent:<name>``)."""
        return [r for r in self.records if r.role not in ("planner", "subagent")]
