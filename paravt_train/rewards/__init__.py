"""Rewards and rollout metrics of PARA-GRPO (paper, Section 3.2.3 and Appendix B). Pure functions.

    R(x, y) = λ_acc · R_acc(y, a*) + λ_fmt · R_fmt(y) + R_tool(y) + Σ_k w_k R_k(y) + bias,
    R_fmt = R_base + λ_anchor · R_anchor

(λ_acc = 1 in the paper; Weaver's R = 0.7·R_corr + 0.2·R_format + 0.1·R_tool is ``acc_weight``, ``format_reward:
answer``, ``tool_reward: success``; VideoChat-M1's per-agent R_res + R_format + R_col is
:mod:`paravt_train.rewards.multi_agent`.)

``y`` is the rollout transcript the policy is scored on: every planner response, *including the pinned think
prefix*, with the tool-response turns in between (:func:`transcript`); tool output is neutralised before it
enters the context, so the ``<tool_response>`` wrapper is the only tag it contributes, and no instruction the
agent injects is part of it.

R_base (paper's values): +0.2 a ``<think>`` with >= 10 characters; +0.3 an ``<answer>`` tag and +0.2 its
``</answer>``, credited only around a non-empty answer (with ``answer_suffix`` on, even when the structure before
is imperfect); +0.3 think-before-tool order, credited only when a parseable tool call follows the closed
``</think>`` (else skipping the tool would be the cheaper path to full format reward); +0.1 every tag pair
balanced. R_anchor (Eq. 1): +α when ``</think>`` closes the first ``<think>``, +β when the whole ``<think>`` →
``</think>`` → ``<answer>`` → ``</answer>`` flow is kept, −γ when a ``<think>`` is opened and never closed.

The bias applies to every reward. A degenerate output (a chat-template loop) scores the lowest reward any rollout
can get. Extra terms: :func:`reward_term` registers a function ``(text, sample, cfg) -> float`` under a name; its
weight is ``RewardConfig.extra_terms[name]`` (terms are also found through the ``paravt.rewards`` entry points),
logged as ``reward/<name>``.

The folder, one term a module (pure functions, below ``rl/`` and ``rl/marl/``, which import it)::

    config.py       RewardConfig (the weights), JudgeSettings
    format.py       R_fmt: R_base, R_anchor, Weaver's answer format; the transcript a reward scores
    accuracy.py     R_acc: exact option, temporal IoU, token F1 (or the LLM judge)
    tool.py         R_tool: well-formed calls (the paper's), tool success (Weaver's)
    terms.py        RewardSample and the registry of extra terms
    score.py        score(): R of one rollout; rollout_metrics(): f_τ, κ, closure rates, accuracy per task
    multi_agent.py  VideoChat-M1: each collaborating agent's reward, the team's role
"""

from paravt_train.rewards.accuracy import TASK_METRIC, accuracy_reward, temporal_iou, token_f1
from paravt_train.rewards.config import JudgeSettings, RewardConfig
from paravt_train.rewards.format import (
    anchor_reward,
    answer_format_reward,
    base_format_reward,
    format_reward,
    transcript,
)
from paravt_train.rewards.score import RewardBreakdown, rollout_metrics, score
from paravt_train.rewards.terms import RewardSample, reward_term
from paravt_train.rewards.tool import tool_reward, tool_success, worked_calls

__all__ = ["TASK_METRIC", "JudgeSettings", "RewardBreakdown", "RewardConfig", "RewardSample", "accuracy_reward",
           "anchor_reward", "answer_format_reward", "base_format_reward", "format_reward", "reward_term",
           "rollout_metrics", "score", "temporal_iou", "token_f1", "tool_reward", "tool_success", "transcript",
           "worked_calls"]
