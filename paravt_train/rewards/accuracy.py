"""R_acc: exact option (MCQ), temporal IoU (grounding), token F1 or an LLM judge (open-ended). Pure functions."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

from paravt_agent.protocol import (
    extract_answer,
    extract_choice,
    parse_span,
)

__all__ = ["TASK_METRIC", "accuracy_reward", "temporal_iou", "token_f1"]


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


