"""How often the online learner's decisions are wrong: the gate's false refusals and false promotions and the
rollback's false rollbacks, simulated (seeded) at n = 20, 100 and 500, with the shipped defaults against the old
rules (the gate: the 10 % quantile of a percentile bootstrap of the paired differences ≥ −0.02, pairs with a
failure dropped; the rollback: live accuracy below the previous version's − 0.1 with ≥ 20 labels each, checked
after every update, every label counted).

    .venv/bin/python perf/bench_online_decisions.py                 # 1000 trials each (a few minutes on 2 cores)
    .venv/bin/python perf/bench_online_decisions.py --trials 200    # a quick look
    .venv/bin/python perf/bench_online_decisions.py --only discordance   # issue 65's discordance and level rows

**The gate.** Scores per question of the served version, the starting version and a candidate, on n pinned
questions. Binary (accuracy 0.6): each question is surely right, surely wrong or a coin flip for every version
(the flips' share sets the discordance: two equally good versions disagree on ``d`` of the questions).
Continuous (F1/IoU): a question is settled (every version scores the same Beta(2, 2) value) or unsettled (each
version draws its own), unsettled on ``d`` of the questions. An *equal* candidate is another draw of the same;
a *worse* one loses ``2 × margin`` in mean (first on the unsettled questions, then the settled ones). The new
gate runs as the learner runs it (:func:`paravt_train.online.gate.decide`): the first candidate (the served
version is the start: one comparison) and a later one (served and start are different, equally good versions:
both comparisons). False refusal: an equal candidate refused (the worse of the two cases, the later one);
false promotion: a 2 × margin worse candidate promoted (the first case, one comparison).

**The discordance rows (issue 65).** How often an equally good candidate is refused when the versions disagree on
10, 30 or 50 % of the pinned questions (binary, n = 20 and 100): the first candidate of a run (one comparison) and
the later ones of a chain of six (each gated against the served version, which the promoted ones become, and the
start), before (0.5.1: Tango's normal bound, the margin sized at the planned 30 %) → after (the exact test, the
automatic margin sized at the mean discordance the chain's earlier gates observed). And the level: how often a
candidate exactly one margin worse is promoted at n = 20, 30, 50, on binary scores computed exactly over every
outcome (the worst over the share of questions on which the versions disagree) and on skewed F1/IoU-like scores
(a miss scores 0 one time in five, else a Beta(5, 1.5) overlap; the worse candidate misses more questions
outright; the versions disagree on 10 % or 30 % of the questions), before (Tango's normal bound; the plain paired
t-test) → after (the gate as it ships). ``--only discordance`` runs these rows alone.

**The rollback.** A version served before with live accuracy p and the served version (equal: p; worse:
p − 0.15) each get n labels from 20 users (one at a time, the learner checking after every 4); the new rule is
the learner's (:func:`paravt_train.online.promotion.rollback_look`, per-user caps before counting). An
adversary is one more user who labels every answer of the served version wrong (as many labels as the honest
users together): how often does one user force a rollback of an equally good version?
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paravt_train.online.bounds import outcomes, score_lower, t_quantile  # noqa: E402
from paravt_train.online.config import GateSettings, RollbackSettings  # noqa: E402
from paravt_train.online.gate import decide, gate_margin, sized_discordance  # noqa: E402
from paravt_train.online.promotion import OPERATOR, rollback_look  # noqa: E402

NS = (20, 100, 500)
DISCORDANCE = (0.1, 0.3)


# ---------------------------------------------------------------------------------------------------- the gate


def old_gate(cand: np.ndarray, served: np.ndarray, rng, margin: float = 0.02, confidence: float = 0.9,
             resamples: int = 2000) -> bool:
    """The old rule: the (1 − confidence) percentile of the bootstrap means of the paired differences ≥ −margin."""
    d = cand - served
    n = len(d)
    if set(np.unique(d)) <= {-1.0, 0.0, 1.0}:  # binary: a resample's mean is a multinomial draw
        p = [(d == 1).mean(), (d == 0).mean(), (d == -1).mean()]
        counts = rng.multinomial(n, p, size=resamples)
        means = (counts[:, 0] - counts[:, 2]) / n
    else:
        means = d[rng.integers(0, n, (resamples, n))].mean(axis=1)
    return float(np.sort(means)[int((1 - confidence) * resamples)]) >= -margin


class Binary:
    """Sure-right, sure-wrong and coin-flip questions; two equal versions disagree on ``d`` of them."""

    def __init__(self, d: float, acc: float = 0.6):
        self.flip = 2 * d
        self.right = acc - self.flip / 2
        if self.right < 0 or self.right + self.flip > 1:
            raise ValueError("accuracy and discordance do not fit")

    def questions(self, n: int, rng) -> np.ndarray:
        return rng.choice(3, size=n, p=[self.right, 1 - self.right - self.flip, self.flip])  # 0 right 1 wrong 2 flip

    def version(self, q: np.ndarray, rng, worse: float = 0.0) -> np.ndarray:
        x = min(0.5, worse / self.flip)
        y = (worse - self.flip * x) / self.right if self.right else 0.0
        u = rng.random(len(q))
        return np.where(q == 0, (u >= y).astype(float), np.where(q == 1, 0.0, (u < 0.5 - x).astype(float)))


class Continuous:
    """Settled questions (one Beta(2, 2) score for every version) and unsettled ones (a draw each), ``d`` of them."""

    def __init__(self, d: float):
        self.d = d

    def questions(self, n: int, rng) -> tuple[np.ndarray, np.ndarray]:
        return rng.random(n) < self.d, rng.beta(2, 2, n)

    def version(self, q, rng, worse: float = 0.0) -> np.ndarray:
        unsettled, value = q
        own = np.where(unsettled, rng.beta(2, 2, len(value)), value)
        f = min(1.0, worse / (0.5 * self.d))  # the loss on the unsettled questions first (mean score 0.5)
        g = (worse - 0.5 * self.d * f) / (0.5 * (1 - self.d)) if f == 1.0 else 0.0
        return own * np.where(unsettled, 1 - f, 1 - g)


def gate_rates(kind: str, d: float, n: int, trials: int, rng) -> dict:
    model = Binary(d) if kind == "binary" else Continuous(d)
    g = GateSettings(enabled=True, eval_set="pinned.parquet")
    margin = gate_margin(n, g, kind == "binary")
    out = {"old_refuse": 0, "old_promote": 0, "refuse_first": 0, "refuse_later": 0, "promote_first": 0,
           "promote_later": 0}
    for _ in range(trials):
        q = model.questions(n, rng)
        served, start = model.version(q, rng), model.version(q, rng)
        equal, worse = model.version(q, rng), model.version(q, rng, 2 * margin)
        worse_old = model.version(q, rng, 0.04)
        out["old_refuse"] += not old_gate(equal, served, rng)
        out["old_promote"] += old_gate(worse_old, served, rng)
        out["refuse_first"] += not decide(list(equal), list(served), g, "sim").promote
        out["refuse_later"] += not decide(list(equal), list(served), g, "sim", start=list(start)).promote
        out["promote_first"] += decide(list(worse), list(served), g, "sim").promote
        out["promote_later"] += decide(list(worse), list(served), g, "sim", start=list(start)).promote
    return {"margin": margin, **{k: v / trials for k, v in out.items()}}


# ------------------------------------------------------------------------------ discordance and level (issue 65)


def before_promotes(cand, ref, margin: float, confidence: float = 0.9) -> bool:
    """0.5.1's comparison: Tango's normal-approximation bound (binary scores), the plain paired t bound (F1/IoU)."""
    d = np.asarray(cand, dtype=float) - np.asarray(ref, dtype=float)
    n = len(d)
    if set(np.unique(d)) <= {-1.0, 0.0, 1.0}:
        return score_lower(int((d > 0).sum()), int((d < 0).sum()), n, confidence) >= -margin
    return d.mean() - t_quantile(confidence, n - 1) * d.std(ddof=1) / math.sqrt(n) >= -margin


def chain_refusals(d: float, n: int, trials: int, rng, length: int = 6) -> dict:
    """Equally good candidates gated one after another (binary, versions disagreeing on ``d`` of the questions):
    the refusal rate of the first (one comparison) and of the later ones (served and start), before → after."""
    model = Binary(d, acc=0.6 if d <= 0.4 else 0.5)
    g = GateSettings(enabled=True, eval_set="pinned.parquet")
    planned_margin = gate_margin(n, g, True)
    out = {"before_first": 0, "after_first": 0, "before_later": 0, "after_later": 0}
    for _ in range(trials):
        q = model.questions(n, rng)
        start = list(model.version(q, rng))
        served = {"before": start, "after": start}
        seen: list[float] = []
        for k in range(length):
            cand = list(model.version(q, rng))
            first = k == 0
            ok = before_promotes(cand, served["before"], planned_margin) and (
                first or before_promotes(cand, start, planned_margin))
            out["before_first" if first else "before_later"] += not ok
            served["before"] = cand if ok else served["before"]
            res = decide(cand, served["after"], g, "sim", start=None if first else start,
                         planned=sized_discordance(seen, g))
            seen.append(res.observed)
            out["after_first" if first else "after_later"] += not res.promote
            served["after"] = cand if res.promote else served["after"]
    later = trials * (length - 1)
    return {"margin": planned_margin, **{k: v / (trials if k.endswith("first") else later) for k, v in out.items()}}


def worst_binary_promotion(n: int) -> tuple[float, float]:
    """The promotion rate of a candidate exactly one margin worse on ``n`` binary questions, computed over every
    ``(wins, losses)``: the worst over the share of questions the versions disagree on, before → after."""
    g = GateSettings(enabled=True, eval_set="pinned.parquet")
    margin = gate_margin(n, g, True)
    w, loss, coef = outcomes(n)
    before, after = np.zeros(len(w), bool), np.zeros(len(w), bool)
    for i, (a, b) in enumerate(zip(w, loss, strict=True)):
        a, b = int(a), int(b)
        cand = [1.0] * a + [0.0] * b + [1.0] * (n - a - b)
        ref = [0.0] * a + [1.0] * b + [1.0] * (n - a - b)
        before[i] = before_promotes(cand, ref, margin)
        after[i] = decide(cand, ref, g, "sim", margin=margin).promote
    worst = [0.0, 0.0]
    for share in np.linspace(margin + 0.005, 1.0, 100):
        p_win, p_tie = (share - margin) / 2, max(1.0 - share, 1e-300)
        prob = np.exp(coef + w * np.log(max(p_win, 1e-300)) + loss * np.log(p_win + margin)
                      + (n - w - loss) * np.log(p_tie))
        worst = [max(worst[0], float(prob[before].sum())), max(worst[1], float(prob[after].sum()))]
    return worst[0], worst[1]


class ZeroInflated:
    """F1/IoU-like scores: a miss (0) one time in five, else a Beta(5, 1.5) overlap (mean 0.615, skewed); settled
    questions share one score across versions, unsettled ones (``u`` of them) draw their own; a worse version
    misses more questions outright (its differences are left-skewed: a few large losses)."""

    def __init__(self, u: float):
        self.u, self.mean = u, 0.8 * 5 / 6.5

    @staticmethod
    def draw(size: int, rng) -> np.ndarray:
        return np.where(rng.random(size) < 0.2, 0.0, rng.beta(5, 1.5, size))

    def questions(self, n: int, rng):
        return rng.random(n) < self.u, self.draw(n, rng)

    def version(self, q, rng, worse: float = 0.0) -> np.ndarray:
        unsettled, shared = q
        own = np.where(unsettled, self.draw(len(shared), rng), shared)
        return np.where(rng.random(len(shared)) < worse / self.mean, 0.0, own)


def skewed_promotion(u: float, n: int, trials: int, rng) -> tuple[float, float]:
    g = GateSettings(enabled=True, eval_set="pinned.parquet")
    model, margin = ZeroInflated(u), gate_margin(n, g, False)
    before = after = 0
    for _ in range(trials):
        q = model.questions(n, rng)
        served, worse = model.version(q, rng), model.version(q, rng, margin)
        before += before_promotes(worse, served, margin)
        after += decide(list(worse), list(served), g, "sim").promote
    return before / trials, after / trials


def discordance_rows(trials: int, rng) -> None:
    print(f"\ndiscordance: an equally good candidate refused, before (Tango's normal bound, margin sized at the "
          f"planned 0.3) → after (exact test, margin sized at the mean discordance the earlier gates observed); "
          f"{trials} chains of 6 candidates a cell\n")
    print("| discordance | n | margin (planned) | first: refused before → after | later in a chain: before → after |")
    print("|---|---|---|---|---|")
    for n in (20, 100):
        for d in (0.1, 0.3, 0.5):
            x = chain_refusals(d, n, trials, rng)
            print(f"| {d:.0%} | {n} | {x['margin']:.3f} | {x['before_first']:.1%} → {x['after_first']:.1%} | "
                  f"{x['before_later']:.1%} → {x['after_later']:.1%} |", flush=True)
    print("\nlevel: a candidate exactly one margin worse promoted (stated: at most 1 − confidence = 10 %), before → "
          f"after; binary exact (worst over the discordance), skewed F1/IoU simulated ({4 * trials} trials a cell)\n")
    print("| n | binary (exact, worst case) | skewed F1/IoU, 10 % unsettled | skewed F1/IoU, 30 % unsettled |")
    print("|---|---|---|---|")
    for n in (20, 30, 50):
        b0, b1 = worst_binary_promotion(n)
        s = [skewed_promotion(u, n, 4 * trials, rng) for u in (0.1, 0.3)]
        print(f"| {n} | {b0:.1%} → {b1:.1%} | {s[0][0]:.1%} → {s[0][1]:.1%} | {s[1][0]:.1%} → {s[1][1]:.1%} |",
              flush=True)


# ------------------------------------------------------------------------------------------------ the rollback


def old_rollback(before: float, served: list[float]) -> bool:
    """The old rule after every 4 labels: accuracy < before − 0.1, ≥ 20 labels each (before has its n already)."""
    right = 0
    for i, s in enumerate(served, 1):
        right += s
        if i % 4 == 0 and i >= 20 and right / i < before - 0.1:
            return True
    return False


def new_rollback(before: dict, stream: list[tuple[str, float]], r: RollbackSettings) -> bool:
    cur: dict[str, list] = {}
    looks = 0
    for i, (user, s) in enumerate(stream, 1):
        c = cur.setdefault(user, [0.0, 0.0, 0])
        if user == OPERATOR or c[2] < r.max_labels_per_user:
            c[0], c[1], c[2] = c[0] + s, c[1] + s * s, c[2] + 1
        if i % 4 == 0 or i == len(stream):
            looks, chk = rollback_look(cur, before, looks, r)
            if chk is not None and chk.rollback:
                return True
    return False


def rollback_rates(p: float, n: int, trials: int, rng, users: int = 20) -> dict:
    r = RollbackSettings()
    out = {"old_false": 0, "new_false": 0, "old_adversary": 0, "new_adversary": 0, "old_power": 0, "new_power": 0}
    for _ in range(trials):
        who = [f"u{k}" for k in rng.integers(0, users, n)]
        prev_scores = (rng.random(n) < p).astype(float)
        before: dict[str, list] = {}
        for u, s in zip(who, prev_scores, strict=True):
            c = before.setdefault(u, [0.0, 0.0, 0])
            if c[2] < r.max_labels_per_user:
                c[0], c[1], c[2] = c[0] + s, c[1] + s * s, c[2] + 1
        prev_acc = prev_scores.mean()
        who2 = [f"u{k}" for k in rng.integers(0, users, n)]
        equal = (rng.random(n) < p).astype(float)
        worse = (rng.random(n) < p - 0.15).astype(float)
        # the adversary: as many labels again, every one "wrong", interleaved with the honest users'
        adv = [("mallory", 0.0)] * n
        mixed = [x for pair in zip(list(zip(who2, equal, strict=True)), adv, strict=True) for x in pair]
        out["old_false"] += old_rollback(prev_acc, list(equal))
        out["new_false"] += new_rollback(before, list(zip(who2, equal, strict=True)), r)
        out["old_adversary"] += old_rollback(prev_acc, [s for _, s in mixed])
        out["new_adversary"] += new_rollback(before, mixed, r)
        out["old_power"] += old_rollback(prev_acc, list(worse))
        out["new_power"] += new_rollback(before, list(zip(who2, worse, strict=True)), r)
    return {k: v / trials for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=["discordance"], help="Run these rows alone.")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    if args.only == "discordance":
        discordance_rows(args.trials, rng)
        return
    g, r = GateSettings(), RollbackSettings()
    t0 = time.time()
    print(f"gate defaults: confidence {g.confidence}, power {g.power}, discordance {g.discordance}, margin "
          f"{g.margin} (None: the smallest the pinned set supports); {args.trials} trials, seed {args.seed}\n")
    print("| scores | discordance | n | old: equal refused | old: 0.04 worse promoted | new margin | "
          "new: equal refused (first / later) | new: 2×margin worse promoted (first / later) |")
    print("|---|---|---|---|---|---|---|---|")
    worst = {"refuse": 0.0, "promote": 0.0}
    for kind in ("binary", "continuous"):
        for d in DISCORDANCE:
            for n in NS:
                # the exact binary test at n = 500 takes a quarter second a comparison: a tenth of the trials there
                x = gate_rates(kind, d, n, args.trials if n <= 100 or kind != "binary" else args.trials // 10, rng)
                worst["refuse"] = max(worst["refuse"], x["refuse_first"], x["refuse_later"])
                worst["promote"] = max(worst["promote"], x["promote_first"], x["promote_later"])
                print(f"| {kind} | {d} | {n} | {x['old_refuse']:.1%} | {x['old_promote']:.1%} | {x['margin']:.3f} | "
                      f"{x['refuse_first']:.1%} / {x['refuse_later']:.1%} | "
                      f"{x['promote_first']:.1%} / {x['promote_later']:.1%} |", flush=True)
    print(f"\nworst new gate: equal refused {worst['refuse']:.1%} (target ≤ 20 %), 2×margin worse promoted "
          f"{worst['promote']:.1%} (target ≤ 10 %)")
    discordance_rows(args.trials, rng)
    print()
    print(f"rollback defaults: alpha {r.alpha}, looks {r.looks} at {r.min_rows}·j counted labels, min_users "
          f"{r.min_users}, max_labels_per_user {r.max_labels_per_user}, margin {r.margin}; 20 honest users\n")
    print("| accuracy | labels per version | old: false rollback | new: false rollback | old: one adversary forces "
          "it | new: one adversary forces it | old: 0.15 worse rolled back | new: 0.15 worse rolled back |")
    print("|---|---|---|---|---|---|---|---|")
    worst_rb = 0.0
    for p in (0.5, 0.7):
        for n in NS:
            x = rollback_rates(p, n, args.trials, rng)
            worst_rb = max(worst_rb, x["new_false"])
            print(f"| {p} | {n} | {x['old_false']:.1%} | {x['new_false']:.1%} | {x['old_adversary']:.1%} | "
                  f"{x['new_adversary']:.1%} | {x['old_power']:.1%} | {x['new_power']:.1%} |", flush=True)
    print(f"\nworst new false rollback {worst_rb:.1%} (target ≤ 5 %); {(time.time() - t0) / 60:.1f} min")
    if not math.isfinite(worst_rb):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
