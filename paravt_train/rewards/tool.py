"""R_tool: the paper's bonus for well-formed tool calls, and Weaver's tool-success term (tool use that led to a right
answer). Pure functions."""

from __future__ import annotations

import re

from paravt_agent.protocol import (
    parse_tool_calls,
)
from paravt_train.rewards.accuracy import accuracy_reward
from paravt_train.rewards.config import RewardConfig
from paravt_train.rewards.terms import RewardSample, reward_term

__all__ = ["tool_reward", "tool_success", "worked_calls"]


def tool_reward(text: str, cfg: RewardConfig | None = None) -> float:
    """R_tool: ``tool_bonus`` × the fraction of tool blocks that are closed, parseable ``<tool_call>``s."""
    cfg = cfg or RewardConfig()
    calls = parse_tool_calls(text)
    if not calls:
        return 0.0
    good = sum(1 for c in calls if c.ok and c.tag == "tool_call" and c.closed)
    return cfg.tool_bonus * good / len(calls)


# --------------------------------------------------------------------------- accuracy



# --------------------------------------------------------------------------- Weaver's tool-success term

_SLOT_ERROR_RE = re.compile(r"^\[\d+\][^\n]*?: error: |\[Error[: ]|^Error: ", re.M)


def worked_calls(text: str, known: int | None = None) -> int:
    """Tool calls that worked: ``known`` (the episode's trace count: any dispatch mode, collaborating agents'
    calls included), else the transcript's tool-response slots that are not errors (any preset's layout)."""
    if known is not None:
        return known
    responses = re.findall(r"<tool_response>(.*?)</tool_response>", text, re.S)
    slots = sum(max(1, len(re.findall(r"^\[\d+\] ", r, re.M))) for r in responses)
    return slots - sum(len(_SLOT_ERROR_RE.findall(r)) for r in responses)


@reward_term("tool_success")
def tool_success(text: str, sample: RewardSample, cfg: RewardConfig) -> float:
    """Weaver's tool-success reward (``weaver.txt``, Sec. 3.4.3, after DeepEyes) as an extra term
    (``extra_terms: {tool_success: 0.1}``; ``tool_reward: success`` makes it R_tool): the final answer's accuracy
    when the episode made a tool call that worked, else 0 — tool use that led to a right answer, never tool use
    alone."""
    if worked_calls(text, sample.tools_worked) <= 0:
        return 0.0
    final = sample.final if sample.final is not None else text.rsplit("</tool_response>", 1)[-1]
    return accuracy_reward(final, sample.answer, sample.task, sample.options, None, sample.question)
