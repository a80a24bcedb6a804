"""What a feedback row may say about a trace: the one check the store applies when feedback is written and the
online learner applies again when it reads it (a row written before the check existed, or by another writer).

Feedback becomes training data (``paravt-train online``), so a row is refused unless its answer could be the
answer to that trace's question:

- an answer is text (not a number, not a list), not empty, at most :data:`MAX_ANSWER_CHARS` long, without
  control characters;
- a multiple-choice trace's answer names one of its options: a letter within the options (``B``, ``(B)``,
  ``B.``) or an option's text; it is stored as the letter;
- a grounding trace's answer is a time span ``[start, end]`` within the video;
- a reward is a finite number, thumbs a boolean;
- a second answer for the same trace that differs from the first (two users, two answers) conflicts: it is
  refused, not trained on.

:func:`check_answer` returns the normalised answer or raises :class:`~paravt_agent.errors.FeedbackError` with a
message saying what to send instead.
"""

from __future__ import annotations

import math
import re

from paravt_agent.errors import FeedbackError
from paravt_agent.protocol import LETTERS, option_body, parse_span
from paravt_agent.trajectory import Trace

__all__ = ["MAX_ANSWER_CHARS", "check_answer", "check_reward", "task_of"]

#: longest answer a feedback row may carry (an open-ended answer is a sentence, not a document)
MAX_ANSWER_CHARS = 2000
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_LETTER = re.compile(r"^\(?\s*([A-Za-z])\s*[).:]?$")


def task_of(trace: Trace) -> str:
    """The task a trace's question is: ``mcq`` (it has options), ``tvg`` (it asks for a span, or its answer gave
    one) or ``oe``."""
    if trace.options:
        return "mcq"
    q = trace.question.lower()
    if trace.span is not None or "[start, end]" in q or "when is" in q or "time span" in q:
        return "tvg"
    return "oe"


def check_answer(trace: Trace, answer) -> str:
    """The answer a feedback row may carry for ``trace``, normalised (an MCQ answer as its letter)."""
    if not isinstance(answer, str):
        raise FeedbackError(f"an answer is text; got {type(answer).__name__} {str(answer)[:40]!r}")
    text = answer.strip()
    if not text:
        raise FeedbackError("the answer is empty")
    if len(text) > MAX_ANSWER_CHARS:
        raise FeedbackError(f"the answer is {len(text)} characters long; at most {MAX_ANSWER_CHARS}")
    if _CONTROL.search(text):
        raise FeedbackError("the answer contains control characters")
    task = task_of(trace)
    if task == "mcq":
        letters = LETTERS[: len(trace.options)]
        m = _LETTER.match(text)
        if m:
            letter = m.group(1).upper()
            if letter not in letters:
                raise FeedbackError(f"{letter!r} is not an option of this question (options {', '.join(letters)})")
            return letter
        if parse_span(text) is not None:
            raise FeedbackError("this question has options: answer with an option's letter, not a time span")
        bodies = [option_body(o).strip().lower() for o in trace.options]
        if text.lower() in bodies:
            return letters[bodies.index(text.lower())]
        raise FeedbackError(f"{text[:60]!r} is not one of the options ({', '.join(letters)} or their text)")
    if task == "tvg":
        span = parse_span(text)
        if span is None:
            raise FeedbackError("this question asks when: answer with a time span [start, end] in seconds")
        if trace.duration and span[1] > trace.duration + 1:
            raise FeedbackError(f"the span {list(span)} ends after the video ({trace.duration:g} s)")
        return f"[{span[0]:g}, {span[1]:g}]"
    return text


def check_reward(reward) -> float | None:
    if reward is None:
        return None
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(float(reward)):
        raise FeedbackError(f"a reward is a finite number; got {reward!r}")
    return float(reward)
