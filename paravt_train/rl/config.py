"""PARA-GRPO settings (:class:`GRPOConfig`).

Every field is documented once, with the paper's value as its default where the
paper gives one (Table 4). ``method`` names a training method of
:mod:`paravt_train.methods` (para-grpo, vanilla-grpo, dapo, weaver,
videochat-m1): its training settings sit under the fields given here, and its
agent protocol follows (unless ``agent_config`` or ``agent.preset`` names
another). Every component the paper adds to GRPO stays its own field, so the
ablations of Table 2 (Block B) are overrides: ``--set method=vanilla-grpo --set
gating=true``; the think prefix, an agent setting, is ``--set
agent.think_prefix=''``.

The PPO trust region. ``para-grpo`` and ``vanilla-grpo`` take one optimizer step per
batch (``ppo_epochs`` 1 × ``mini_batches`` 1), as the paper's released recipe does
(AReaL ``ppo_n_minibatches: 1`` with ``recompute_logprob``: the ratio to the policy
before the update is exactly 1, so the clip never acts; the step is bounded by the
KL term, the learning rate and gradient clipping). ``metrics.jsonl`` logs
``clip_fraction`` and ``ratio_dev_max`` (the largest |ratio − 1|) so this is visible;
raise ``mini_batches`` for a trust region that acts (AReaL's own default is 4; ``dapo``
takes 4).

Keys of earlier releases (``preset``, ``think_prefix``) still load, with a warning naming the new key
(:attr:`GRPOConfig.deprecated_keys`).
"""

from __future__ import annotations

import warnings
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from paravt_agent.compat import REMOVED_IN
from paravt_agent.config import AgentConfig, explain_lines, load_yaml_model, merge_settings, upgrade_keys
from paravt_agent.errors import ConfigError
from paravt_agent.types import Sampling
from paravt_train.infra.lora import LoraSettings
from paravt_train.infra.tracking import ReportTo
from paravt_train.methods import DEFAULT_METHOD, MethodName, training_settings
from paravt_train.rewards import RewardConfig
from paravt_train.sync import check_weight_sync
from paravt_train.sync.config import FLAT_KEYS, SyncSettings

__all__ = ["GRPOConfig", "ReplaySettings", "check_served_sampling", "sampling_settings"]


class ReplaySettings(BaseModel):
    """AVATAR's stratified replay buffer (off by default; AVATAR, Section 4.1 and Eq. 11)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="Mix replayed rollouts into each update.")
    capacity: int = Field(512, ge=3, description="Rollouts kept over the three tiers (AVATAR: 10k).")
    per_step: int = Field(8, ge=0, description="Replayed rollouts mixed into each update (AVATAR: 4 of 8).")
    alpha: float = Field(0.6, ge=0, description="Weight of the off-policy (replayed) term.")
    tiers: tuple[float, float, float] = Field((0.40, 0.35, 0.25), description="Hard / Medium / Easy: tier "
                                              "capacities, quantiles of R̄(q) and draw shares.")
    baseline_window: int = Field(20, ge=1, description="VCRS R̄(q): mean of a prompt's last N on-policy rollout "
                                                       "rewards (AVATAR: 20).")
    min_std: float = Field(0.1, gt=0, description="Floor of Eq. 11's σ_R,off. σ is the spread of the step's rewards, "
                                                  "the off-policy draws and the on-policy rollouts together, over "
                                                  "every rank (the draws alone are often one or a few equal "
                                                  "rewards, such as every well-formed wrong MCQ: dividing by their "
                                                  "spread gave |A| of 10 and more).")
    max_advantage: float | None = Field(None, gt=0, description="|A_off| is clipped here: a replayed rollout weighs "
                                        "no more than an on-policy one can (None = √(G−1), the largest |A| a "
                                        "group of G gives under group normalisation: 2.65 for G = 8).")


class EvalSettings(BaseModel):
    """The held-out evaluation of a GRPO run: scored greedily before and after (``paravt-train eval``'s protocol)."""

    model_config = ConfigDict(extra="forbid")

    data: str | None = Field(None, description="Held-out RL Parquet scored greedily before and after, with "
                                               "`paravt-train eval`'s protocol and scorer.")
    n_frames: int | None = Field(None, ge=1, description="Overview frames of the held-out evaluation; None = the "
                                 "agent config's protocol (64 at 1 fps), as `paravt-train eval` uses.")
    limit: int | None = Field(None, ge=1, description="At most this many held-out prompts.")


class GRPOConfig(BaseModel):
    """PARA-GRPO settings. Defaults follow the paper's Table 4 where it gives a value."""

    model_config = ConfigDict(extra="forbid")

    #: what a user sets, by topic (docs/config.md lists these first, with each method's values; the rest is
    #: advanced: the paper's or the method's value)
    user_settings: ClassVar[dict[str, tuple[str, ...]]] = {
        "model": ("model", "backend", "endpoint", "agent_config"),
        "data": ("data", "video_root", "eval"),
        "method": ("method", "agent"),
        "budget": ("steps", "prompts_per_step", "group_size", "max_new_tokens", "subagent_max_new_tokens",
                   "micro_batch_size", "gradient_checkpointing"),
        "output": ("output_dir", "save_every", "report_to"),
    }
    #: keys of earlier releases: old -> new (None: gone), read with a FutureWarning until REMOVED_IN
    deprecated_keys: ClassVar[dict[str, str | None]] = {
        "preset": "method", "think_prefix": "agent.think_prefix", **FLAT_KEYS,
        "eval_data": "eval.data", "eval_n_frames": "eval.n_frames", "eval_limit": "eval.limit"}

    method: MethodName = Field(
        DEFAULT_METHOD, description="The training method (paravt_train/methods.py): para-grpo, vanilla-grpo, dapo, "
        "weaver, videochat-m1. It names its training settings (under the fields given here), its agent protocol "
        "(the model's own for the first three; unless agent_config or agent.preset names one) and its trainer.")
    agent: dict[str, Any] = Field(
        default_factory=dict, description="Agent settings (AgentConfig keys, nested) over the run's protocol and "
        "the method's agent settings, e.g. {think_prefix: ''} (the think prefix off: a Table 2 ablation) or "
        "{preset: paravt-rl}. Saved with the trained model's agent_config.yaml.")
    model: str = Field(description="Initial policy: a model directory (e.g. the SFT cold start).")
    data: str | None = Field(None, description="RL Parquet file or dataset directory (None for `online`).")
    video_root: str | None = Field(None, description="Relative video paths in the data are resolved against this.")
    eval: EvalSettings = Field(default_factory=EvalSettings, description="The held-out evaluation before and after "
                               "the run (`paravt-train eval`'s protocol and scorer).")
    output_dir: str = Field("runs/grpo", description="Checkpoints, metrics.jsonl, summary.json and the final model.")
    report_to: ReportTo = Field(default_factory=list, description="Experiment trackers that also receive every "
                                 "metric of metrics.jsonl and the run's config (rank 0): tensorboard, mlflow, wandb, "
                                 "trackio, several at once (a list or tensorboard,mlflow); none by default. Where "
                                 "each writes: paravt_train/infra/tracking.py.")
    backend: str = Field("local", description="The rollout policy, by name from the policy registry (any backend "
                                              "that returns token ids and logprobs): local (in this process with "
                                              "the trained parameters: one process, CPU or one GPU) or sglang (an "
                                              "SGLang server; torchrun + FSDP2 for the actor), or a plugin.")
    endpoint: str | None = Field(None, description="Rollout server URL (backend sglang; weight syncs go there).")
    sync: SyncSettings = Field(default_factory=SyncSettings, description="How the weights reach the rollout "
                               "servers (paravt_train/sync/): via disk, tensor, distributed or lora, every N steps, "
                               "the pause mode, the servers' keys.")
    lora: LoraSettings = Field(default_factory=LoraSettings, description="Train LoRA adapters (peft) instead of every "
                               "weight; the KL reference is the base (the adapter disabled). With backend sglang the "
                               "adapter is what is pushed (`sync.via: lora`) and what an online version keeps.")
    collective_timeout_minutes: float = Field(60.0, gt=0, description="Under torchrun: how long a rank waits in a "
                                              "collective (e.g. while rank 0 alone evaluates or pushes weights) "
                                              "before the job fails.")
    agent_config: str | None = Field(None, description="The run's agent protocol, as an agent YAML; default: the "
                                     "model's agent_config.yaml if it is the protocol wanted (agent.preset, else "
                                     "the method's), else that protocol's preset.")
    # rollouts
    steps: int = Field(100, ge=1, description="Policy updates.")
    prompts_per_step: int = Field(4, ge=1, description="Prompts per update (paper, Table 4: 7; divisible by the "
                                                       "number of training processes).")
    group_size: int = Field(8, ge=2, description="G rollouts per prompt (paper: 8).")
    temperature: float = Field(0.7, gt=0, description="Sampling temperature τ of every rollout call (paper: 0.7).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling of rollouts.")
    max_new_tokens: int = Field(2048, ge=1, description="Planner tokens per turn.")
    subagent_max_new_tokens: int = Field(256, ge=1, description="Sub-agent summary tokens.")
    gating: bool = Field(True, description="nFrames gating (paper, 3.2.2, Eq. 2): n per prompt drawn from "
                                           "gating_choices, the same for all G rollouts.")
    gating_choices: list[int] = Field(default_factory=lambda: [4, 8, 16, 32, 64],
                                      description="The overview sizes gating draws from (paper: {4, 8, 16, 32, 64}).")
    train_subagents: bool = Field(True, description="Sub-agent summaries share the episode's advantage and "
                                                    "enter the loss (end-to-end, as in the paper).")
    tool_model_calls: Literal["train", "freeze"] = Field(
        "train", description="Model-backed tools' calls to the policy (temporal_grounding, frame_selection, "
        "spatial_grounding; role tool:<name>): train them with the episode's advantage, or leave them frozen "
        "(recorded, never in the loss). Calls to another endpoint (agent config tool_models) are never trained.")
    failed_episodes: Literal["drop", "keep"] = Field(
        "drop", description="Episodes whose graph raised (their trace has errors): drop them from the group "
                            "and the loss, or keep them with their reward. Counted either way.")
    dynamic_sampling: bool = Field(False, description="DAPO: drop groups whose rewards are all equal (no "
                                                      "gradient) and roll out further prompts to refill the step.")
    max_sampling_rounds: int = Field(3, ge=1, description="Dynamic sampling: rounds of extra prompts per step.")
    concurrency: int = Field(4, ge=1, description="Prompts rolled out at once (each runs G rollouts).")
    rollout_batch: int = Field(16, ge=1, description="Backend local: concurrent model calls generated as one "
                                                     "batch (the G rollouts of a prompt, the K sub-agents).")
    # objective
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward weights; the method sets "
                                 "some (every method its reward_bias: -0.2, the paper's RL value, or 0).")
    lr: float = Field(2e-6, gt=0, description="AdamW learning rate (paper, Table 4: 2e-6).")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps, then constant.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping (global L2 norm).")
    clip: float = Field(0.2, gt=0, description="PPO ratio clip ε (ε_low with clip_high).")
    clip_high: float | None = Field(None, gt=0, description="DAPO clip-higher ε_high (upper ratio bound 1 + "
                                                           "ε_high); None = symmetric clip.")
    dual_clip: float | None = Field(3.0, gt=1, description="Dual-clip PPO's c (Ye et al. 2020; verl's "
                                    "clip_ratio_c, 3 there too): the loss of a token with A < 0 is capped at -c·A, "
                                    "so a replayed or stale token whose ratio exploded cannot drive the step (PPO's "
                                    "clip bounds only the other side). Inert at ratio < c: one optimizer step per "
                                    "batch keeps on-policy ratios at 1. None = off.")
    kl_coef: float = Field(0.01, ge=0, description="KL to the frozen initial policy (paper: 0.01); 0 = no "
                                                   "reference model.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="Per-token KL estimate: k1 = logp - ref, "
                                                    "k2 = ½(logp - ref)², k3 = Schulman's exp(r) - r - 1.")
    aggregation: Literal["seq-mean", "token-mean", "constant"] = Field(
        "seq-mean", description="How token losses become the loss: seq-mean (GRPO) averages each episode's "
        "trained tokens (planner and sub-agents together) then the episodes; token-mean (DAPO) averages every "
        "trained token of the step; constant (Dr. GRPO) sums each episode's tokens / max_new_tokens.")
    advantage_scale: Literal["std", "none"] = Field("std", description="Group advantage: (r - mean) / std, or "
                                                                       "r - mean (Dr. GRPO).")
    advantage_eps: float = Field(1e-6, gt=0, description="Added to the group std.")
    advantage_batch_norm: bool = Field(False, description="After the group normalisation, normalise advantages "
                                       "over the step's batch: minus the mean over every trained token, divided "
                                       "by their std (the released ParaVT recipe's AReaL adv_norm, mean_level and "
                                       "std_level batch; the paper's text describes the group normalisation only). "
                                       "Off: the paper's objective as written.")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each batch of rollouts (verl's ppo_epochs, TRL's "
                                                 "num_iterations). With 1 pass and 1 mini-batch the ratio stays 1 "
                                                 "and PPO's clip never acts.")
    mini_batches: int = Field(1, ge=1, description="Optimizer steps per pass: the batch is split into this many "
                                                   "mini-batches (verl's PPO mini-batches) by a shuffle seeded by "
                                                   "seed and the step (the same on every rank; never by length); "
                                                   "from the second step on the ratio moves and the clip (ε, DAPO's "
                                                   "ε_high) acts. grad_norm is logged as the mean over the "
                                                   "optimizer steps, grad_norm_max the largest.")
    max_staleness: int = Field(0, ge=0, description="η, AReaL's max_head_offpolicyness: rollouts run ahead of the "
                                                    "update on the served policy, at most η versions old when they "
                                                    "train (asynchronous PARA-GRPO, the paper's AReaL setup; needs "
                                                    "backend sglang, sync.every 1 and sync.pause_mode retract; "
                                                    "`online` takes the same bound and objective). 0 = the "
                                                    "synchronous loop, exactly.")
    behaviour_weight_cap: float = Field(5.0, gt=1, description="Decoupled PPO (η > 0): each token is weighted by "
                                                               "π_prox / π_behav; tokens above this cap are left "
                                                               "out of the loss (AReaL's behav_imp_weight_cap).")
    rollout_correction: Literal["off", "token-truncate", "token-mask", "sequence-truncate", "sequence-mask",
                                "sequence-product-truncate", "sequence-product-mask"] = Field(
        "token-truncate", description="The train–inference mismatch on rollouts of the current weights (Yao et al. "
        "2025, 'Your efficient RL framework secretly brings you off-policy RL training'): each sampled token's "
        "weight w = π_train / π_rollout (the trainer's logprob before the update over the engine's reported one). "
        "token-truncate (TIS): min(w, threshold); token-mask: tokens with w > threshold leave the loss and its "
        "denominator; sequence-truncate / sequence-mask: the same on each sequence's geometric mean exp(mean log w) "
        "(ms-swift's rollout_importance_sampling_mode; length-independent); sequence-product-truncate / "
        "sequence-product-mask: on the product Π w (TRL's sequence modes: its spread grows with √length, so long "
        "turns are rejected for bf16 rounding alone). Rows sampled by an older version (sync.every > 1, or a "
        "version behind the update with max_staleness > 0) take decoupled PPO's behaviour_weight_cap instead; "
        "rows of the current version keep this correction. The mismatch is logged either way (mismatch/*).")
    rollout_correction_threshold: float = Field(2.0, gt=1, description="The rollout correction's C: the cap of "
                                                "truncation, the bound past which a mask rejects (ms-swift: 2.0).")
    stale_queue_on_resume: Literal["drop", "keep"] = Field(
        "drop", description="η > 0: rollouts finished but not yet trained when a checkpoint is written are "
                            "dropped on restart (rolled out again) or kept (stored with the checkpoint).")
    micro_batch_size: int = Field(4, ge=1, description="Sequences per forward pass.")
    tas_lambda: float = Field(0.0, ge=0, description="AVATAR Temporal Advantage Shaping λ (0 = off).")
    replay: ReplaySettings = Field(default_factory=ReplaySettings, description="AVATAR's stratified replay.")
    # bookkeeping
    save_every: int = Field(10, ge=1, description="Steps between checkpoints (paper, Table 4: 5).")
    keep_checkpoints: int = Field(2, ge=1, description="Newest checkpoints kept.")
    seed: int = Field(0, description="Prompt order, gating and rollout seeds.")
    resume: bool = Field(True, description="Continue from the newest checkpoint in output_dir, if any.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in the backward pass.")
    bf16: Literal["auto", "true", "false"] = Field("auto", description="Actor and reference in bf16: auto = on GPUs.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the actor trains: auto = a GPU when one is present and the model has 64 MiB of "
        "weights or more (the local backend's rule: a tiny model such as the toy trains faster on the CPU), cpu, or "
        "cuda.")

    @model_validator(mode="before")
    @classmethod
    def _method(cls, data):
        """The method's training settings under the ones given (nested sections merged key by key)."""
        if not isinstance(data, dict):
            return data
        data = upgrade_keys(data, cls.deprecated_keys, cls.__name__)
        if "online" in data and "online" not in cls.model_fields:
            raise ValueError("online: is read by `paravt-train online` (paravt_train.online.OnlineConfig); a GRPO run "
                             "has no online settings: remove the section, or run `paravt-train online`")
        if data.get("method") == "custom":  # 0.4's preset of no defaults: the field defaults, para-grpo's
            warnings.warn(f"GRPOConfig: method `custom` is renamed `para-grpo` (the same settings); `custom` is "
                          f"refused from {REMOVED_IN}", FutureWarning, stacklevel=2)
            data = {**data, "method": "para-grpo"}
        return merge_settings(training_settings(data.get("method", DEFAULT_METHOD)), data)

    @model_validator(mode="after")
    def _agent_settings(self):
        try:
            AgentConfig.model_validate(self.agent)
        except ValidationError as exc:  # said key by key, under `agent.`
            raise ValueError("; ".join(explain_lines(exc, AgentConfig, prefix="agent."))) from None
        except ValueError as exc:
            raise ValueError(f"agent: not agent settings: {exc}") from None
        return self

    @model_validator(mode="after")
    def _asynchronous(self):
        """η > 0 assumes the server holds the trainer's weights after every update, and that a push lets the
        requests in flight go on (``retract``); the other combinations are refused here, not hours into a run."""
        if self.max_staleness > 0 and self.sync.every > 1:
            raise ValueError(
                f"max_staleness {self.max_staleness} needs sync.every 1 (got {self.sync.every}): the asynchronous "
                "loop bounds staleness by the trainer's version, assuming every update reaches the server; with "
                "fewer pushes the server lags, the producer does not throttle to the version it actually serves, "
                "and whole steps are rolled out only to be dropped as too stale")
        if self.max_staleness > 0 and self.sync.pause_mode != "retract":
            why = ("in_place keeps the old weights' prefixes in the server's cache until it is idle, which it never "
                   "is while rollouts run ahead: tokens tagged with a version would be computed partly with older "
                   "weights, and each push waits (up to a minute) for an idle server that does not come"
                   if self.sync.pause_mode == "in_place" else
                   "abort ends every request in flight at every push (rollouts are always in flight) and the "
                   "policy retries them from scratch: the work is thrown away, and a turn aborted more often than "
                   "the policy retries fails its episode")
            raise ValueError(f"max_staleness {self.max_staleness} needs sync.pause_mode retract (got "
                             f"{self.sync.pause_mode}): {why}")
        return self

    @model_validator(mode="after")
    def _lora(self):
        check_weight_sync(self)  # an adapter sync needs a LoRA run (the sync registry says which syncs are)
        return self

    @classmethod
    def from_yaml(cls, path, overrides=None) -> GRPOConfig:
        return load_yaml_model(cls, path, overrides)


def sampling_settings(agent_config) -> dict[str, object]:
    """Every :class:`~paravt_agent.types.Sampling` an agent config holds, by its field path."""
    found: dict[str, object] = {}

    def walk(obj, path: str) -> None:
        if isinstance(obj, Sampling):
            found[path] = obj
        elif isinstance(obj, BaseModel):
            for key in type(obj).model_fields:
                walk(getattr(obj, key), f"{path}.{key}" if path else key)
        elif isinstance(obj, dict):
            for key, value in obj.items():
                walk(value, f"{path}.{key}")

    walk(agent_config, "")
    return found


def check_served_sampling(policy, *agent_configs) -> None:
    """The GRPO run's check against its rollout server, before the first request: SGLang's seeded sampler
    (``--enable-deterministic-inference``, ``paravt serve --deterministic``) asserts inside the scheduler on a
    request with ``min_p > 0`` (greedy ones included), which kills the server; such sampling in any agent config
    the run asks the server with (rollouts, the held-out evaluation) is refused here. A policy that cannot say
    how its server samples is not checked (its own requests are: the ``sglang`` backend refuses them too)."""
    offending = {f"{path}.min_p": s.min_p for cfg in agent_configs
                 for path, s in sampling_settings(cfg).items() if s.min_p > 0}
    if not offending or not hasattr(policy, "server_deterministic"):
        return
    deterministic = policy.server_deterministic()
    listed = ", ".join(f"{k} = {v:g}" for k, v in sorted(offending.items()))
    if deterministic:
        raise ConfigError(f"the rollout server {policy.url} runs with deterministic inference, whose seeded sampler "
                          f"asserts on min_p > 0 and takes the server down: set min_p 0 in the agent config "
                          f"({listed}), or serve without --deterministic")
    if deterministic is None:
        raise ConfigError(f"the rollout server {policy.url} cannot say whether it (or a worker behind its router) "
                          f"runs with deterministic inference, which dies on min_p > 0: set min_p 0 in the agent "
                          f"config ({listed}), or let its workers answer at an address this host reaches (`paravt "
                          "serve --dp N --worker-host ADDR`)")
