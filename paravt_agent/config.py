"""``AgentConfig``: every setting of the agent in one pydantic model, defaults = the paper's protocol."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from paravt_agent.compat import REMOVED_IN
from paravt_agent.errors import ConfigError, explain_lines, explain_validation
from paravt_agent.protocol.presets import preset_settings
from paravt_agent.types import Sampling
from paravt_agent.video.geometry import FrameGeometry
from paravt_agent.video.sampling import FrameConfig

__all__ = ["AGENT_CONFIG_FILE", "AgentConfig", "CollabAgent", "CollabConfig", "FrameConfig", "Layout", "ModelSpec",
           "apply_overrides", "load_yaml_model", "merge_settings", "protocol_differences", "resolve_agent_config",
           "explain_lines", "explain_validation", "upgrade_keys"]

#: The file a trained model directory carries: the agent settings (frame protocol, limits) it was trained with.
AGENT_CONFIG_FILE = "agent_config.yaml"


class Layout(BaseModel):
    """How the conversation is laid out: prompts, frame labels, tool schemas, tool results, the last turn.

    The defaults are this project's layout (what models trained here see); the presets of
    :mod:`paravt_agent.protocol.presets` set the layouts the released checkpoints were trained and evaluated with."""

    model_config = ConfigDict(extra="forbid")

    system: Literal["paravt", "paravt-rl", "paravt-eval", "hermes"] = Field(
        "paravt", description="Planner system prompt: paravt (paper Appendix C + a '# Tools' block), paravt-rl "
        "(Appendix C + Qwen's Hermes tools block, the released RL workflow), paravt-eval (the released eval "
        "driver's agentic prompt), hermes (the Hermes tools block alone). `system_prompt` replaces it.")
    tool_schema: Literal["native", "paravt-rl", "paravt-eval", "longvt"] = Field(
        "native", description="How crop_video is described to the planner: native (this project's schema) or the "
        "literal schema of a released source; other tools keep their native schema.")
    overview_intro: bool = Field(True, description="A 'Video: NAME, duration ...' line before the overview frames.")
    frame_labels: bool = Field(True, description="A '<t seconds>' text label before each overview frame.")
    mcq_instruction: str = Field("Answer with the option's letter.", description="Line after an MCQ's options.")
    question_suffix: str = Field("", description="Appended to the question text; {video_name} is the file name.")
    evidence: Literal["summary", "frames"] = Field(
        "summary", description="summary: a sub-agent (same policy) summarises each crop into text (ParaVT); "
        "frames: the crop's frames go straight to the planner (the released eval driver, LongVT).")
    tool_response: Literal["turn", "per_call", "blocks"] = Field(
        "turn", description="turn: ONE user turn '<tool_response>[1] label: text ...' per tool turn; per_call: one "
        "user message '<tool_response>\\n...\\n</tool_response>' per call (released RL and eval); blocks: one "
        "user turn with a <tool_response> block per call (a Hermes chat template's tool turn).")
    evidence_text: str = Field(
        "{n} frames from {start:.1f}s to {end:.1f}s.", description="The text of a frames-mode result; {n}, "
        "{start}, {end} (seconds).")
    error_text: str = Field("[Error: {error}]", description="A failed call's text in per_call / blocks layouts.")
    extra_calls: Literal["error", "drop"] = Field(
        "error", description="Calls past max_calls_per_turn: an error slot each (error) or silently dropped (drop, "
        "the released eval driver).")
    subagent: Literal["paravt", "paravt-rl"] = Field(
        "paravt", description="Sub-agent prompt: paravt (system prompt, labelled frames, the question if "
        "question_to_subagents) or paravt-rl (the released RL sub-agent: no system prompt, unlabelled frames, "
        "'You are analyzing a video segment from MM:SS to MM:SS ...', never the question).")
    final_turn: Literal["ask", "after_tools", "none"] = Field(
        "ask", description="When max_turns is used up: ask (the planner's next response still calls tools: ask "
        "again with final_prompt), after_tools (right after the last tool turn's results, add final_prompt and "
        "take the next response as final: the released eval driver), none (stop: the released RL workflow).")
    final_prompt: str = Field("The tool budget is used up. Give your final answer now, without calling tools.",
                              description="The forced last turn's instruction for MCQ questions.")
    final_prompt_open: str | None = Field(None, description="... for other questions (None = final_prompt).")
    final_max_new_tokens: int | None = Field(None, ge=1, description="Token cap of the forced last turn "
                                             "(None = planner_sampling's).")
    final_max_new_tokens_open: int | None = Field(None, ge=1, description="... for other questions (None = "
                                                  "final_max_new_tokens).")
    grounding_question: str | None = Field(
        None, description="Evaluation: the question text of a temporal-grounding item, with {query} (the "
        "sentence to find); None = the benchmark's own wording.")


class ModelSpec(BaseModel):
    """Another model than the agent's policy: a backend (``openai``, ``sglang``, ``local`` or a plugin's), the
    model and its endpoint. The API key, where one is needed, is read from the environment variable
    ``api_key_env`` (never written in a config file)."""

    model_config = ConfigDict(extra="forbid")

    backend: str = Field("openai", description="Policy backend of this model (as the CLIs' --backend).")
    model: str | None = Field(None, description="Model name or directory (the backend's `model`).")
    endpoint: str | None = Field(None, description="Its OpenAI-compatible or SGLang endpoint URL.")
    api_key_env: str | None = Field(None, description="Environment variable holding its API key.")
    box_coordinates: Literal["auto", "pixels", "relative-1000"] | None = Field(
        None, description="How this model writes boxes (spatial_grounding); None = AgentConfig.box_coordinates.")


class CollabAgent(BaseModel):
    """One agent of the collaborative mode's pool: its name (the key of its shared-memory entry) and, optionally,
    its own model (None: the agent's policy, so its calls are records of the policy RL trains)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,40}$", description="The agent's name (its memory key).")
    model: ModelSpec | None = Field(None, description="Its own model; None = the agent's policy.")
    focus: str = Field("", description="A line added to its instructions (e.g. 'look for people and actions').")
    vision: bool = Field(True, description="A vision-language agent that sees the overview frames; false: a "
                         "text-only agent (VideoChat-M1's LLM agents) whose prompts hold no frames: its tools see "
                         "the video (a crop's summary and a model-backed tool ask the agent's policy, or tool_models, "
                         "never the agent's own text model).")


class CollabConfig(BaseModel):
    """The collaborative mode (VideoChat-M1): a pool of agents plan and use tools, share what they found in a
    memory buffer, and answer together (``protocol``)."""

    model_config = ConfigDict(extra="forbid")

    agents: list[CollabAgent] = Field(
        default_factory=lambda: [CollabAgent(name="scout"), CollabAgent(name="checker")],
        description="The pool (1-8 agents); names are unique.")
    protocol: Literal["cpp", "rounds"] = Field(
        "cpp", description="cpp: VideoChat-M1's collaborative policy planning (each agent plans an ordered tool "
        "list, runs one tool per turn, after every tool step reads the memory buffer and the other agents' outputs "
        "and decides continue() or add tool, then answers; the consensus answer wins, the synthesizer answers only "
        "without one); rounds: each agent plans, calls tools, notes key info and decides whether to share, once a "
        "round, and the synthesizer answers from the memory.")
    turns: int = Field(5, ge=1, le=8, description="cpp: tool steps an agent takes at most (VideoChat-M1: 5 turns), "
                       "then it answers; rounds: the rounds.")
    consensus: Literal["majority", "unanimous"] = Field(
        "majority", description="cpp: the answer that wins, with a reason summary over the agents that gave it: one "
        "a strict majority of the pool gave (majority), or every agent (unanimous). Without one the synthesizer "
        "answers from the memory. Answers agree when they name the same option (multiple choice), the same span "
        "(IoU >= 0.5, grounding) or the same words (open-ended).")
    reason_summary: bool = Field(True, description="cpp: with a consensus, the policy writes the reason summary of "
                                 "the agreeing agents (VideoChat-M1's 'Reason Summary' prompt); false: their reasons "
                                 "are joined as they are (one model call fewer).")
    dropout: float = Field(0.0, ge=0, lt=1, description="cpp: agent dropout (VideoChat-M1's regulariser): each agent "
                           "is dropped from the communication with this probability per episode (it works and "
                           "answers alone; the others do not see its outputs). Applied only where the agents sample "
                           "(agent_sampling temperature > 0: RL rollouts), never in greedy runs.")
    max_memory_chars: int = Field(4000, ge=200, description="Characters of shared memory an agent or the "
                                  "synthesizer reads at most (the newest entries kept).")
    max_calls_per_agent: int = Field(4, ge=0, description="rounds: tool calls one agent may make in one round; cpp: "
                                     "tools one plan may list.")
    agent_sampling: Sampling = Field(default_factory=lambda: Sampling(max_new_tokens=512),
                                     description="Decoding of the agents' turns.")

    @model_validator(mode="after")
    def _names(self):
        names = [a.name for a in self.agents]
        if not 1 <= len(names) <= 8 or len(set(names)) != len(names):
            raise ValueError(f"collab.agents needs 1-8 agents with unique names, got {names}")
        return self


class AgentConfig(BaseModel):
    """How the agent sees the video, dispatches, samples and times out. Loadable from YAML, overridable
    from the CLI (``--set key=value``); a model directory's ``agent_config.yaml`` holds the one it was
    trained with (:meth:`for_model`)."""

    model_config = ConfigDict(extra="forbid")

    #: what a user sets, by topic (docs/config.md lists these first; the rest is advanced)
    user_settings: ClassVar[dict[str, tuple[str, ...]]] = {
        "protocol": ("preset", "mode", "tools", "think_prefix"),
        "budget": ("frames", "max_turns", "max_calls_per_turn", "planner_sampling", "subagent_sampling",
                   "request_timeout"),
    }

    preset: str = Field(
        "paravt", description="Protocol preset (paravt_agent.protocol.presets): paravt (this project's layout), "
        "paravt-rl, paravt-eval (the released ParaVT-8B's RL workflow and eval driver), longvt, weaver, "
        "videochat-m1. It supplies every setting not given explicitly; a training method names its own "
        "(paravt_train/methods.py).")
    frames: FrameConfig = Field(default_factory=FrameConfig, description="The frame protocol (paper, Appendix B).")
    layout: Layout = Field(default_factory=Layout, description="The conversation layout (prompts, tool results).")
    mode: Literal["parallel", "sequential", "none", "collaborative"] = Field(
        "parallel",
        description="parallel: K calls in one turn (ParaVT); sequential: one call per turn (the paper's "
        "baseline, and Weaver's tool use); none: answer from the overview; collaborative: a pool of agents "
        "sharing a memory, answered by a synthesizer (VideoChat-M1; `collab`).",
    )
    max_calls_per_turn: int = Field(8, ge=1, description="K cap: calls beyond it get an error slot.")
    max_turns: int = Field(4, ge=0, description="Tool turns before the planner is asked for a final answer.")
    tools: list[str] = Field(default_factory=lambda: ["crop_video"], description="Tools offered to the planner.")
    think_prefix: str = Field(
        "<think>\n", description="Forced start of every planner response (paper, 3.2.1: Think Prefix); '' = off. "
        "The local and sglang backends pin it as tokens, the openai backend through continue_final_message "
        "(SGLang, vLLM); a backend that cannot pin it refuses it."
    )
    question_to_subagents: bool = Field(True, description="Sub-agents see the question (else: only the window).")
    subagent_report: Literal["full", "answer"] = Field(
        "full", description="What the planner reads of a sub-agent's reply: full (all of it) or answer (what follows "
        "its </think>: a sub-agent that thinks reports only its conclusion; all of it when it closed no think). The "
        "trace keeps the whole reply (a call's reply), and training learns the sub-agent's whole reply."
    )
    strict_video_path: bool = Field(True, description="A video_path naming another file is an invalid call.")
    planner_sampling: Sampling = Field(default_factory=lambda: Sampling(max_new_tokens=1024),
                                       description="Decoding of planner turns (greedy by default).")
    subagent_sampling: Sampling = Field(default_factory=lambda: Sampling(max_new_tokens=256),
                                        description="Decoding of sub-agent summaries (greedy by default).")
    tool_sampling: Sampling = Field(default_factory=lambda: Sampling(max_new_tokens=128),
                                    description="Decoding of model-backed tools' model calls (greedy by default).")
    box_coordinates: Literal["auto", "pixels", "relative-1000"] = Field(
        "auto", description="How the policy writes a box's bbox_2d (spatial_grounding): pixels of the image as it saw "
        "it (the Qwen2.5-VL family) or 0-1000 relative to its sides (Qwen3-VL, this project's, and Qwen2-VL); auto = "
        "by the model's family, read from its config (model_type) or its served name, pixels when unknown. "
        "<|box_start|> boxes are always 0-1000.")
    tool_models: dict[str, ModelSpec] = Field(
        default_factory=dict, description="Model-backed tools that ask another model than the agent's policy: tool "
        "name -> backend/model/endpoint. Unnamed tools ask the agent's policy (and RL may train those calls).")
    collab: CollabConfig = Field(default_factory=CollabConfig, description="The collaborative mode's pool and "
                                 "limits (mode: collaborative).")
    planner_timeout: float = Field(300.0, gt=0, description="Seconds per planner attempt.")
    subagent_timeout: float = Field(60.0, gt=0, description="Seconds per sub-agent attempt (its crop and summary).")
    retries: int = Field(1, ge=0, description="Retries per node on transient failures (timeouts, endpoint errors).")
    request_timeout: float = Field(900.0, gt=0, description="Seconds for a whole question; past it the run stops "
                                   "and the trace says so (what finished is kept).")
    max_concurrency: int = Field(16, ge=1, description="Sub-agents running at once.")
    review_windows: bool = Field(
        False, description="Pause before each turn's tool calls run (LangGraph interrupt) so the planned windows can "
        "be approved or edited; resume with Agent.astream_resume (a checkpointer is needed; in memory by default).")
    max_question_tokens: int = Field(
        4096, ge=1, description="Longest question in tokens (the model's tokenizer; without one here, one token per "
        "2 UTF-8 bytes): a longer one is refused before any model call (PromptTooLong), never truncated.")
    max_option_tokens: int = Field(512, ge=1, description="Longest answer option in tokens (as max_question_tokens).")
    system_prompt: str | None = Field(None, description="Planner system prompt; None = the paper's (Appendix C).")
    subagent_prompt: str | None = Field(None, description="Sub-agent system prompt; None = the built-in one.")

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data):
        """A preset's settings under the explicitly given ones (nested sections merged key by key)."""
        if not isinstance(data, dict):
            return data
        return merge_settings(preset_settings(data.get("preset", "paravt")), data)

    @model_validator(mode="after")
    def _collaborative(self):
        if self.mode == "collaborative" and self.review_windows:
            raise ValueError("review_windows pauses a planner's turn; the collaborative mode has no planner turns to "
                             "review (turn one of them off)")
        return self

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None) -> AgentConfig:
        return load_yaml_model(cls, path, overrides)

    @classmethod
    def for_model(cls, model: str | Path | None) -> AgentConfig | None:
        """The agent config a model directory was trained with (its ``agent_config.yaml``), or None.

        The one rule every entry point follows (SDK, CLIs, evaluation, training): a model directory's
        own file wins over the defaults; an explicit config wins over both."""
        if not model:
            return None
        path = Path(model) / AGENT_CONFIG_FILE
        return cls.from_yaml(path) if path.is_file() else None

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def bound_to(self, geometry: FrameGeometry | None) -> AgentConfig:
        """This config for a model of ``geometry`` (:meth:`FrameConfig.bound_to`: the frame unit and max pixels read
        from the model; a stated ``frames.factor`` that contradicts it is refused with a
        :class:`~paravt_agent.errors.ConfigError` naming both). ``self`` when the geometry is unknown."""
        frames = self.frames.bound_to(geometry)
        return self if frames == self.frames else self.model_copy(update={"frames": frames})

    def override(self, overrides: list[str]) -> AgentConfig:
        return apply_overrides(self, overrides)


def merge_settings(base: dict, top: dict) -> dict:
    """``top`` over ``base``, nested sections merged key by key (a pydantic model in ``top`` counts with the fields
    it was given). The one merge of the package: a protocol preset under an agent config's own settings, a
    training method under a GRPO config's (:mod:`paravt_train.methods`)."""
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge_settings(out[k], v)
        elif isinstance(v, BaseModel) and isinstance(out.get(k), dict):
            out[k] = merge_settings(out[k], v.model_dump(exclude_unset=True))
        else:
            out[k] = v
    return out


def upgrade_keys(data: dict, deprecated: dict[str, str | None], owner: str) -> dict:
    """``data`` with its deprecated keys moved: ``deprecated`` maps an old key to its new dotted key (a value given
    under the new key wins), or to None for a setting that is gone (dropped). Each old key warns, naming the new
    key and the release that stops reading it (a FutureWarning: shown to whoever runs the YAML)."""
    if not isinstance(data, dict) or not deprecated.keys() & data.keys():
        return data
    out = dict(data)
    for old, new in deprecated.items():
        if old not in out:
            continue
        value = out.pop(old)
        _warn_deprecated(owner, old, new)
        if new is None:
            continue
        *path, last = new.split(".")
        section = out
        for k in path:
            section[k] = dict(section.get(k) or {})
            section = section[k]
        section.setdefault(last, value)
    return out


def _warn_deprecated(owner: str, old: str, new: str | None) -> None:
    if new is None:
        warnings.warn(f"{owner}: `{old}` is no longer a setting and is ignored; delete it (refused from "
                      f"{REMOVED_IN})", FutureWarning, stacklevel=4)
        return
    top, _, rest = new.partition(".")
    where = f" (YAML `{top}: {{{rest}: ...}}`, or --set {new}=...)" if rest else ""
    warnings.warn(f"{owner}: `{old}` is renamed `{new}`{where}; `{old}` is refused from {REMOVED_IN}", FutureWarning,
                  stacklevel=4)


#: Settings that do not change what the model sees or writes (left out of protocol comparisons).
_RUNTIME_KEYS = {"planner_timeout", "subagent_timeout", "retries", "request_timeout", "max_concurrency",
                 "review_windows", "frames.backend", "frames.fast_overview", "planner_sampling.seed",
                 "subagent_sampling.seed", "preset", "frames.factor"}  # the frame unit: read from the model, not chosen


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def protocol_differences(trained: AgentConfig, used: AgentConfig) -> list[tuple[str, object, object]]:
    """``(setting, trained value, used value)`` for every setting that changes what the model sees or
    writes (prompts, frames, layout, limits, decoding), where ``used`` differs from ``trained``."""
    a, b = _flat(trained.model_dump(mode="json")), _flat(used.model_dump(mode="json"))
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
            if k not in _RUNTIME_KEYS and a.get(k) != b.get(k)]


def describe_differences(trained: AgentConfig, used: AgentConfig, limit: int = 12) -> str | None:
    """A note for the user when ``used`` departs from the protocol a model was trained with, else None."""
    diffs = protocol_differences(trained, used)
    if not diffs:
        return None

    def short(v) -> str:
        text = repr(v)
        return text if len(text) <= 40 else text[:37] + "..."

    lines = [f"  {k}: {short(a)} -> {short(b)}" for k, a, b in diffs[:limit]]
    if len(diffs) > limit:
        lines.append(f"  ... and {len(diffs) - limit} more")
    head = (f"note: this model was trained with the '{trained.preset}' protocol; {len(diffs)} setting(s) now "
            f"differ from it (answers may be less accurate):")
    return "\n".join([head, *lines])


def resolve_agent_config(config: str | Path | None = None, model: str | Path | None = None,
                         overrides: list[str] | None = None, preset: str | None = None,
                         notes: list[str] | None = None) -> AgentConfig:
    """The agent config of an entry point (CLI, evaluation, demo): ``config`` (a YAML file) if given, else
    ``preset`` if given, else the model directory's ``agent_config.yaml`` if it has one, else the defaults;
    then ``overrides``. When the model directory names a protocol and the result departs from it, a note
    saying which settings differ is appended to ``notes`` (the CLIs print it)."""
    model_dir = Path(model) if model else None
    trained = AgentConfig.for_model(model_dir) if model_dir is not None and model_dir.is_dir() else None
    if config:
        cfg = AgentConfig.from_yaml(config)
    elif preset:
        cfg = AgentConfig(preset=preset)
    else:
        cfg = trained or AgentConfig()
    cfg = cfg.override(list(overrides)) if overrides else cfg
    if trained is not None and notes is not None:
        note = describe_differences(trained, cfg)
        if note:
            notes.append(note)
    return cfg


def _set_dotted(data: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    for k in keys[:-1]:
        data = data.setdefault(k, {})
        if not isinstance(data, dict):
            raise ConfigError(f"override {dotted}: {k} is not a section")
    data[keys[-1]] = value


def _apply_dotted(data: dict, overrides: list[str] | None, cls: type | None = None) -> dict:
    """``key.sub=value`` items (values parsed as YAML) set into ``data`` in order; a deprecated key of ``cls``
    (its ``deprecated_keys``), in ``data`` or an item, is moved to its new name first, so the last one wins."""
    deprecated = getattr(cls, "deprecated_keys", {})
    owner = getattr(cls, "__name__", "config")
    data = upgrade_keys(data, deprecated, owner)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. frames.n_frames=8)")
        key, raw = item.split("=", 1)
        key, value = key.strip(), yaml.safe_load(raw)
        if key in deprecated:
            _warn_deprecated(owner, key, deprecated[key])
            if deprecated[key] is None:
                continue
            key = deprecated[key]
        _set_dotted(data, key, value)
    return data


def apply_overrides(model: BaseModel, overrides: list[str] | None) -> BaseModel:
    """``["mode=sequential", "frames.n_frames=8"]`` applied to a copy of ``model`` (values parsed as YAML).
    Overriding ``preset`` starts from that preset (keeping the other overrides)."""
    data = model.model_dump()
    preset = [o for o in overrides or [] if o.split("=", 1)[0].strip() == "preset"]
    if preset and isinstance(model, AgentConfig):
        data = {}
    data = _apply_dotted(data, overrides, type(model))
    try:
        return type(model).model_validate(data)
    except ValidationError as exc:
        raise ConfigError(explain_validation(exc, type(model), overrides)) from None


def load_yaml_model(cls: type[BaseModel], path: str | Path, overrides: list[str] | None = None):
    """``cls`` from a YAML file, with ``key=value`` overrides applied to the file's data before validation
    (so values derived while validating, e.g. a preset's defaults, follow the overrides)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    data = _apply_dotted(data, overrides, cls)
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(explain_validation(exc, cls, overrides, path)) from None
