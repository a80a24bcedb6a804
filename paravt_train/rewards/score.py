"""R = λ_acc · R_acc + λ_fmt · R_fmt + R_tool + Σ_k w_k R_k + bias, one rollout at a time (:func:`score`), the extra
terms' registry (:func:`reward_term`) and the rollout metrics of a step (:func:`rollout_metrics`)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from paravt_agent.protocol import (
    is_degenerate,
    parse_tool_calls,
    tag_stats,
)
from paravt_train.rewards.accuracy import accuracy_reward
from paravt_train.rewards.config import RewardConfig
from paravt_train.rewards.format import anchor_reward, answer_format_reward, base_format_reward, format_reward
from paravt_train.rewards.terms import RewardSample, reward_term, term
from paravt_train.rewards.tool import tool_reward, worked_calls

__all__ = ["RewardBreakdown", "RewardSample", "reward_term", "rollout_metrics", "score"]


@dataclass(kw_only=True)  # six floats: built by name, never by position
class RewardBreakdown:
    total: float
    acc: float
    fmt: float
    base: float
    anchor: float
    tool: float
    degenerate: bool = False
    extra: dict[str, float] = field(default_factory=dict)

    def terms(self) -> dict[str, float]:
        """Every term by name (what the trainer logs as ``reward/<name>``)."""
        return {"acc": self.acc, "fmt": self.fmt, "base": self.base, "anchor": self.anchor, "tool": self.tool,
                **self.extra}


def score(
    text: str,
    answer,
    task: str,
    options: Sequence[str] | None = None,
    cfg: RewardConfig | None = None,
    judge=None,
    question: str = "",
    final: str | None = None,
    tools_worked: int | None = None,
) -> RewardBreakdown:
    """The composite reward of one rollout transcript (pinned prefix included).

    ``final`` is the episode's final response: R_acc scores the answer there, exactly as `paravt-train eval`
    and the served agent read it (an ``<answer>`` written in an earlier turn beside a tool call and then
    abandoned earns nothing); the format and tool terms score the whole transcript. ``None``: the transcript
    is a single response."""
    cfg = cfg or RewardConfig()
    if is_degenerate(text, cfg.degenerate_count, cfg.degenerate_window):
        return RewardBreakdown(total=cfg.min_total, acc=0.0, fmt=0.0, base=0.0, anchor=0.0, tool=0.0,
                               degenerate=True)
    acc = accuracy_reward(text if final is None else final, answer, task, options, judge, question)
    if cfg.format_reward == "answer":  # Weaver's: the answer tags alone
        base, anc = answer_format_reward(text), 0.0
    else:
        base, anc = base_format_reward(text, cfg), anchor_reward(text, cfg) if cfg.anchor else 0.0
    fmt = base + cfg.lambda_anchor * anc
    if cfg.tool_reward == "success":  # Weaver's: a tool call that worked and a right answer
        tool = cfg.tool_bonus * acc if worked_calls(text, tools_worked) > 0 else 0.0
    else:
        tool = tool_reward(text, cfg)
    sample = RewardSample(answer, task, options, question, final, tools_worked)
    extra = {name: term(name)(text, sample, cfg) for name, w in cfg.extra_terms.items() if w}
    total = (cfg.acc_weight * acc + cfg.lambda_fmt * fmt + tool + sum(cfg.extra_terms[k] * v for k, v in extra.items())
             + cfg.reward_bias)
    return RewardBreakdown(total=total, acc=acc, fmt=fmt, base=base, anchor=anc, tool=tool, extra=extra)


# --------------------------------------------------------------------------- metrics


def rollout_metrics(
    texts: Sequence[str],
    tasks: Sequence[str] | None = None,
    accs: Sequence[float] | None = None,
    cfg: RewardConfig | None = None,
    tool_calls: Sequence[int] | None = None,
) -> dict[str, float]:
    """Training-stream metrics (paper, Table 2 and Table 5).

    ``format_reward`` is f_τ: the mean R_fmt normalised by its maximum (1.45 with the
    paper's weights), clipped to [0, 1]. ``tool_calls_per_rollout`` is κ: each rollout's valid calls as its trace
    recorded them (``tool_calls``; the transcripts are parsed only when none are given).
    ``closure/think``: fraction with a properly closed reasoning block;
    ``closure/tool_call``: fraction with a closed and parseable ``<tool_call>`` block;
    ``closure/answer``: fraction with a properly bracketed answer block.
    """
    cfg = cfg or RewardConfig()
    n = len(texts)
    if n == 0:
        return {}
    fmts, calls, think_ok, call_ok, ans_ok = [], [], 0, 0, 0
    for k, t in enumerate(texts):
        fmts.append(min(1.0, max(0.0, format_reward(t, cfg) / cfg.max_format)))
        parsed = parse_tool_calls(t)
        calls.append(tool_calls[k] if tool_calls is not None else sum(1 for c in parsed if c.ok))
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


