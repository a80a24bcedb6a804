"""Automatic rollback's statistics, beside the gate's (:mod:`paravt_train.online.gate`): pure functions of the live
counts, with their error rates stated.

:func:`rollback_decision`: the served version's live score — the gate's metric (accuracy, F1, IoU) of the answers users
labelled, counted after the per-user limits and at most ``max_labels_per_user`` labels of one user per version —
against the version served immediately before it (never a rolled-back one), by a one-sided pooled two-sample z-test
(for binary scores the two-proportion test) at ``alpha / looks``, checked only when the served version's count reaches
``j × min_rows`` (j = 1 … ``looks``, :func:`rollback_look`; Bonferroni over the planned looks: a version as good as
the one before is rolled back at most ``alpha`` of the time), with labels from at least ``min_users`` users on each
side, and only when the test stays significant with any single user's labels left out of both sides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

from paravt_train.online.config import RollbackSettings

__all__ = ["RollbackCheck", "rollback_decision", "rollback_look"]


@dataclass
class RollbackCheck:
    rollback: bool
    tested: bool  # False: not enough labels or users to test (the look is not used up)
    served: float = 0.0  # live means
    before: float = 0.0
    n: int = 0
    n_before: int = 0
    z: float = 0.0
    critical: float = 0.0
    why: str = ""


def _totals(counts: dict, leave_out: str | None = None) -> tuple[float, float, int]:
    s = ss = 0.0
    n = 0
    for user, (a, b, k) in counts.items():
        if user != leave_out:
            s, ss, n = s + a, ss + b, n + k
    return s, ss, n


def _z(cur: tuple, base: tuple, margin: float) -> float:
    """The pooled two-sample z of ``base − margin − cur`` (large: the served version is worse)."""
    (s1, ss1, n1), (s2, ss2, n2) = cur, base
    if not n1 or not n2:
        return -math.inf
    pooled = (s1 + s2) / (n1 + n2)
    var = max(0.0, (ss1 + ss2) / (n1 + n2) - pooled * pooled)
    num = s2 / n2 - margin - s1 / n1
    if var <= 1e-15:
        return math.inf if num > 1e-12 else -math.inf
    return num / math.sqrt(var * (1 / n1 + 1 / n2))


def rollback_decision(served: dict, before: dict, r: RollbackSettings) -> RollbackCheck:
    """Whether the served version's live counts (``{user: [sum, sum of squares, labels]}``) are worse than the
    version before's by more than ``r.margin`` at one look (one-sided at ``r.alpha / r.looks``), with at least
    ``r.min_users`` users on each side and the decision unchanged with any one user's labels left out."""
    cur, base = _totals(served), _totals(before)
    users = {u for u, c in served.items() if c[2]}
    users_before = {u for u, c in before.items() if c[2]}
    out = RollbackCheck(False, False, cur[0] / cur[2] if cur[2] else 0.0, base[0] / base[2] if base[2] else 0.0,
                        cur[2], base[2])
    if base[2] < r.min_rows or len(users) < r.min_users or len(users_before) < r.min_users:
        out.why = (f"not tested: {cur[2]} labels from {len(users)} users against {base[2]} from "
                   f"{len(users_before)} (needs {r.min_rows} labels and {r.min_users} users on each side)")
        return out
    out.tested = True
    out.critical = NormalDist().inv_cdf(1 - r.alpha / r.looks)
    out.z = _z(cur, base, r.margin)
    if out.z <= out.critical:
        out.why = f"kept: z {out.z:.2f} ≤ {out.critical:.2f}"
        return out
    for user in sorted(users | users_before):
        z = _z(_totals(served, user), _totals(before, user), r.margin)
        if z <= out.critical:
            out.why = f"kept: significant (z {out.z:.2f}) only with user {user}'s labels (without: {z:.2f})"
            return out
    out.rollback = True
    out.why = (f"z {out.z:.2f} > {out.critical:.2f} (one-sided alpha {r.alpha:g} / {r.looks} looks), with any "
               f"one of {len(users | users_before)} users left out too")
    return out


def rollback_look(served: dict, before: dict, looks_done: int, r: RollbackSettings) -> tuple[int, RollbackCheck | None]:
    """The planned looks: test (:func:`rollback_decision`) only when the served version's counted labels reach
    the next ``j × min_rows`` and a look is left. Returns the looks used up (several passed at once count as used)
    and the check (None: no look now)."""
    n = sum(c[2] for c in served.values())
    if looks_done >= r.looks or n < (looks_done + 1) * r.min_rows:
        return looks_done, None
    chk = rollback_decision(served, before, r)
    if not chk.tested:  # not enough labels or users before it: the look stays
        return looks_done, None
    return min(r.looks, max(looks_done + 1, n // r.min_rows)), chk
