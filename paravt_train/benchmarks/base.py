"""What every benchmark loader produces: :class:`EvalItem` s, and the helpers loaders share."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from paravt_agent.errors import ParaVTError
from paravt_agent.protocol import labelled_options

__all__ = ["BenchmarkError", "EvalItem", "labelled", "need"]


class BenchmarkError(ParaVTError):
    """A benchmark folder, file or video is missing or malformed."""


@dataclass(kw_only=True)  # many fields of one type: built by name, never by position
class EvalItem:
    """One question of a benchmark, in the one shape evaluation and RL share."""

    benchmark: str
    uid: str
    video: str
    question: str
    task: str  # mcq | tvg | oe
    answer: str  # letter, "[start, end]" or text
    options: list[str] | None = None
    group: str = ""  # per-duration (or per-category) breakdown key
    extra: dict = field(default_factory=dict)


def need(path: Path, what: str) -> Path:
    """``path``, or a :class:`BenchmarkError` naming what was expected where."""
    if not path.exists():
        raise BenchmarkError(f"{what} not found: expected {path}")
    return path


def labelled(options: list[str]) -> list[str]:
    """Options as ``"A. text"`` (the protocol's one letter table)."""
    return labelled_options(list(options))
