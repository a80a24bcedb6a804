"""The one-sided lower bounds of a paired difference the gate decides by (:mod:`paravt_train.online.gate`), each
holding its stated level at small n:

* binary scores (:func:`exact_lower`): the exact unconditional test of ``H0: p_win − p_loss ≤ delta`` on paired
  proportions, its outcomes ordered by Tango's (1998) score statistic; its p-value is the largest probability,
  over the share of discordant pairs (the nuisance), of an outcome at least as extreme (Berger and Sidik's exact
  unconditional approach, the search of the nuisance on a grid refined about its peak). At a gate's margin the
  null is tabled once (:data:`TABLE_MAX`); above :data:`EXACT_MAX` questions Tango's normal approximation
  (:func:`score_lower`) is used, its worst level 10.2 % at 500 and 1,000 questions for a stated 10 %;
* continuous scores (:func:`hall_lower`): the paired t bound with Hall's (1992) skewness correction.
"""

from __future__ import annotations

import math
from functools import lru_cache
from statistics import NormalDist

import numpy as np

__all__ = ["EXACT_MAX", "TABLE_MAX", "exact_lower", "exact_p_value", "hall_lower", "outcomes", "score_lower",
           "t_quantile"]

EXACT_MAX = 1000  # binary scores: the exact test up to this many questions (seconds), Tango's normal bound above
TABLE_MAX = 500  # up to this many, the exact test at a gate's margin is read from a table made once per margin


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (Cornish-Fisher expansion about the normal
    quantile; within 1e-3 of the exact value from df 5 on, the gate uses df ≥ 19)."""
    z = NormalDist().inv_cdf(p)
    if math.isinf(df):
        return z
    g1 = (z ** 3 + z) / 4
    g2 = (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96
    g3 = (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384
    g4 = (79 * z ** 9 + 776 * z ** 7 + 1482 * z ** 5 - 1920 * z ** 3 - 945 * z) / 92160
    return z + g1 / df + g2 / df ** 2 + g3 / df ** 3 + g4 / df ** 4


def _tango_z(wins, losses, n: int, delta: float):
    """Tango's (1998) score statistic for ``H0: p_win − p_loss = delta`` on ``n`` paired binary outcomes (numbers,
    or arrays of them)."""
    w, loss = np.asarray(wins, dtype=float), np.asarray(losses, dtype=float)
    a = 2 * n
    b = -w - loss + (2 * n - w + loss) * delta
    c = -loss * delta * (1 - delta)
    p_loss = (np.sqrt(np.maximum(0.0, b * b - 4 * a * c)) - b) / (2 * a)  # its constrained MLE under H0
    var = n * (2 * p_loss + delta * (1 - delta))
    num = w - loss - n * delta
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(var > 1e-15, num / np.sqrt(np.maximum(var, 1e-300)),
                     np.where(num == 0, 0.0, np.sign(num) * np.inf))  # all ties at delta 0: no evidence, not NaN
    return z


@lru_cache(maxsize=16)
def outcomes(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every ``(wins, losses)`` of ``n`` paired questions and its multinomial log coefficient."""
    logf = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, n + 1)))])
    w, loss = np.nonzero(np.add.outer(np.arange(n + 1), np.arange(n + 1)) <= n)
    return w, loss, logf[n] - logf[w] - logf[loss] - logf[n - w - loss]


def _tail(w: np.ndarray, loss: np.ndarray, coef: np.ndarray, n: int, delta: float, p_win: np.ndarray,
          each: bool = False) -> np.ndarray:
    """P(the outcomes given) for each ``p_win`` on the null's boundary ``p_win − p_loss = delta`` (``each``: the
    outcomes' own probabilities, for one ``p_win``)."""
    p_loss = p_win - delta
    ties = np.maximum(1 - p_win - p_loss, 1e-300)
    if each:
        return np.exp(coef + w * math.log(p_win[0]) + loss * math.log(p_loss[0]) + (n - w - loss) * math.log(ties[0]))
    out = np.empty(len(p_win))
    step = max(1, 2_000_000 // max(1, len(w)))  # bounded memory at a thousand questions
    for i in range(0, len(p_win), step):
        pw, pl, pt = (np.log(x[i:i + step])[:, None] for x in (p_win, p_loss, ties))
        out[i:i + step] = np.exp(coef + w * pw + loss * pl + (n - w - loss) * pt).sum(axis=1)
    return out


def _nuisance(delta: float, points: int) -> np.ndarray:
    """``p_win`` over its range on the null's boundary (``p_loss = p_win − delta``, ties the rest), both ends in."""
    bottom, top = max(0.0, delta), (1 + delta) / 2
    return bottom + (top - bottom) * np.concatenate([[1e-9], (np.arange(points) + 0.5) / points, [1 - 1e-9]])


def exact_p_value(wins: int, losses: int, n: int, delta: float, grid: int = 24, refine: int = 8) -> float:
    """The exact unconditional p-value of ``H0: p_win − p_loss ≤ delta`` on ``n`` paired binary outcomes, ordered
    by Tango's statistic: the largest probability, over the share of discordant pairs (the nuisance, searched on a
    grid of ``grid`` points and refined about its peak by ``refine`` golden-section steps), of a statistic at least
    the one observed."""
    w, loss, coef = outcomes(n)
    z = _tango_z(w, loss, n, delta)
    region = z >= float(_tango_z(wins, losses, n, delta)) - 1e-9
    w, loss, coef = w[region], loss[region], coef[region]
    xs = _nuisance(delta, grid)
    ps = _tail(w, loss, coef, n, delta, xs)
    k = int(np.argmax(ps))
    lo, hi, best = xs[max(0, k - 1)], xs[min(len(xs) - 1, k + 1)], float(ps[k])
    for _ in range(refine):  # golden-section search between the peak's neighbours
        a, b = hi - 0.618 * (hi - lo), lo + 0.618 * (hi - lo)
        pa, pb = _tail(w, loss, coef, n, delta, np.array([a, b]))
        best = max(best, float(pa), float(pb))
        lo, hi = (lo, b) if pa >= pb else (a, hi)
    return min(1.0, best)


@lru_cache(maxsize=4)
def _null_table(n: int, delta: float) -> tuple[np.ndarray, np.ndarray]:
    """The test at one ``delta`` (the margin) as a table: every outcome's statistic, sorted down (negated, to
    search), and for each of 64 points of the nuisance the probability of the outcomes at least as extreme as each.
    A p-value is then a search and a column's largest entry (a gate asks at its margin every time)."""
    w, loss, coef = outcomes(n)
    z = _tango_z(w, loss, n, delta)
    order = np.argsort(-z, kind="stable")
    w, loss, coef = w[order], loss[order], coef[order]
    xs = _nuisance(delta, 64)
    table = np.empty((len(xs), len(w)), dtype=np.float32)
    for i, x in enumerate(xs):
        table[i] = np.cumsum(_tail(w, loss, coef, n, delta, np.array([x]), each=True))
    return -z[order], table


def _rejects_at_margin(wins: int, losses: int, n: int, delta: float, alpha: float) -> bool:
    """Whether the exact test rejects at a gate's margin (``delta`` = −margin), read from its table up to
    :data:`TABLE_MAX` questions (a p-value within 2 % of ``alpha``, where the table's grid could err, is searched
    again finely)."""
    if n <= TABLE_MAX:
        neg_z, table = _null_table(n, delta)
        k = int(np.searchsorted(neg_z, -float(_tango_z(wins, losses, n, delta)) + 1e-9, side="right"))
        p = float(table[:, k - 1].max()) if k else 0.0
        if abs(p - alpha) > 0.02 * alpha:
            return p <= alpha
    return exact_p_value(wins, losses, n, delta, grid=64, refine=12) <= alpha


def exact_lower(wins: int, losses: int, n: int, confidence: float, margin: float | None = None,
                 tol: float = 5e-4) -> float:
    """The one-sided ``confidence`` lower bound of ``p_win − p_loss``: the largest ``delta`` the exact test rejects
    at ``1 − confidence``, bracketed first at ``−margin`` by the test there (so the bound is above ``−margin``
    exactly when that test rejects: the gate's decision), then about Tango's normal bound, then bisected to ``tol``
    (its p-value grows with ``delta``; a coarser search of the nuisance between)."""
    alpha = 1 - confidence

    def rejects(delta: float) -> bool:
        return exact_p_value(wins, losses, n, delta, grid=16, refine=3) <= alpha

    lo, hi = -1.0, (wins - losses) / n
    if margin is not None and lo < -margin < hi:
        lo, hi = (-margin, hi) if _rejects_at_margin(wins, losses, n, -margin, alpha) else (lo, -margin)
    guess = score_lower(wins, losses, n, confidence)
    for edge in (guess - 0.02, guess + 0.02):
        if lo < edge < hi:
            lo, hi = (edge, hi) if rejects(edge) else (lo, edge)
    if lo == -1.0 and not rejects(-1.0 + 1e-9):
        return -1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rejects(mid) else (lo, mid)
    return lo


def score_lower(wins: int, losses: int, n: int, confidence: float) -> float:
    """Tango's normal-approximation bound (the score test inverted: Z(lower) = z), for more than EXACT_MAX."""
    z = NormalDist().inv_cdf(confidence)
    lo, hi = -1 + 1e-12, (wins - losses) / n
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if float(_tango_z(wins, losses, n, mid)) >= z else (lo, mid)
    return lo


def hall_lower(d: list[float], confidence: float) -> float:
    """The paired t lower bound with Hall's (1992) skewness correction: ``T = sqrt(n)·(S + γS²/3 + γ²S³/27 +
    γ/(6n))``, ``S = (mean − delta) / sd``, ``γ`` the sample skewness, is monotone in ``S`` (its cubic is
    ``((1 + γS/3)³ − 1) / γ``) and is inverted in closed form at the t quantile."""
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(max(0.0, sum((x - mean) ** 2 for x in d) / max(1, n - 1)))
    q = t_quantile(confidence, max(1, n - 1))
    if sd <= 1e-12:
        return mean
    gamma = sum((x - mean) ** 3 for x in d) / n / sd ** 3
    if abs(gamma) < 1e-9:
        return mean - q * sd / math.sqrt(n)
    inner = 1 + gamma * (q / math.sqrt(n) - gamma / (6 * n))
    s_star = 3 / gamma * (math.copysign(abs(inner) ** (1 / 3), inner) - 1)
    return mean - sd * s_star
