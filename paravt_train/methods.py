"""The training methods, one table: ``method:`` in a GRPO config names one, and the method names its agent
protocol and its training settings.

================  ==================  ==============================================================================
method            agent protocol      training settings (under the config's own fields)
================  ==================  ==============================================================================
``para-grpo``     the model's own     Exploration Anchoring (think prefix, answer suffix, anchor reward), nFrames
                                      gating, reward bias −0.2 (the paper, Sections 3.2.1-3.2.2, Table 4)
``vanilla-grpo``  the model's own     all of Exploration Anchoring off, no gating: the baseline of Table 2
``dapo``          the model's own     vanilla's, with DAPO's objective: token-mean, clip-higher 0.28, dynamic
                                      sampling, no KL, 4 mini-batches (so that the clip acts)
``weaver``        ``weaver``          Weaver (weaver.txt, Sec. 3.4.3, Table 7): its tools frozen, R = 0.7 R_corr +
                                      0.2 R_format + 0.1 R_tool, KL 1e-3, lr 1e-6
``videochat-m1``  ``videochat-m1``    VideoChat-M1 (supplement A.6): GRPO per collaborating agent, τ 1, KL 1e-5,
                                      lr 1e-7, the agents' tools (expert models in the paper) frozen, agent
                                      dropout 0.25 (the paper trains with it and gives no rate: our choice)
================  ==================  ==============================================================================

How a run's two configs come from it, each by :func:`paravt_agent.config.merge_settings` (the one merge every
preset and method goes through):

* **training**: the method's training settings under the GRPO config's own fields (a field given wins:
  ``--set method=vanilla-grpo --set gating=true`` is an ablation of Table 2);
* **agent**: the protocol (``agent_config`` if given; else the model directory's ``agent_config.yaml`` when it is
  the protocol wanted; else the wanted protocol's preset), then the method's agent settings (the think prefix of
  Exploration Anchoring: the agent's one ``think_prefix``), then the GRPO config's ``agent`` settings over both.
  The protocol wanted is ``agent.preset`` if given, else the method's; a method without one takes the model's.

Every method trains with :class:`~paravt_train.rl.trainer.GRPOTrainer` (VideoChat-M1's per-agent advantages come
from the collaborative protocol itself; several policies: :class:`~paravt_train.rl.marl.MultiPolicyTrainer`): the
table names no trainer (rl/, above this module, resolves it: :func:`paravt_train.rl.trainer.trainer_class`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from paravt_agent.config import AgentConfig, merge_settings
from paravt_agent.errors import ConfigError

__all__ = ["DEFAULT_METHOD", "METHODS", "VIDEOCHAT_M1_DROPOUT", "Method", "MethodName", "agent_config_for", "method",
           "training_settings"]

#: the methods' names (GRPOConfig.method's type)
MethodName = Literal["para-grpo", "vanilla-grpo", "dapo", "weaver", "videochat-m1"]
DEFAULT_METHOD = "para-grpo"


@dataclass(frozen=True)
class Method:
    """One training method: what it is, its agent protocol and settings, its training settings."""

    summary: str  # one line, with its paper
    training: dict = field(default_factory=dict)  # GRPOConfig settings (nested sections as dicts)
    protocol: str | None = None  # the agent protocol (paravt_agent.protocol.presets); None = the model's own
    agent: dict = field(default_factory=dict)  # AgentConfig settings over the protocol


#: VideoChat-M1's agent dropout rate in its method (the paper gives none: see the table entry)
VIDEOCHAT_M1_DROPOUT = 0.25

_NO_ANCHORING = {"gating": False, "reward": {"anchor": False, "answer_suffix": False, "reward_bias": -0.2}}

METHODS: dict[str, Method] = {
    "para-grpo": Method(
        "PARA-GRPO (the paper): Exploration Anchoring (think prefix, answer suffix, anchor reward) and nFrames gating",
        training={"gating": True, "reward": {"anchor": True, "answer_suffix": True, "reward_bias": -0.2}},
        agent={"think_prefix": "<think>\n"}),
    "vanilla-grpo": Method(
        "GRPO without Exploration Anchoring or gating: the baseline of the paper's Table 2",
        training=_NO_ANCHORING, agent={"think_prefix": ""}),
    # DAPO's recipe takes 16 mini-batches of its 512-prompt batch; 4 here, so that the clip (clip-higher is DAPO's
    # point) acts from the second optimizer step on
    "dapo": Method(
        "DAPO's objective on vanilla GRPO: token-mean, clip-higher (0.2 / 0.28), dynamic sampling, no KL",
        training={**_NO_ANCHORING, "aggregation": "token-mean", "clip_high": 0.28, "dynamic_sampling": True,
                  "kl_coef": 0.0, "mini_batches": 4},
        agent={"think_prefix": ""}),
    # Weaver (weaver.txt, Sec. 3.4.3 and Table 7): tool-augmented GRPO with its tools frozen, R = 0.7 R_corr +
    # 0.2 R_format + 0.1 R_tool (R_format: the answer tags; R_tool: a tool call that worked and a right answer)
    "weaver": Method(
        "Weaver: tool-augmented GRPO, its six tools frozen, R = 0.7 R_corr + 0.2 R_format + 0.1 R_tool",
        protocol="weaver",
        training={"gating": False, "tool_model_calls": "freeze", "kl_coef": 1e-3, "lr": 1e-6,
                  "reward": {"anchor": False, "answer_suffix": False, "acc_weight": 0.7, "lambda_fmt": 0.2,
                             "format_reward": "answer", "tool_reward": "success", "tool_bonus": 0.1,
                             "reward_bias": 0.0}}),
    # VideoChat-M1 (supplement A.6): GRPO for every collaborating agent, each with its own advantage (the
    # collaborative mode's cpp protocol: paravt_train.rl.marl), τ = 1, KL 1e-5, lr 1e-7; the agents' own turns
    # train, their tools (browsers, grounding: expert models in the paper) stay frozen.
    # Agent dropout (the agent config's collab.dropout): the supplement trains with it (A.6: "we apply agent dropout
    # to enhance the model's robustness"; A.4 calls it the regulariser against co-adaptation) and states no rate.
    # 0.25 is ours: with the paper's four agents one is cut off from the communication per episode on average and
    # 32% of episodes keep the full team (0.75^4), so most rollouts still teach collaboration while an agent cannot
    # count on any one peer; a dropped agent still answers, so a 3-of-4 consensus stays reachable.
    # `--set agent.collab.dropout=0` turns it off (the method's agent settings sit over agent_config's).
    "videochat-m1": Method(
        "VideoChat-M1: GRPO per collaborating agent (its own advantage), τ 1, KL 1e-5, its tools frozen, agent "
        "dropout 0.25",
        protocol="videochat-m1",
        training={"gating": False, "temperature": 1.0, "kl_coef": 1e-5, "lr": 1e-7, "train_subagents": False,
                  "tool_model_calls": "freeze", "reward": {"anchor": False, "answer_suffix": False,
                                                           "reward_bias": 0.0}},
        agent={"collab": {"dropout": VIDEOCHAT_M1_DROPOUT}}),
}
assert set(get_args(MethodName)) == set(METHODS), "MethodName lists the table's methods"


def method(name: str) -> Method:
    """The method named ``name``; a ``ValueError`` naming the choices for any other."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}")
    return METHODS[name]


def training_settings(name: str) -> dict:
    """A copy of a method's training settings (a GRPOConfig dict)."""
    return copy.deepcopy(method(name).training)


def agent_config_for(cfg) -> AgentConfig:
    """The agent config of a GRPO run ``cfg`` (a :class:`~paravt_train.rl.config.GRPOConfig`), before the
    trainer's sampling: its protocol, the method's agent settings over it, ``cfg.agent`` over both."""
    m = method(cfg.method)
    wanted = cfg.agent.get("preset") or m.protocol
    if cfg.agent_config:
        if not Path(cfg.agent_config).is_file():
            raise ConfigError(f"agent config {cfg.agent_config} does not exist")
        base = AgentConfig.from_yaml(cfg.agent_config)
    else:
        own = AgentConfig.for_model(cfg.model)
        base = own if own is not None and wanted in (None, own.preset) else AgentConfig(preset=wanted or "paravt")
    settings = merge_settings(m.agent, cfg.agent)
    if not settings:
        return base
    # a protocol named in the settings starts from that preset, as `--set preset=...` does
    data = {} if settings.get("preset", base.preset) != base.preset else base.model_dump()
    return AgentConfig.model_validate(merge_settings(data, copy.deepcopy(settings)))
