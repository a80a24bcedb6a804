"""Confidence intervals for the before → after numbers the examples report (bootstrap, percentile method)."""

from __future__ import annotations

import random
from collections.abc import Sequence

__all__ = ["mean_ci", "paired_diff_ci"]


def mean_ci(values: Sequence[float | None], level: float = 0.95, n: int = 10_000,
            seed: int = 0) -> tuple[float, float, float]:
    """``(mean, low, high)``: the mean and its bootstrap percentile interval. ``None`` (an item the runtime
    failed, :func:`paravt_train.eval.heldout_scores`) is left out."""
    vals = [v for v in values if v is not None]
    if not vals:
        return 0.0, 0.0, 0.0
    rng = random.Random(seed)
    k = len(vals)
    means = sorted(sum(vals[rng.randrange(k)] for _ in range(k)) / k for _ in range(n))
    lo, hi = means[int((1 - level) / 2 * n)], means[min(n - 1, int((1 + level) / 2 * n))]
    return sum(vals) / k, lo, hi


def paired_diff_ci(before: Sequence[float | None], after: Sequence[float | None], level: float = 0.95,
                   n: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """``(mean difference, low, high)`` of ``after - before`` over the same questions (paired bootstrap); a
    question failed on either side (``None``) is left out of the pairs."""
    if len(before) != len(after):
        raise ValueError("paired scores need the same questions before and after")
    return mean_ci([y - x for x, y in zip(before, after, strict=True) if x is not None and y is not None],
                   level, n, seed)
