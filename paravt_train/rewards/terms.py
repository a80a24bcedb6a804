"""What an extra reward term sees (:class:`RewardSample`) and the registry of extra terms: :func:`reward_term` registers
a function ``(text, sample, cfg) -> float`` by name; the ``paravt.rewards`` entry points add more."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from paravt_agent.plugins import load_entry_points
from paravt_train.rewards.config import RewardConfig

__all__ = ["RewardSample", "TermFn", "reward_term", "term"]


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


def term(name: str) -> TermFn:
    """The extra term registered as ``name`` (the entry points read on first miss)."""
    if name not in _TERMS:
        load_entry_points("paravt.rewards", _TERMS, "reward")
    if name not in _TERMS:
        raise KeyError(f"unknown reward term {name!r}; registered: {', '.join(_TERMS) or 'none'}")
    return _TERMS[name]


