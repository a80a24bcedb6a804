"""The reference of every configuration field, generated from the pydantic models (``docs/config.md``).

    python -m paravt_train.config_reference > docs/config.md

Each field is documented once, in its model; this page, the YAML files and the
``--set key=value`` overrides all name the same fields. A test checks the page
is current and that no field lacks a description.
"""

from __future__ import annotations

import json

from pydantic import BaseModel

from paravt_agent.config import AgentConfig, CollabAgent, CollabConfig, Layout, ModelSpec
from paravt_agent.types import Sampling
from paravt_agent.video import FrameConfig
from paravt_train.rewards import JudgeSettings, RewardConfig
from paravt_train.rl.config import GRPOConfig, ReplaySettings
from paravt_train.sft.config import LoraSettings, SFTConfig
from paravt_train.toy.build import ToyConfig

__all__ = ["MODELS", "render", "undocumented"]


def _models() -> list[tuple[str, type[BaseModel], str]]:
    return [
        ("AgentConfig", AgentConfig, "the agent (`Agent(config=...)`, `paravt answer --config/--set`, a model's "
                                     "`agent_config.yaml`)"),
        ("Layout", Layout, "`AgentConfig.layout`: prompts and tool-result layout (set by `preset`, docs/presets.md)"),
        ("FrameConfig", FrameConfig, "`AgentConfig.frames`, `SFTConfig.frames`: the frame protocol"),
        ("Sampling", Sampling, "`AgentConfig.planner_sampling` / `subagent_sampling` / `tool_sampling`, "
                               "`CollabConfig.agent_sampling`"),
        ("CollabConfig", CollabConfig, "`AgentConfig.collab`: the collaborative mode (VideoChat-M1)"),
        ("CollabAgent", CollabAgent, "`CollabConfig.agents[]`: one agent of the pool"),
        ("ModelSpec", ModelSpec, "`AgentConfig.tool_models[tool]`, `CollabAgent.model`: another model than the "
                                 "agent's policy"),
        ("SFTConfig", SFTConfig, "`paravt-train sft --config/--set`"),
        ("LoraSettings", LoraSettings, "`SFTConfig.lora`"),
        ("GRPOConfig", GRPOConfig, "`paravt-train grpo` and `paravt-train online` (`--config/--set`)"),
        ("RewardConfig", RewardConfig, "`GRPOConfig.reward`"),
        ("JudgeSettings", JudgeSettings, "`RewardConfig.judge`"),
        ("ReplaySettings", ReplaySettings, "`GRPOConfig.replay`"),
        ("ToyConfig", ToyConfig, "`paravt-train toy --set`"),
    ]


MODELS = _models


def _default(field) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return f"`{type(value).__name__}()`"
    # a list of settings objects (e.g. ToyConfig.then) as the YAML/JSON a user would write
    text = json.dumps(value, default=lambda v: v.model_dump() if isinstance(v, BaseModel) else str(v),
                      ensure_ascii=False)
    return f"`{text}`"


def _type(annotation) -> str:
    import typing

    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(str(a) for a in typing.get_args(annotation))
    text = getattr(annotation, "__name__", None) if typing.get_origin(annotation) is None else None
    text = text or str(annotation)
    return text.replace("typing.", "").replace("NoneType", "None").replace("|", "\\|")


def undocumented() -> list[str]:
    """``Model.field`` of every field without a description."""
    return [f"{name}.{key}" for name, model, _ in _models() for key, f in model.model_fields.items()
            if not (f.description or "").strip()]


def render() -> str:
    lines = ["# Configuration reference", "",
             "Generated from the code by `python -m paravt_train.config_reference` (a test keeps it current).",
             "Every field is set in YAML (`--config`) or with `--set key=value` (dotted keys for nested models, "
             "e.g. `--set reward.gamma=0`); defaults are the paper's values where it gives one.", ""]
    for name, model, where in _models():
        doc = " ".join((model.__doc__ or "").strip().split("\n\n")[0].split())
        lines += [f"## {name}", "", f"{doc} Used by {where}.", "", "| field | type | default | meaning |",
                  "|---|---|---|---|"]
        for key, f in model.model_fields.items():
            desc = (f.description or "").replace("\n", " ").replace("|", "\\|")
            lines.append(f"| `{key}` | {_type(f.annotation)} | {_default(f)} | {desc} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
