"""Rewards and rollout metrics of PARA-GRPO (paper, Section 3.2.3 and Appendix B). Pure functions.

    R(x, y) = R_acc(y, a*) + λ_fmt · R_fmt(y) + R_tool(y) + bias,   R_fmt = R_base + λ_anchor · R_anchor

``y`` is the whole rollout transcript the policy is scored on: every planner
response, *including the pinned think prefix*, with the tool-response turns in
between (see :func:`transcript`). Degenerate outputs score 0.

R_base (ANSWER_SUFFIX on): +0.2 a ``<think>`` with >= 10 characters, +0.3 an
``<answer>`` tag, +0.2 a ``</answer>`` tag, +0.3 think-before-tool order
(``</think>`` precedes the first tool block or the answer), +0.1 every tag pair
balanced. R_anchor (Eq. 1): +α when ``</think>`` closes the first ``<think>``,
+β when the whole ``<think>`` → ``</think>`` → ``<answer>`` → ``</answer>`` flow
is kept, −γ when a ``<think>`` is opened and never closed.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, Field

from paravt_agent.protocol import (
    extract_answer,
    extract_choice,
    is_degenerate,
    parse_span,
    parse_tool_calls,
    split_think,
    tag_stats,
)

__all__ = [
    "RewardConfig",
    "RewardBreakdown",
    "accuracy_reward",
    "anchor_reward",
    "base_format_reward",
    "format_reward",
    "rollout_metrics",
    "score",
    "temporal_iou",
    "token_f1",
    "tool_reward",
    "transcript",
]


class RewardConfig(BaseModel):
    """Reward weights; defaults are the paper's released values (Appendix B, Table 4)."""

    think_content: float = Field(0.2, description="R_base: <think> with at least `min_think_chars` characters.")
    min_think_chars: int = Field(10, description="What counts as substantive reasoning.")
    answer_open: float = Field(0.3, description="R_base: an <answer> tag.")
    answer_close: float = Field(0.2, description="R_base: a </answer> tag.")
    think_tool_order: float = Field(0.3, description="R_base: </think> before the first tool block / the answer.")
    balanced: float = Field(0.1, description="R_base: every tag pair balanced.")
    answer_suffix: bool = Field(
        True, description="Paper's ANSWER_SUFFIX: credit the answer tags even when the structure before them "
        "is imperfect. Off: only when </think> closed before <answer>."
    )
    alpha: float = Field(0.4, description="R_anchor: </think> correctly closed (Eq. 1).")
    beta: float = Field(0.3, description="R_anchor: full think -> answer flow kept (Eq. 1).")
    gamma: float = Field(0.3, description="R_anchor: penalty for a <think> never closed (Eq. 1).")
    lambda_anchor: float = Field(0.5, description="ANCHOR_WEIGHT: R_fmt = R_base + λ_anchor R_anchor.")
    lambda_fmt: float = Field(1.0, description="FORMAT_WEIGHT: R = R_acc + λ_fmt R_fmt + R_tool.")
    anchor: bool = Field(True, description="Exploration Anchoring's selective reward on (PARA-GRPO) or off.")
    tool_bonus: float = Field(0.1, description="R_tool: bonus scaled by the fraction of well-formed <tool_call>s.")
    reward_bias: float = Field(0.0, description="Added to every non-degenerate reward (paper's RL: -0.2).")
    degenerate_count: int = Field(5, description="<|im_start|> count that marks a degenerate output ...")
    degenerate_window: int = Field(300, description="... within this many characters.")

    @property
    def max_format(self) -> float:
        base = self.think_content + self.answer_open + self.answer_close + self.think_tool_order + self.balanced
        return base + (self.lambda_anchor * (self.alpha + self.beta) if self.anchor else 0.0)


def transcript(responses: Sequence[str], tool_responses: Sequence[str] = ()) -> str:
    """The rollout text a reward scores: planner responses interleaved with the tool-response turns."""
    parts = []
    for i, r in enumerate(responses):
        parts.append(r)
        if i < len(tool_responses):
            parts.append(tool_responses[i])
    return "\n".join(parts)


# --------------------------------------------------------------------------- format


def _first(text: str, *tags: str) -> int:
    found = [text.find(t) for t in tags]
    found = [f for f in found if f >= 0]
    return min(found) if found else -1


def base_format_reward(text: str, cfg: RewardConfig | None = None) -> float:
    cfg = cfg or RewardConfig()
    stats = tag_stats(text)
    reasoning, _ = split_think(text)
    r = 0.0
    if stats["think"].opened and len(reasoning) >= cfg.min_think_chars:
        r += cfg.think_content
    close = text.find("</think>")
    first_after = _first(text, "<tool_call>", "<tool_code>", "<answer>")
    order_ok = stats["think"].opened > 0 and close >= 0 and first_after > close
    ans_open = text.find("<answer>")
    answer_ok = cfg.answer_suffix or (close >= 0 and ans_open > close)
    if ans_open >= 0 and answer_ok:
        r += cfg.answer_open
        if text.find("</answer>", ans_open) >= 0:
            r += cfg.answer_close
    if order_ok:
        r += cfg.think_tool_order
    present = [s for s in stats.values() if s.present]
    if present and all(s.balanced for s in present):
        r += cfg.balanced
    return r


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


def format_reward(text: str, cfg: RewardConfig | None = None) -> float:
    """R_fmt = R_base + λ_anchor · R_anchor (the anchor only when ``cfg.anchor``)."""
    cfg = cfg or RewardConfig()
    r = base_format_reward(text, cfg)
    if cfg.anchor:
        r += cfg.lambda_anchor * anchor_reward(text, cfg)
    return r


def tool_reward(text: str, cfg: RewardConfig | None = None) -> float:
    """R_tool: ``tool_bonus`` × the fraction of tool blocks that are closed, parseable ``<tool_call>``s."""
    cfg = cfg or RewardConfig()
    calls = parse_tool_calls(text)
    if not calls:
        return 0.0
    good = sum(1 for c in calls if c.ok and c.tag == "tool_call" and c.closed)
    return cfg.tool_bonus * good / len(calls)


# --------------------------------------------------------------------------- accuracy


def _normalize(s: str) -> list[str]:
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return s.split()


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD-style token F1 (lower case, punctuation and articles dropped)."""
    p, r = _normalize(prediction), _normalize(reference)
    if not p or not r:
        return float(p == r)
    common = Counter(p) & Counter(r)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(r)
    return 2 * precision * recall / (precision + recall)


def temporal_iou(pred: tuple[float, float] | None, gt: tuple[float, float]) -> float:
    if pred is None:
        return 0.0
    inter = max(0.0, min(pred[1], gt[1]) - max(pred[0], gt[0]))
    union = max(pred[1], gt[1]) - min(pred[0], gt[0])
    return inter / union if union > 0 else 0.0


def _gt_letter(answer: str, options: Sequence[str] | None) -> str | None:
    letter = extract_choice(answer, options) if answer else None
    return letter


def accuracy_reward(
    response: str,
    answer,
    task: str,
    options: Sequence[str] | None = None,
    judge=None,
    question: str = "",
) -> float:
    """R_acc by task: ``mcq`` exact letter match, ``tvg`` temporal IoU, ``oe`` token F1 (or an LLM judge)."""
    pred = extract_answer(response)
    if task == "mcq":
        want = _gt_letter(str(answer), options)
        got = extract_choice(pred, options)
        return float(want is not None and got == want)
    if task == "tvg":
        gt = tuple(answer) if isinstance(answer, list | tuple) else parse_span(str(answer))
        if gt is None:
            raise ValueError(f"ground truth {answer!r} is not a time span")
        try:
            return temporal_iou(parse_span(pred), (float(gt[0]), float(gt[1])))
        except (TypeError, ValueError):
            return 0.0
    if task == "oe":
        if judge is not None:
            scored = judge.score(question, pred, str(answer))
            if scored is not None:
                return scored
        return token_f1(pred, str(answer))
    raise ValueError(f"unknown task type {task!r}; expected mcq, tvg or oe")


@dataclass
class RewardBreakdown:
    total: float
    acc: float
    fmt: float
    base: float
    anchor: float
    tool: float
    degenerate: bool = False


def score(
    text: str,
    answer,
    task: str,
    options: Sequence[str] | None = None,
    cfg: RewardConfig | None = None,
    judge=None,
    question: str = "",
) -> RewardBreakdown:
    """The composite reward of one rollout transcript (pinned prefix included)."""
    cfg = cfg or RewardConfig()
    if is_degenerate(text, cfg.degenerate_count, cfg.degenerate_window):
        return RewardBreakdown(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, degenerate=True)
    acc = accuracy_reward(text, answer, task, options, judge, question)
    base = base_format_reward(text, cfg)
    anc = anchor_reward(text, cfg) if cfg.anchor else 0.0
    fmt = base + cfg.lambda_anchor * anc
    tool = tool_reward(text, cfg)
    total = acc + cfg.lambda_fmt * fmt + tool + cfg.reward_bias
    return RewardBreakdown(total, acc, fmt, base, anc, tool)


# --------------------------------------------------------------------------- metrics


def rollout_metrics(
    texts: Sequence[str],
    tasks: Sequence[str] | None = None,
    accs: Sequence[float] | None = None,
    cfg: RewardConfig | None = None,
) -> dict[str, float]:
    """Training-stream metrics (paper, Table 2 and Table 5).

    ``format_reward`` is f_τ: the mean R_fmt normalised by its maximum (1.45 with the
    paper's weights), clipped to [0, 1]. ``tool_calls_per_rollout`` is κ.
    ``closure/think``: fraction with a properly closed reasoning block;
    ``closure/tool_call``: fraction with a closed and parseable ``<tool_call>`` block;
    ``closure/answer``: fraction with a properly bracketed answer block.
    """
    cfg = cfg or RewardConfig()
    n = len(texts)
    if n == 0:
        return {}
    fmts, calls, think_ok, call_ok, ans_ok = [], [], 0, 0, 0
    for t in texts:
        fmts.append(min(1.0, max(0.0, format_reward(t, cfg) / cfg.max_format)))
        parsed = parse_tool_calls(t)
        calls.append(sum(1 for c in parsed if c.ok))
        st = tag_stats(t)
        think_ok += st["think"].opened > 0 and st["think"].balanced
        call_ok += any(c.ok and c.tag == "tool_call" and c.closed for c in parsed)
        ans_ok += bool(re.search(r"<answer>.*?</answer>", t, re.S))
    out = {
        "format_reward": sum(fmts) / n,
        "tool_calls_per_rollout": sum(calls) / n,
        "tool_call_rate": sum(1 for c in calls if c) / n,
        "closure/think": think_ok / n,
        "closure/tool_call": call_ok / n,
        "closure/answer": ans_ok / n,
    }
    if tasks is not None and accs is not None:
        by: dict[str, list[float]] = {}
        for task, a in zip(tasks, accs, strict=True):
            by.setdefault(task, []).append(a)
        for task, vals in sorted(by.items()):
            out[f"accuracy/{task}"] = sum(vals) / len(vals)
        out["accuracy"] = sum(accs) / n
    return out
