"""``AgentConfig``: every setting of the agent in one pydantic model, defaults = the paper's protocol."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from paravt_agent.errors import ConfigError
from paravt_agent.types import Sampling
from paravt_agent.video.sampling import FrameConfig

__all__ = ["AGENT_CONFIG_FILE", "AgentConfig", "FrameConfig", "apply_overrides", "load_yaml_model",
           "resolve_agent_config"]

#: The file a trained model directory carries: the agent settings (frame protocol, limits) it was trained with.
AGENT_CONFIG_FILE = "agent_config.yaml"


class AgentConfig(BaseModel):
    """How the agent sees the video, dispatches, samples and times out. Loadable from YAML, overridable
    from the CLI (``--set key=value``); a model directory's ``agent_config.yaml`` holds the one it was
    trained with (:meth:`for_model`)."""

    model_config = ConfigDict(extra="forbid")

    frames: FrameConfig = Field(default_factory=FrameConfig, description="The frame protocol (paper, Appendix B).")
    mode: Literal["parallel", "sequential", "none"] = Field(
        "parallel",
        description="parallel: K calls in one turn (ParaVT); sequential: one call per turn (the paper's "
        "baseline); none: answer from the overview.",
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
    strict_video_path: bool = Field(True, description="A video_path naming another file is an invalid call.")
    planner_sampling: Sampling = Field(default_factory=lambda: Sampling(max_new_tokens=1024),
                                       description="Decoding of planner turns (greedy by default).")
    subagent_sampling: Sampling = Field(default_factory=lambda: Sampling(max_new_tokens=256),
                                        description="Decoding of sub-agent summaries (greedy by default).")
    planner_timeout: float = Field(300.0, gt=0, description="Seconds per planner attempt.")
    subagent_timeout: float = Field(60.0, gt=0, description="Seconds per sub-agent attempt (its crop and summary).")
    retries: int = Field(1, ge=0, description="Retries per node on transient failures (timeouts, endpoint errors).")
    request_timeout: float = Field(900.0, gt=0, description="Seconds for a whole question; past it the run stops "
                                   "and the trace says so (what finished is kept).")
    max_concurrency: int = Field(16, ge=1, description="Sub-agents running at once.")
    system_prompt: str | None = Field(None, description="Planner system prompt; None = the paper's (Appendix C).")
    subagent_prompt: str | None = Field(None, description="Sub-agent system prompt; None = the built-in one.")

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

    def override(self, overrides: list[str]) -> AgentConfig:
        return apply_overrides(self, overrides)


def resolve_agent_config(config: str | Path | None = None, model: str | Path | None = None,
                         overrides: list[str] | None = None) -> AgentConfig:
    """The agent config of an entry point (CLI, evaluation, demo): ``config`` (a YAML file) if given, else
    the model directory's ``agent_config.yaml`` if it has one, else the defaults; then ``overrides``."""
    if config:
        cfg = AgentConfig.from_yaml(config)
    else:
        model_dir = Path(model) if model else None
        cfg = AgentConfig.for_model(model_dir) if model_dir is not None and model_dir.is_dir() else None
        cfg = cfg or AgentConfig()
    return cfg.override(list(overrides)) if overrides else cfg


def _set_dotted(data: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    for k in keys[:-1]:
        data = data.setdefault(k, {})
        if not isinstance(data, dict):
            raise ConfigError(f"override {dotted}: {k} is not a section")
    data[keys[-1]] = value


def apply_overrides(model: BaseModel, overrides: list[str] | None) -> BaseModel:
    """``["mode=sequential", "frames.n_frames=8"]`` applied to a copy of ``model`` (values parsed as YAML)."""
    data = model.model_dump()
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. frames.n_frames=8)")
        key, raw = item.split("=", 1)
        _set_dotted(data, key.strip(), yaml.safe_load(raw))
    try:
        return type(model).model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"invalid {type(model).__name__}: {exc}") from None


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
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. frames.n_frames=8)")
        key, raw = item.split("=", 1)
        _set_dotted(data, key.strip(), yaml.safe_load(raw))
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{path}: invalid {cls.__name__}: {exc}") from None
