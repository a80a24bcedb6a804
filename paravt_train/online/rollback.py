"""Automatic rollback's statistics, beside the gate's (:mod:`paravt_train.online.gate`): pure functions of the live
counts, with their error rates stated.

The voters are *principals* (:mod:`paravt_agent.store.principals`): an API key's owner, the web page (one anonymous
principal), a user the operator's own code names, the operator. A version's live counts are ``{principal: [sum,
sum of squares, labels]}``, counted after the per-principal limits, at most ``max_labels_per_user`` labels of one
principal per version (the operator's own uncapped).

:func:`rollback_decision`: the served version's live score against the version served immediately before it
(never a rolled-back one), by a one-sided pooled two-sample z-test of ``before − margin − served`` (for binary
scores the two-proportion test) at ``alpha / looks``, checked only when the served version's count reaches
``j × min_rows`` (j = 1 … ``looks``, :func:`rollback_look`; Bonferroni over the planned looks), with labels from at
least ``min_users`` principals on each side. No group of ``k = leave_out`` principals may decide it, either way:

- **a decision that stands** is taken: to roll back when z stays above the critical value with any ``k``
  principals' labels removed (``z_low``, the lowest z so, is above it); to keep when z stays at or below it with
  any ``k`` removed (``z_high``, the highest, is at or below it);
- **contested** (neither stands: ``k`` principals or fewer tip it): the ``k`` principals pushing hardest against
  a rollback are set aside (blockers, if any) and the rollback must then stand with any ``k + 1`` of the others
  removed (forcers, if any, and one more: when no one blocks, the first step set aside honest voters, which
  alone would let ``k`` forcers gain as much as ``k`` honest voters weigh). ``z_trimmed`` is that z.

So ``k`` forcers move the decision no further than the loss of as many honest voters, ``k`` blockers no further
than the loss of as many honest voters on the other side. The operator's own labels are trusted: never set aside.
The extremes are searched over the subsets of the :data:`SEARCH` principals whose labels alone move z most that
way (``tests/test_principals.py`` checks the search against every subset). The error rates — an equally good
version rolled back (at most ``alpha``), the power against a worse one, forcing and blocking by 1–3 principals and
by one key posing as many users, and how ``leave_out``'s default was chosen — are measured by
``perf/bench_online_decisions.py`` and stated in docs/online_trust.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import combinations
from statistics import NormalDist

from paravt_train.online.config import RollbackSettings
from paravt_train.online.state import OPERATOR

__all__ = ["SEARCH", "RollbackCheck", "rollback_decision", "rollback_look"]

#: the principals, per direction, whose subsets the extremes are searched over (those moving z most alone; every
#: subset when there are no more: tests/test_principals.py finds no difference from the full search at 12)
SEARCH = 12


@dataclass
class RollbackCheck:
    rollback: bool
    tested: bool  # False: not enough labels or principals to test (the look is not used up)
    served: float = 0.0  # live means
    before: float = 0.0
    n: int = 0
    n_before: int = 0
    z: float = 0.0  # every counted label
    critical: float = 0.0
    z_low: float = 0.0  # the smallest z with any leave_out principals removed (the case against a rollback)
    z_high: float = 0.0  # the largest (the case for one)
    z_trimmed: float = 0.0  # contested: blockers set aside, k + 1 others removed (the decision's z)
    contested: bool = False  # neither decision stands with any leave_out principals removed
    set_aside: list[str] = field(default_factory=list)  # contested: the blockers set aside, then the k + 1 removed
    why: str = ""


Sums = tuple[float, float, int]


def _sums(counts: dict) -> Sums:
    s = ss = 0.0
    n = 0
    for a, b, k in counts.values():
        s, ss, n = s + a, ss + b, n + k
    return s, ss, n


def _z(cur: Sums, base: Sums, margin: float) -> float | None:
    """The pooled two-sample z of ``base − margin − cur`` (large: the served version is worse); None: a side has
    no labels."""
    (s1, ss1, n1), (s2, ss2, n2) = cur, base
    if not n1 or not n2:
        return None
    pooled = (s1 + s2) / (n1 + n2)
    var = max(0.0, (ss1 + ss2) / (n1 + n2) - pooled * pooled)
    num = s2 / n2 - margin - s1 / n1
    if var <= 1e-15:
        return math.inf if num > 1e-12 else -math.inf
    return num / math.sqrt(var * (1 / n1 + 1 / n2))


class _Labels:
    """Both versions' counts, and ``z`` with any set of principals' labels removed."""

    def __init__(self, served: dict, before: dict, margin: float):
        self.served, self.before, self.margin = served, before, margin
        self.cur, self.base = _sums(served), _sums(before)
        self.voters = sorted((set(served) | set(before)) - {OPERATOR})  # the operator is never set aside

    def z(self, without=()) -> float | None:
        if not without:
            return _z(self.cur, self.base, self.margin)
        cur, base = list(self.cur), list(self.base)
        for who in without:
            for tot, counts in ((cur, self.served), (base, self.before)):
                c = counts.get(who)
                if c is not None:
                    tot[0], tot[1], tot[2] = tot[0] - c[0], tot[1] - c[1], tot[2] - c[2]
        return _z(tuple(cur), tuple(base), self.margin)


def _extreme(labels: _Labels, k: int, sign: int) -> tuple[float, tuple]:
    """The smallest (``sign`` −1) or largest (+1) z with at most ``k`` principals removed, and whom: over the
    subsets of the :data:`SEARCH` principals whose removal alone moves z furthest that way; a removal that empties a
    side is not one."""
    z0 = labels.z()
    alone = [(sign * (z - z0), who) for who in labels.voters if (z := labels.z((who,))) is not None]
    top = [who for _, who in sorted(alone, reverse=True)[:SEARCH]]
    best, whom = z0, ()
    for size in range(1, min(k, len(top)) + 1):
        for group in combinations(top, size):
            z = labels.z(group)
            if z is not None and sign * (z - best) > 0:
                best, whom = z, group
    return best, whom


def _contested(labels: _Labels, k: int) -> tuple[float, tuple, tuple]:
    """z with the ``k`` principals pushing hardest against a rollback set aside (blockers, if any), then made as
    low as removing ``k + 1`` of the rest can make it (forcers, if any, and one for the honest voters the first
    step set aside when no one blocks: without it ``k`` forcers gain as much as ``k`` honest voters weigh)."""
    _, high = _extreme(labels, k, +1)
    rest = _Labels({w: c for w, c in labels.served.items() if w not in high},
                   {w: c for w, c in labels.before.items() if w not in high}, labels.margin)
    z, low = _extreme(rest, k + 1, -1)
    return z, high, low


def _quorum(served: dict, before: dict, r: RollbackSettings, out: RollbackCheck) -> bool:
    users = {u for u, c in served.items() if c[2]}
    users_before = {u for u, c in before.items() if c[2]}
    if out.n_before >= r.min_rows and len(users) >= r.min_users and len(users_before) >= r.min_users:
        return True
    out.why = (f"not tested: {out.n} labels from {len(users)} principals against {out.n_before} from "
               f"{len(users_before)} (needs {r.min_rows} labels and {r.min_users} principals on each side)")
    return False


def rollback_decision(served: dict, before: dict, r: RollbackSettings) -> RollbackCheck:
    """Whether the served version's live counts (``{principal: [sum, sum of squares, labels]}``) are worse than the
    version before's by more than ``r.margin`` at one look (one-sided at ``r.alpha / r.looks``), with at least
    ``r.min_users`` principals on each side, by a decision that stands with any ``r.leave_out`` principals' labels
    removed — or, where none does, with the ``r.leave_out`` pushing hardest against a rollback set aside and any
    ``r.leave_out + 1`` of the rest removed (the module)."""
    cur, base = _sums(served), _sums(before)
    out = RollbackCheck(False, False, cur[0] / cur[2] if cur[2] else 0.0, base[0] / base[2] if base[2] else 0.0,
                        cur[2], base[2])
    if not _quorum(served, before, r, out):
        return out
    labels, k = _Labels(served, before, r.margin), r.leave_out
    out.tested, out.critical, out.z = True, NormalDist().inv_cdf(1 - r.alpha / r.looks), labels.z()
    (out.z_low, low), (out.z_high, high) = _extreme(labels, k, -1), _extreme(labels, k, +1)
    if out.z_low > out.critical:
        out.rollback = True
    elif out.z_high > out.critical:
        out.contested = True
        out.z_trimmed, against, rest = _contested(labels, k)
        out.set_aside, out.rollback = [*against, *rest], out.z_trimmed > out.critical
    out.why = _why(out, r, len(labels.voters), low, high)
    return out


def _why(out: RollbackCheck, r: RollbackSettings, voters: int, low: tuple, high: tuple) -> str:
    c, k = out.critical, r.leave_out
    test = f"z {out.z:.2f} vs {c:.2f} (one-sided alpha {r.alpha:g} / {r.looks} looks)"
    if not out.contested:
        extreme = f"lowest {out.z_low:.2f}{_who(low)}" if out.rollback else f"highest {out.z_high:.2f}{_who(high)}"
        return (f"{'' if out.rollback else 'kept: '}{test}; stands with any {k} of {voters} principals left out "
                f"({extreme})")
    return (f"{'' if out.rollback else 'kept: '}{test}; contested, {k} or fewer principals tip it ({out.z_low:.2f}"
            f"{_who(low)}, {out.z_high:.2f}{_who(high)}): with {', '.join(high) or 'no one'} set aside and any "
            f"{k + 1} of the rest left out, z {out.z_trimmed:.2f} {'>' if out.rollback else '≤'} {c:.2f}")


def _who(group: tuple) -> str:
    return f" without {', '.join(group)}" if group else ""


def rollback_look(served: dict, before: dict, looks_done: int, r: RollbackSettings) -> tuple[int, RollbackCheck | None]:
    """The planned looks: test (:func:`rollback_decision`) only when the served version's counted labels reach
    the next ``j × min_rows`` and a look is left. Returns the looks used up (several passed at once count as used)
    and the check (None: no look now)."""
    n = sum(c[2] for c in served.values())
    if looks_done >= r.looks or n < (looks_done + 1) * r.min_rows:
        return looks_done, None
    chk = rollback_decision(served, before, r)
    if not chk.tested:  # not enough labels or principals before it: the look stays
        return looks_done, None
    return min(r.looks, max(looks_done + 1, n // r.min_rows)), chk
