"""``AgentConfig``: every setting of the agent in one pydantic model, defaults = the paper's protocol."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from paravt_agent.errors import ConfigError
from paravt_agent.policy.base import Sampling

__all__ = ["AgentConfig", "FrameConfig", "apply_overrides", "load_yaml_model"]


class FrameConfig(BaseModel):
    """The frame protocol (paper, Appendix B)."""

    model_config = ConfigDict(extra="forbid")

    fps: float = Field(1.0, gt=0, description="Overview sampling rate before uniform subsampling.")
    max_frames: int = Field(64, ge=1, description="Overview frame cap.")
    n_frames: int | None = Field(
        None, ge=1, description="Exactly this many overview frames (nFrames gating); None = the fps/max_frames rule."
    )
    max_pixels: int = Field(50176, ge=256, description="Pixel budget per frame (224x224).")
    factor: int = Field(32, ge=1, description="Frame sides are multiples of this: 32 for Qwen3-VL, 28 for Qwen2.5-VL.")
    fast_overview: bool = Field(False, description="Keyframe-snapped overview (faster on long videos).")
    crop_max_frames: int = Field(16, ge=1, description="Frames per crop (paper: at most 16).")
    crop_fps: float | None = Field(2.0, gt=0, description="Cap on crop frames per second; None = no cap.")
    backend: Literal["pyav", "decord", "torchcodec"] = Field("pyav", description="Video decoder.")


class AgentConfig(BaseModel):
    """How the agent dispatches, samples and times out. Loadable from YAML, overridable from the CLI."""

    model_config = ConfigDict(extra="forbid")

    frames: FrameConfig = Field(default_factory=FrameConfig)
    mode: Literal["parallel", "sequential", "none"] = Field(
        "parallel",
        description="parallel: K calls in one turn (ParaVT); sequential: one call per turn (the paper's "
        "baseline); none: answer from the overview.",
    )
    max_calls_per_turn: int = Field(8, ge=1, description="K cap: calls beyond it get an error slot.")
    max_turns: int = Field(4, ge=0, description="Tool turns before the planner is asked for a final answer.")
    tools: list[str] = Field(default_factory=lambda: ["crop_video"], description="Tools offered to the planner.")
    think_prefix: str = Field(
        "<think>\n", description="Forced start of every planner response (paper: Think Prefix); '' = off."
    )
    question_to_subagents: bool = Field(True, description="Sub-agents see the question (else: only the window).")
    strict_video_path: bool = Field(True, description="A video_path naming another file is an invalid call.")
    planner_sampling: Sampling = Field(default_factory=lambda: Sampling(max_new_tokens=1024))
    subagent_sampling: Sampling = Field(default_factory=lambda: Sampling(max_new_tokens=256))
    planner_timeout: float = Field(600.0, gt=0, description="Seconds per planner attempt.")
    subagent_timeout: float = Field(300.0, gt=0, description="Seconds per sub-agent attempt.")
    retries: int = Field(2, ge=0, description="Retries per node on transient failures (timeouts, endpoint errors).")
    max_concurrency: int = Field(16, ge=1, description="Sub-agents running at once.")
    system_prompt: str | None = Field(None, description="Planner system prompt; None = the paper's (Appendix C).")
    subagent_prompt: str | None = Field(None, description="Sub-agent system prompt; None = the built-in one.")

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None) -> AgentConfig:
        return load_yaml_model(cls, path, overrides)

    def override(self, overrides: list[str]) -> AgentConfig:
        return apply_overrides(self, overrides)


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
