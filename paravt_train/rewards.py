"""Rewards and rollout metrics of PARA-GRPO (paper, Section 3.2.3 and Appendix B). Pure functions.

    R(x, y) = λ_acc · R_acc(y, a*) + λ_fmt · R_fmt(y) + R_tool(y) + Σ_k w_k R_k(y) + bias,
    R_fmt = R_base + λ_anchor · R_anchor

(λ_acc = 1 in the paper; Weaver's R = 0.7·R_corr + 0.2·R_format + 0.1·R_tool is ``acc_weight``, ``format_reward:
answer``, ``tool_reward: success``; VideoChat-M1's per-agent R_res + R_format + R_col is
:mod:`paravt_train.rl.marl.rewards`.)

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
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from paravt_agent.plugins import load_entry_points
from paravt_agent.protocol import (
    extract_answer,
    extract_choice,
    is_degenerate,
    parse_span,
    parse_tool_calls,
    split_think,
    tag_stats,
)

__all__ = ["TASK_METRIC", "JudgeSettings", "RewardConfig", "RewardBreakdown", "RewardSample", "accuracy_reward",
           "anchor_reward", "answer_format_reward", "base_format_reward", "format_reward", "reward_term",
           "rollout_metrics", "score", "temporal_iou", "token_f1", "tool_reward", "transcript", "worked_calls"]



class JudgeSettings(BaseModel):
    """An LLM judge for open-ended answers (OpenAI-compatible endpoint); token F1 when it fails."""

    model_config = ConfigDict(extra="forbid")

    endpoint: str = Field(description="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1.")
    model: str = Field(description="Served model name.")
    api_key: str = Field("EMPTY", description="API key sent to the endpoint.")
    timeout: float = Field(20.0, gt=0, description="Seconds per judgement before falling back to token F1.")


class RewardConfig(BaseModel):
    """Reward weights; defaults are the paper's released values (Appendix B, Table 4)."""

    model_config = ConfigDict(extra="forbid")

    think_content: float = Field(0.2, description="R_base: <think> with at least `min_think_chars` characters.")
    min_think_chars: int = Field(10, description="What counts as substantive reasoning.")
    answer_open: float = Field(0.3, description="R_base: an <answer> tag around a non-empty answer.")
    answer_close: float = Field(0.2, description="R_base: its </answer> tag.")
    think_tool_order: float = Field(0.3, description="R_base: </think> closed before a parseable tool call.")
    balanced: float = Field(0.1, description="R_base: every tag pair balanced.")
    answer_suffix: bool = Field(
        True, description="Paper's Answer Suffix (3.2.1, part of Exploration Anchoring): credit the answer tags "
        "even when the structure before them is imperfect. Off: only when </think> closed before <answer>."
    )
    alpha: float = Field(0.4, description="R_anchor: </think> correctly closed (Eq. 1).")
    beta: float = Field(0.3, description="R_anchor: full think -> answer flow kept (Eq. 1).")
    gamma: float = Field(0.3, description="R_anchor: penalty for a <think> never closed (Eq. 1).")
    lambda_anchor: float = Field(0.5, description="ANCHOR_WEIGHT: R_fmt = R_base + λ_anchor R_anchor (Table 4).")
    lambda_fmt: float = Field(1.0, description="FORMAT_WEIGHT: R = R_acc + λ_fmt R_fmt + R_tool (Eq. 3). Weaver: "
                              "λ2 = 0.2.")
    acc_weight: float = Field(1.0, description="λ_acc, the weight of R_acc: 1 in the paper's Eq. 3; Weaver "
                              "(Sec. 3.4.3, R = λ1 R_corr + λ2 R_format + λ3 R_tool): λ1 = 0.7.")
    format_reward: Literal["paravt", "answer"] = Field(
        "paravt", description="R_fmt: paravt = R_base + λ_anchor R_anchor (the paper's); answer = Weaver's R_format, "
        "1 when the rollout has a non-empty <answer>...</answer>, else 0.")
    anchor: bool = Field(True, description="Exploration Anchoring's selective reward on (PARA-GRPO) or off.")
    tool_bonus: float = Field(0.1, description="R_tool's weight (Weaver: λ3 = 0.1).")
    tool_reward: Literal["well_formed", "success"] = Field(
        "well_formed", description="R_tool: well_formed = tool_bonus × the fraction of closed, parseable "
        "<tool_call>s (the paper's); success = Weaver's tool-success reward (after DeepEyes): tool_bonus × R_acc "
        "when the rollout made a tool call that worked, else 0 (tool use that led to a right answer).")
    collaboration: float = Field(1.0, description="R_col's weight in a collaborating agent's reward (VideoChat-M1, "
                                 "A.5: R = R_res + R_format + R_col; paravt_train.rl.marl.rewards).")
    reward_bias: float = Field(0.0, description="Added to every reward (the paper's RL: -0.2; GRPOConfig sets it).")
    degenerate_count: int = Field(5, description="<|im_start|> count that marks a degenerate output ...")
    degenerate_window: int = Field(300, description="... within this many characters.")
    extra_terms: dict[str, float] = Field(default_factory=dict, description="Weights of extra reward terms by "
                                          "name (registered with `reward_term` or the paravt.rewards entry points).")
    judge: JudgeSettings | None = Field(None, description="LLM judge for open-ended answers; None = token F1.")

    @property
    def max_format(self) -> float:
        if self.format_reward == "answer":
            return 1.0
        base = self.think_content + self.answer_open + self.answer_close + self.think_tool_order + self.balanced
        return base + (self.lambda_anchor * (self.alpha + self.beta) if self.anchor else 0.0)

    @property
    def min_total(self) -> float:
        """The lowest reward a rollout can get: zero accuracy, the anchor's penalty, the bias (what a
        degenerate output scores)."""
        penalty = self.lambda_anchor * self.gamma if self.anchor and self.format_reward == "paravt" else 0.0
        return self.reward_bias - self.lambda_fmt * penalty - sum(abs(w) for w in self.extra_terms.values())


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
        want = extract_choice(str(answer), options) if answer else None
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


#: The metric each task is scored by (the reward's R_acc, and the column of an evaluation record).
TASK_METRIC = {"mcq": "correct", "tvg": "iou", "oe": "f1"}


@dataclass(frozen=True)
class RewardSample:
    """What a reward term may look at besides the transcript: the ground truth and the question."""

    answer: object
    task: str
    options: Sequence[str] | None = None
    question: str = ""
    final: str | None = None  # the episode's final response (what eval reads); None: the transcript is one response
    tools_worked: int | None = None  # tool calls whose slot came back without an error (the trace's count)


TermFn = Callable[[str, RewardSample, RewardConfig], float]
_TERMS: dict[str, TermFn] = {}


def reward_term(name: str):
    """Register an extra reward term: ``@reward_term("brevity") def brevity(text, sample, cfg) -> float``
    returning a value in [-1, 1]. It enters the reward with weight ``cfg.extra_terms[name]`` (absent or 0:
    not computed)."""

    def deco(fn: TermFn) -> TermFn:
        _TERMS[name] = fn
        return fn

    return deco


def _term(name: str) -> TermFn:
    if name not in _TERMS:
        load_entry_points("paravt.rewards", _TERMS, "reward")
    if name not in _TERMS:
        raise KeyError(f"unknown reward term {name!r}; registered: {', '.join(_TERMS) or 'none'}")
    return _TERMS[name]


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
    extra = {name: _term(name)(text, sample, cfg) for name, w in cfg.extra_terms.items() if w}
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
