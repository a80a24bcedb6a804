"""R_fmt = R_base + λ_anchor · R_anchor (paper, 3.2.3 and Eq. 1) and Weaver's answer-format reward, on the rollout
transcript (:func:`transcript`). Pure functions."""

from __future__ import annotations

import re
from collections.abc import Sequence

from paravt_agent.protocol import (
    parse_tool_calls,
    split_think,
    tag_stats,
)
from paravt_train.rewards.config import RewardConfig

__all__ = ["anchor_reward", "answer_format_reward", "base_format_reward", "format_reward", "transcript"]


def transcript(responses: Sequence[str], tool_responses: Sequence[str] = ()) -> str:
    """The rollout text a reward scores: planner responses interleaved with the tool-response turns."""
    parts = []
    for i, r in enumerate(responses):
        parts.append(r)
        if i < len(tool_responses) and tool_responses[i]:
            parts.append(tool_responses[i])
    return "\n".join(parts)


# --------------------------------------------------------------------------- format


def _answer_body(text: str, start: int) -> tuple[str, int]:
    """The body of the ``<answer>`` opening at ``start`` and where its ``</answer>`` is (-1 if unclosed)."""
    body_from = start + len("<answer>")
    close = text.find("</answer>", body_from)
    return (text[body_from:close] if close >= 0 else text[body_from:]), close


def base_format_reward(text: str, cfg: RewardConfig | None = None) -> float:
    cfg = cfg or RewardConfig()
    stats = tag_stats(text)
    reasoning, _ = split_think(text)
    r = 0.0
    if stats["think"].opened and len(reasoning) >= cfg.min_think_chars:
        r += cfg.think_content
    close = text.find("</think>")
    ans_open = text.rfind("<answer>")
    answer_ok = cfg.answer_suffix or (close >= 0 and ans_open > close)
    if ans_open >= 0 and answer_ok:
        body, ans_close = _answer_body(text, ans_open)
        if body.strip():  # tags around nothing earn nothing
            r += cfg.answer_open
            if ans_close >= 0:
                r += cfg.answer_close
    if stats["think"].opened and close >= 0 and _parseable_call_after(text, close):
        r += cfg.think_tool_order
    present = [s for s in stats.values() if s.present]
    if present and all(s.balanced for s in present):
        r += cfg.balanced
    return r


def _parseable_call_after(text: str, pos: int) -> bool:
    """A closed, parseable ``<tool_call>`` starts after ``pos``."""
    tail = text[pos:]
    return any(c.ok and c.closed and c.tag == "tool_call" for c in parse_tool_calls(tail))


def anchor_reward(text: str, cfg: RewardConfig | None = None) -> float:
    """Eq. 1: +α closed ``</think>``, +β whole think→answer flow, −γ ``<think>`` never closed."""
    cfg = cfg or RewardConfig()
    think = tag_stats(text, ("think",))["think"]
    if not think.opened:
        return 0.0
    r = 0.0
    if think.first_closed:
        r += cfg.alpha
    t_open, t_close = text.find("<think>"), text.find("</think>")
    a_open = text.find("<answer>", max(t_close, 0))
    a_close = text.find("</answer>", max(a_open, 0))
    if 0 <= t_open < t_close < a_open < a_close:
        r += cfg.beta
    if think.opened > think.closed:
        r -= cfg.gamma
    return r


def answer_format_reward(text: str) -> float:
    """Weaver's R_format: 1 when the text holds a non-empty ``<answer>...</answer>``, else 0."""
    return float(bool(re.search(r"<answer>\s*\S.*?</answer>", text, re.S)))


def format_reward(text: str, cfg: RewardConfig | None = None) -> float:
    """R_fmt = R_base + λ_anchor · R_anchor (the anchor only when ``cfg.anchor``); Weaver's answer-tag reward
    under ``format_reward: answer``."""
    cfg = cfg or RewardConfig()
    if cfg.format_reward == "answer":
        return answer_format_reward(text)
    r = base_format_reward(text, cfg)
    if cfg.anchor:
        r += cfg.lambda_anchor * anchor_reward(text, cfg)
    return r


