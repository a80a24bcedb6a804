"""Each collaborating agent's reward (VideoChat-M1, multi-agent RL): what the collaborative mode's paper scores.

VideoChat-M1's supplement (A.5) names the reward's three parts, "task success (R_res), procedural validity
(R_format), and collaboration quality (R_col)", without formulas (the main paper's equations are not in our copy).
Our definitions, per agent of an episode (``cpp`` protocol)::

    R_i = R_res,i + λ_fmt · R_format,i + w_col · R_col,i + R_tool,i + bias

* R_res: the agent's OWN answer scored against the ground truth (exact option, temporal IoU or token F1): each
  agent answers (VideoChat-M1's per-agent "Answer" in the memory buffer), so each gets its own task signal.
* R_format: the share of the agent's replies that followed the protocol: a plan listing at least one tool
  ("You MUST select one or more tools"), each decision a ``continue()`` or an ``add tool`` with a valid call, an
  answer in ``<answer>``.
* R_col (our choice): the team's final answer's score when the agent's answer agrees with it (the same option,
  words, or a span with IoU >= 0.5), else 0: an agent is paid for collaboration when its answer is part of a
  right consensus (or matches the synthesizer's right answer).
* R_tool (this project's R_tool, weight ``tool_bonus``; 0 gives the paper's three terms): the share of the agent's
  tool calls that worked — non-zero whenever its tools did (the synthesizer-only score of the ``rounds`` protocol
  left it at 0).

The team's call (role ``planner``) is scored as the team, the usual reward of the final response, and trained by its
role (:func:`team_role`): the synthesizer (no consensus) decided the answer and trains with that reward, normalised
over the group's synthesizer episodes apart (only the rollouts without a consensus, the harder ones, have one); the
reason summary (a consensus) did not (the vote is the answer) and is not trained.
"""

from __future__ import annotations

from paravt_agent.graph.collab.cpp import answer_key, answers_agree
from paravt_agent.protocol import is_degenerate
from paravt_agent.trajectory import MemoryEntry
from paravt_train.rewards.accuracy import accuracy_reward
from paravt_train.rewards.config import RewardConfig
from paravt_train.rewards.score import RewardBreakdown

__all__ = ["SUMMARY", "SYNTHESIZER", "TEAM_ROLES", "agent_reward", "agent_transcript", "team_role"]

#: the team's roles in multi-agent RL: the synthesizer answers without a consensus (trained, normalised apart);
#: the reason summary explains a consensus (not trained: the vote decided); ``team``: a rollout that raised
SYNTHESIZER, SUMMARY = "synthesizer", "summary"
TEAM_ROLES = (SYNTHESIZER, SUMMARY, "team")


def agent_transcript(entries: list[MemoryEntry]) -> str:
    """An agent's replies in order (plan, decisions, answer): what its format and degeneracy are judged on."""
    parts = []
    for e in sorted(entries, key=lambda e: e.round):
        if e.text:
            parts.append(e.text)
        if e.answer_text:
            parts.append(e.answer_text)
    return "\n".join(parts)


def team_role(answer) -> str:
    """The team's role in a cpp rollout: ``summary`` when its final turn is a consensus (the agents' vote is the
    answer), else ``synthesizer`` (its answer is the synthesizer's)."""
    turns = answer.trace.turns if answer is not None else []
    return SUMMARY if turns and turns[-1].consensus else SYNTHESIZER


def agent_reward(entries: list[MemoryEntry], final: str, final_acc: float, answer, task: str, options=None,
                 cfg: RewardConfig | None = None, judge=None, question: str = "") -> RewardBreakdown:
    """One agent's reward from its memory entries, given the team's ``final`` answer and its score ``final_acc``
    (see the module docstring). ``acc`` is R_res, ``fmt`` R_format, ``tool`` the weighted R_tool and
    ``extra["col"]`` R_col."""
    cfg = cfg or RewardConfig()
    text = agent_transcript(entries)
    if is_degenerate(text, cfg.degenerate_count, cfg.degenerate_window):
        return RewardBreakdown(total=cfg.min_total, acc=0.0, fmt=0.0, base=0.0, anchor=0.0, tool=0.0,
                               degenerate=True, extra={"col": 0.0})
    last = next((e for e in reversed(sorted(entries, key=lambda e: e.round)) if e.answer is not None), None)
    own = last.answer if last is not None else None
    res = accuracy_reward(f"<answer>{own}</answer>", answer, task, options, judge, question) if own else 0.0
    replies = sum(e.replies for e in entries)
    fmt = 1.0 - sum(e.invalid for e in entries) / replies if replies else 0.0
    agrees = answers_agree(answer_key(own or "", options), answer_key(final, options))
    col = final_acc if agrees else 0.0
    calls = [c for e in entries for c in e.calls]
    tool = cfg.tool_bonus * sum(c.error is None for c in calls) / len(calls) if calls else 0.0
    total = res + cfg.lambda_fmt * fmt + cfg.collaboration * col + tool + cfg.reward_bias
    return RewardBreakdown(total=total, acc=res, fmt=fmt, base=fmt, anchor=0.0, tool=tool, extra={"col": col})
