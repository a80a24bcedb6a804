"""PARA-GRPO settings (:class:`GRPOConfig`) and the RL prompts it trains on.

Every field is documented once, with the paper's value as its default where the
paper gives one (Table 4). Presets set the three components the paper adds to
GRPO; every component stays its own field, so the ablations of Table 2 (Block B)
are overrides: ``--set preset=vanilla-grpo --set gating=true``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from paravt_agent.config import load_yaml_model
from paravt_agent.errors import ConfigError
from paravt_train.rewards import RewardConfig

__all__ = ["PRESETS", "GRPOConfig", "PromptItem", "ReplaySettings", "prompts_from_rl"]

PRESETS = {
    "para-grpo": {"think_prefix": True, "gating": True, "reward": {"anchor": True}},
    "vanilla-grpo": {"think_prefix": False, "gating": False, "reward": {"anchor": False}},
}


class ReplaySettings(BaseModel):
    """AVATAR's stratified replay buffer (off by default)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    capacity: int = Field(512, ge=1, description="Sequences kept.")
    per_step: int = Field(8, ge=0, description="Replayed sequences mixed into each update.")
    alpha: float = Field(0.6, ge=0, description="Weight of the off-policy (replayed) term.")
    tiers: tuple[float, float, float] = Field((0.40, 0.35, 0.25), description="Hard / Medium / Easy shares.")
    baseline_window: int = Field(20, ge=1, description="A prompt's baseline: mean of its last N rewards.")


class GRPOConfig(BaseModel):
    """PARA-GRPO settings. Defaults follow the paper's Table 4 where it gives a value."""

    model_config = ConfigDict(extra="forbid")

    preset: Literal["para-grpo", "vanilla-grpo", "custom"] = Field(
        "para-grpo", description="Defaults for think_prefix / gating / reward.anchor; explicit fields win.")
    model: str = Field(description="Initial policy: a model directory (e.g. the SFT cold start).")
    data: str | None = Field(None, description="RL Parquet file or dataset directory (None for `online`).")
    video_root: str | None = None
    eval_data: str | None = Field(None, description="Held-out RL Parquet scored greedily before and after.")
    eval_n_frames: int | None = Field(8, description="Overview frames for the held-out evaluation.")
    eval_limit: int | None = Field(None, description="At most this many held-out prompts.")
    output_dir: str = "runs/grpo"
    backend: Literal["local", "sglang"] = "local"
    endpoint: str | None = Field(None, description="SGLang server URL (backend sglang).")
    weight_sync: Literal["disk", "tensor"] = Field(
        "disk", description="How updated weights reach the SGLang server: disk = /update_weights_from_disk (the "
                            "server reads a directory rank 0 writes); tensor = /update_weights_from_tensor "
                            "(co-located server on the same machine: tensors pass as shared-memory/CUDA IPC "
                            "handles, nothing is written).")
    sglang_tp_size: int = Field(1, ge=1, description="Tensor-parallel size of the SGLang server (weight_sync: "
                                                     "tensor sends one payload per TP rank).")
    agent_config: str | None = Field(None, description="Agent YAML; default: the model's agent_config.yaml.")
    # rollouts
    steps: int = Field(100, ge=1)
    prompts_per_step: int = Field(4, ge=1)
    group_size: int = Field(8, ge=2, description="G rollouts per prompt.")
    temperature: float = Field(0.7, gt=0, description="Sampling temperature τ of every rollout call.")
    top_p: float = 1.0
    max_new_tokens: int = Field(2048, ge=1, description="Planner tokens per turn.")
    subagent_max_new_tokens: int = Field(256, ge=1)
    think_prefix: bool = Field(True, description="Pin every planner response to start with <think>\\n.")
    gating: bool = Field(True, description="nFrames gating: n per prompt from gating_choices.")
    gating_choices: list[int] = Field(default_factory=lambda: [4, 8, 16, 32, 64])
    train_subagents: bool = Field(True, description="Sub-agent summaries share the episode's advantage and "
                                                    "enter the loss (end-to-end, as in the paper).")
    concurrency: int = Field(4, ge=1, description="Prompts rolled out at once (each runs G rollouts).")
    rollout_batch: int = Field(16, ge=1, description="Backend local: concurrent model calls generated as one "
                                                     "batch (the G rollouts of a prompt, the K sub-agents).")
    # objective
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward weights (reward_bias -0.2 "
                                                                          "unless set).")
    lr: float = 2e-6
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    clip: float = Field(0.2, description="PPO ratio clip ε.")
    kl_coef: float = Field(0.01, ge=0, description="KL to the frozen initial policy; 0 = no reference model.")
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    aggregation: Literal["seq-mean", "token-mean", "constant"] = "seq-mean"
    advantage_scale: Literal["std", "none"] = Field("std", description="none = Dr. GRPO (no std division).")
    advantage_eps: float = 1e-6
    ppo_epochs: int = Field(1, ge=1, description="Updates per batch of rollouts (1 = on-policy).")
    micro_batch_size: int = Field(4, ge=1, description="Sequences per forward pass.")
    tas_lambda: float = Field(0.0, ge=0, description="AVATAR Temporal Advantage Shaping λ (0 = off).")
    replay: ReplaySettings = Field(default_factory=ReplaySettings)
    # bookkeeping
    save_every: int = Field(10, ge=1)
    sync_every: int = Field(1, ge=1, description="Steps between weight syncs to the rollout server.")
    seed: int = 0
    resume: bool = True
    gradient_checkpointing: bool = False

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, data):
        if not isinstance(data, dict):
            return data
        data = dict(data)
        reward = data.get("reward")
        if reward is None or isinstance(reward, dict):
            reward = dict(reward or {})
            reward.setdefault("reward_bias", -0.2)  # the paper's RL reward bias
        preset = PRESETS.get(data.get("preset", "para-grpo"), {})
        for key, value in preset.items():
            if key == "reward":
                if isinstance(reward, dict):
                    for k, v in value.items():
                        reward.setdefault(k, v)
            else:
                data.setdefault(key, value)
        data["reward"] = reward
        return data

    @classmethod
    def from_yaml(cls, path, overrides=None) -> GRPOConfig:
        return load_yaml_model(cls, path, overrides)


@dataclass
class PromptItem:
    """One RL prompt: what the agent is asked and what the reward checks against."""

    id: str
    video: str
    question: str
    options: list[str] | None
    answer: object  # a letter / text, or [start, end] for tvg
    task: str


def prompts_from_rl(path: str, video_root: str | None = None, limit: int | None = None) -> list[PromptItem]:
    """RL Parquet rows → prompts (the first video of each row; ids default to the row number)."""
    from paravt_train.data import load_rl, resolve_video

    out = []
    for i, s in enumerate(load_rl(path, video_root)):
        if not s.videos:
            raise ConfigError(f"{path}: row {i} has no video")
        out.append(PromptItem(s.id or f"row{i}", str(resolve_video(s.videos[0], video_root)), s.question_text(),
                              s.options, s.answer_value, s.question_type))
    return out[:limit] if limit else out
