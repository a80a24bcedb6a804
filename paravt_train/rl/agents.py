"""The agent configs of a GRPO run: the rollout agent (the distribution the trainer scores) and the held-out agent
(greedy, with the token budgets RL trained; also the config saved with the trained model). Both start from the run's
protocol with the method's agent settings (:func:`paravt_train.methods.agent_config_for`)."""

from __future__ import annotations

from paravt_agent.config import AgentConfig
from paravt_train.methods import agent_config_for

__all__ = ["eval_agent_config", "rollout_agent_config"]


def rollout_agent_config(cfg) -> AgentConfig:
    """The rollout agent: the run's protocol (its dispatch mode and layout) with the method's think prefix, τ-sampling
    and the RL token limits."""
    base = agent_config_for(cfg)

    def tau(sampling, **more):
        # the distribution the trainer scores: τ and top-p as configured, no top-k or min-p from the model's file
        return sampling.model_copy(update={"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": 0,
                                           "min_p": 0.0, **more})

    return base.model_copy(update={
        "planner_sampling": tau(base.planner_sampling, max_new_tokens=cfg.max_new_tokens),
        "subagent_sampling": tau(base.subagent_sampling, max_new_tokens=cfg.subagent_max_new_tokens),
        # model-backed tools and collaborating agents sample as the sub-agents do (their calls are trained too)
        "tool_sampling": tau(base.tool_sampling),
        "collab": base.collab.model_copy(update={"agent_sampling": tau(base.collab.agent_sampling)}),
    })


def eval_agent_config(cfg) -> AgentConfig:
    """The held-out agent, and the config saved with the trained model: the model's agent config, greedy, with the
    token budgets RL trained it with (``max_new_tokens`` per planner turn, ``subagent_max_new_tokens`` per summary: a
    policy trained on 2048-token turns is evaluated and served at 2048), its frame protocol (``eval.n_frames``
    overrides the overview size) and the method's think prefix."""
    base = agent_config_for(cfg)
    frames = base.frames if cfg.eval.n_frames is None else base.frames.model_copy(
        update={"n_frames": cfg.eval.n_frames})
    return base.model_copy(update={
        "frames": frames,
        "planner_sampling": base.planner_sampling.model_copy(update={
            "temperature": 0.0, "max_new_tokens": cfg.max_new_tokens}),
        "subagent_sampling": base.subagent_sampling.model_copy(update={
            "temperature": 0.0, "max_new_tokens": cfg.subagent_max_new_tokens})})
