"""The gate between an online candidate and the users: evaluate, compare, decide — with error rates it states.

A candidate is evaluated on the pinned evaluation set with the serving protocol (the same graph, greedy, the
served agent config) — in this process from its exported model directory, or on a shadow server — and compared
question by question with the served version's scores and with the starting version's (so that a run of
candidates, each a little worse than the last, cannot creep away from the start). A question the runtime failed
(``None``) scores 0 on that side: a candidate's failures count against it.

The test is one of non-inferiority, ``H0: candidate − reference ≤ −margin``, at one-sided ``confidence``:

* binary scores (MCQ accuracy): the exact unconditional test for the difference of paired proportions, ordered by
  Tango's score statistic (the discordant pairs carry it: ``b`` questions only the candidate gets right, ``w`` only
  the reference does). Its p-value is the largest probability, over every share of discordant pairs the null
  allows, of a statistic at least the one observed — so its level holds at every ``n``, where Tango's normal
  approximation promoted a candidate exactly ``margin`` worse 11–13 % of the time at n = 30–50 (stated: 10 %).
  Above :data:`EXACT_MAX` questions the normal approximation is used (its level holds there);
* continuous scores (F1, IoU): the paired t-test on the per-question differences with Hall's (1992) correction for
  their skewness (a candidate that loses much on a few questions has left-skewed differences, and the plain t-test
  promoted one ``margin`` worse 11–12 % of the time at n = 30–50).

Either gives the one-sided lower bound of the paired difference; a candidate is promoted when both bounds (served,
start) are above ``−margin``. The promotion of a candidate exactly ``margin`` worse than a reference is at most
``1 − confidence`` (``perf/bench_online_decisions.py`` measures it at n = 20, 30, 50); the refusal of an equally
good one is at most ``1 − power`` when the versions disagree on at most ``discordance`` of the questions (the power
is split over the two comparisons). That is the sizing (:func:`detectable_margin`): with ``n`` questions the gate
can hold a margin of ``(q_conf + q_pow) · sqrt(d / n)``, and it refuses to start (:class:`GateSizeError`, with the
questions a margin needs, :func:`questions_needed`) when the operator's margin is below it; without a margin it
holds the smallest one ``n`` supports — at the planned discordance, or (``discordance_window``) at the discordance
the last gates observed when that is larger (:func:`sized_discordance`).

**When the refusal bound holds.** Every gate records the discordance it observed (``observed``: the larger of its
comparisons') and the refusal rate of an equally good candidate that applies there (:func:`refusal_rate`); past the
discordance the margin was sized at it says so (``warning``), with that rate.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from statistics import NormalDist

import numpy as np

from paravt_agent.errors import ConfigError
from paravt_train.eval import heldout_scores
from paravt_train.infra.lora import adapter_base, is_adapter_dir
from paravt_train.online.config import GateSettings

__all__ = ["EXACT_MAX", "MIN_QUESTIONS", "Comparison", "GateResult", "GateSizeError", "compare", "decide",
           "detectable_margin", "evaluate_dir", "exact_p_value", "gate_margin", "is_binary", "pinned_hash",
           "questions_needed", "refusal_rate", "sized_discordance", "t_quantile"]

MIN_QUESTIONS = 20  # below this the paired t-test's stated level is not to be trusted (nor the sizing's normal power)
EXACT_MAX = 1000  # binary scores: the exact test up to this many questions (seconds), Tango's normal bound above
TABLE_MAX = 500  # up to this many, the exact test at a gate's margin is read from a table made once per margin


class GateSizeError(ConfigError):
    """The pinned set is too small for the configured margin (or for any test at all)."""


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


def _quantile(p: float, n: int, binary: bool) -> float:
    return NormalDist().inv_cdf(p) if binary else t_quantile(p, max(1, n - 1))


def detectable_margin(n: int, confidence: float, power: float, discordance: float, binary: bool = True,
                      comparisons: int = 2) -> float:
    """The smallest margin ``n`` paired questions can hold at one-sided ``confidence`` while an equally good
    candidate is refused at most ``1 − power`` of the time over ``comparisons`` comparisons (each sized at
    ``1 − (1 − power) / comparisons``), the versions' mean squared per-question difference being ``discordance``
    (binary scores: the share of questions on which they disagree)."""
    each = 1 - (1 - power) / max(1, comparisons)
    return (_quantile(confidence, n, binary) + _quantile(each, n, binary)) * math.sqrt(discordance / n)


def questions_needed(margin: float, confidence: float, power: float, discordance: float, binary: bool = True,
                     comparisons: int = 2) -> int:
    """The fewest questions whose :func:`detectable_margin` is at most ``margin``."""
    if margin <= 0:
        raise GateSizeError("a margin of 0 needs infinitely many questions: set online.gate.margin above 0")
    hi = MIN_QUESTIONS
    while detectable_margin(hi, confidence, power, discordance, binary, comparisons) > margin:
        hi *= 2
    lo = hi // 2
    while lo + 1 < hi:  # the margin falls with n: the first n that holds it
        mid = (lo + hi) // 2
        if detectable_margin(mid, confidence, power, discordance, binary, comparisons) <= margin:
            hi = mid
        else:
            lo = mid
    return max(MIN_QUESTIONS, hi)


def gate_margin(n: int, gate: GateSettings, binary: bool) -> float:
    """The margin the gate holds on ``n`` questions: the configured one when ``n`` supports it, else
    :class:`GateSizeError` saying how many questions it needs; unset, the smallest margin ``n`` supports."""
    kind = "binary" if binary else "continuous"
    if n < MIN_QUESTIONS:
        raise GateSizeError(f"the gate's pinned set has {n} questions; its tests need at least {MIN_QUESTIONS} "
                            f"(online.gate.eval_set, online.gate.limit)")
    detectable = detectable_margin(n, gate.confidence, gate.power, gate.discordance, binary)
    if gate.margin is None:
        return detectable
    if gate.margin < detectable:
        need = questions_needed(gate.margin, gate.confidence, gate.power, gate.discordance, binary)
        raise GateSizeError(
            f"online.gate.margin {gate.margin:g} is below what {n} pinned questions can detect ({detectable:.3f} "
            f"with {kind} scores at confidence {gate.confidence:g}, power {gate.power:g}, discordance "
            f"{gate.discordance:g}): a margin of {gate.margin:g} needs {need} questions — enlarge the pinned set, "
            f"raise the margin, or leave it unset (the gate then holds {detectable:.3f})")
    return gate.margin


def pinned_hash(prompts, protocol=None) -> str:
    """A fingerprint of the pinned set (every question, its video, options and answer) and of how it is scored
    (``protocol``: the evaluation agent's config — protocol, sampling, frames, budgets — and the gate's evaluation
    settings, :meth:`~paravt_train.online.promotion.Promotion.protocol`): scores stored with another fingerprint are
    stale, taken again rather than reused."""
    rows = [[p.id, str(p.video), p.question, p.options, p.answer, p.task] for p in prompts]
    return hashlib.sha256(json.dumps([rows, protocol], default=str, sort_keys=True).encode()).hexdigest()[:16]


def is_binary(*score_lists) -> bool:
    return all(s is None or s in (0.0, 1.0) for scores in score_lists for s in scores)


def refusal_rate(n: int, margin: float, confidence: float, discordance: float, binary: bool = True,
                 comparisons: int = 2) -> float:
    """About how often an equally good candidate is refused at ``margin`` when the versions' discordance is
    ``discordance`` (the sizing read the other way: each comparison misses with probability
    ``1 − Φ(margin · sqrt(n / d) − q_conf)``, the misses added over ``comparisons``)."""
    if discordance <= 0:
        return 0.0
    q = margin * math.sqrt(n / discordance) - _quantile(confidence, n, binary)
    return min(1.0, comparisons * (1 - NormalDist().cdf(q)))


def sized_discordance(observed: list[float], gate: GateSettings) -> float:
    """The discordance the automatic margin is sized at: the planned one (``gate.discordance``), or the mean of
    the discordance the last ``gate.discordance_window`` gates observed when that is larger. An operator's margin
    (``gate.margin`` set) is never resized: it is the planned one."""
    recent = [d for d in observed if d is not None][-gate.discordance_window:] if gate.discordance_window else []
    if gate.margin is not None or not recent:
        return gate.discordance
    return max(gate.discordance, min(1.0, sum(recent) / len(recent)))


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
        z = np.where(var > 1e-15, num / np.sqrt(np.maximum(var, 1e-300)), np.sign(num) * np.inf)
    return z


@lru_cache(maxsize=16)
def _outcomes(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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
    w, loss, coef = _outcomes(n)
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
    w, loss, coef = _outcomes(n)
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


def _exact_lower(wins: int, losses: int, n: int, confidence: float, margin: float | None = None,
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
    guess = _score_lower(wins, losses, n, confidence)
    for edge in (guess - 0.02, guess + 0.02):
        if lo < edge < hi:
            lo, hi = (edge, hi) if rejects(edge) else (lo, edge)
    if lo == -1.0 and not rejects(-1.0 + 1e-9):
        return -1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rejects(mid) else (lo, mid)
    return lo


def _score_lower(wins: int, losses: int, n: int, confidence: float) -> float:
    """Tango's normal-approximation bound (the score test inverted: Z(lower) = z), for more than EXACT_MAX."""
    z = NormalDist().inv_cdf(confidence)
    lo, hi = -1 + 1e-12, (wins - losses) / n
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if float(_tango_z(wins, losses, n, mid)) >= z else (lo, mid)
    return lo


def _hall_lower(d: list[float], confidence: float) -> float:
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


@dataclass
class Comparison:
    """The candidate against one reference version on the same questions."""

    diff: float  # mean candidate − reference
    lower: float  # its one-sided ``confidence`` lower bound
    n: int
    discordance: float  # mean squared per-question difference (binary: the share of questions that disagree)
    test: str
    wins: int = 0  # questions the candidate scores higher on
    losses: int = 0


def compare(candidate: list, reference: list, confidence: float, margin: float | None = None) -> Comparison:
    """The paired comparison of two score lists (the same questions, in order; ``None`` scores 0); ``margin``: the
    one the bound is held against (binary scores: the bound is above ``−margin`` exactly when the test there
    rejects)."""
    if len(candidate) != len(reference):
        raise ValueError("the gate compares the same questions: got different lengths")
    c = [0.0 if x is None else float(x) for x in candidate]
    r = [0.0 if x is None else float(x) for x in reference]
    n = len(c)
    if n == 0:
        return Comparison(0.0, -math.inf, 0, 0.0, "none")
    d = [x - y for x, y in zip(c, r, strict=True)]
    mean = sum(d) / n
    disc = sum(x * x for x in d) / n
    wins, losses = sum(x > 0 for x in d), sum(x < 0 for x in d)
    if is_binary(c, r):
        if n <= EXACT_MAX:
            return Comparison(mean, _exact_lower(wins, losses, n, confidence, margin), n, disc,
                              "exact (Tango-ordered)", wins, losses)
        return Comparison(mean, _score_lower(wins, losses, n, confidence), n, disc, "score (Tango)", wins, losses)
    return Comparison(mean, _hall_lower(d, confidence), n, disc, "paired t (Hall)", wins, losses)


@dataclass
class GateResult:
    promote: bool
    candidate: float
    served: float
    diff: float
    lower: float  # the one-sided lower bound of the paired difference with the served version
    n: int
    margin: float
    confidence: float
    mode: str
    seconds: float = 0.0
    scores: list = field(default_factory=list)  # the candidate's per-question scores (None: failed in the runtime)
    test: str = ""
    failed: int = 0  # questions the candidate's runtime failed (scored 0)
    discordance: float = 0.0  # with the served version
    detectable: float = 0.0  # the margin this n supports at the discordance observed (sized at the planned one)
    start: dict | None = None  # the comparison with the starting version: {id, diff, lower}; None: it serves
    pinned: str = ""  # pinned_hash of the set the scores are on
    planned: float = 0.0  # the discordance the margin is sized at (the planned one, or the last gates' observed)
    observed: float = 0.0  # the discordance this gate observed (the larger of its comparisons')
    refusal_rate: float = 0.0  # an equally good candidate's refusal rate at the observed discordance and this margin
    warning: str = ""  # said when the observed discordance is past the planned one (the bound no longer holds)

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        verdict = "promoted" if self.promote else "refused"
        start = ""
        if self.start:
            start = f"; vs start {self.start['id']} {self.start['diff']:+.3f} (lower {self.start['lower']:+.3f})"
        failed = f", {self.failed} failed (scored 0)" if self.failed else ""
        return (f"{verdict}: {self.candidate:.3f} vs served {self.served:.3f} on {self.n} questions{failed}, "
                f"difference {self.diff:+.3f} (lower {self.confidence:.0%} bound {self.lower:+.3f}, margin "
                f"{self.margin:.3g}, {self.test}){start}; {self.mode}, {self.seconds:.0f} s")


def decide(candidate: list, served: list, gate: GateSettings, mode: str, seconds: float = 0.0, *,
           start: list | None = None, start_id: str = "start", margin: float | None = None,
           pinned: str = "", planned: float | None = None) -> GateResult:
    """Compare per-question scores (the same questions, in order; ``None`` — failed in the runtime — scores 0)
    with the served version's and, when another version served first, with the starting version's (``start``);
    promote when both lower bounds are above ``−margin`` (default: :func:`gate_margin` of these questions at the
    ``planned`` discordance, default ``gate.discordance``). Past the planned discordance the result says so, with
    the refusal rate that applies (``warning``)."""
    binary = is_binary(candidate, served, start or [])
    n = len(candidate)
    planned = gate.discordance if planned is None else planned
    if margin is None:
        margin = gate_margin(n, gate.model_copy(update={"discordance": planned}), binary)
    vs = compare(candidate, served, gate.confidence, margin)
    promote = n > 0 and vs.lower >= -margin
    start_rec = None
    if start is not None:
        vs0 = compare(candidate, start, gate.confidence, margin)
        start_rec = {"id": start_id, "diff": vs0.diff, "lower": vs0.lower, "discordance": vs0.discordance}
        promote = promote and vs0.lower >= -margin
    mean = (lambda xs: sum(0.0 if x is None else x for x in xs) / len(xs) if xs else 0.0)  # noqa: E731
    observed = max(vs.discordance, start_rec["discordance"] if start_rec else 0.0)
    detectable = (detectable_margin(n, gate.confidence, gate.power, observed, binary) if n >= 2 else math.inf)
    comparisons = 2 if start is not None else 1
    refusing = refusal_rate(n, margin, gate.confidence, observed, binary, comparisons) if n else 0.0
    warning = ""
    if observed > planned:
        stated = refusal_rate(n, margin, gate.confidence, planned, binary, comparisons)
        warning = (f"the versions disagree more than the gate was sized for (discordance {observed:.2f} on {n} "
                   f"pinned questions, sized at {planned:.2f}): an equally good candidate is refused about "
                   f"{refusing:.0%} of the time here, not {stated:.0%}; leave online.gate.margin unset with "
                   f"online.gate.discordance_window (the margin then sizes itself from what the gates observe), raise "
                   f"online.gate.discordance to {observed:.2f}, or enlarge the pinned set")
    return GateResult(promote=bool(promote), candidate=mean(candidate), served=mean(served), diff=vs.diff,
                      lower=vs.lower, n=n, margin=margin, confidence=gate.confidence, mode=mode, seconds=seconds,
                      scores=list(candidate), test=vs.test, failed=sum(x is None for x in candidate),
                      discordance=vs.discordance, detectable=detectable, start=start_rec, pinned=pinned,
                      planned=planned, observed=observed, refusal_rate=refusing, warning=warning)


def evaluate_dir(model_dir, agent_config, prompts, concurrency: int = 8, endpoint: str | None = None,
                 adapter: str | None = None, api_key: str | None = None) -> list:
    """Per-question scores of the model in ``model_dir``: in this process (``endpoint`` None) or on the SGLang
    server at ``endpoint`` (a shadow server holding it; ``adapter``: the name its weight sync served a LoRA version
    under, which every request names; ``api_key``: the server's key)."""
    # the policy registry imports the backends it names (torch, transformers) on use: a gate run pays for them
    from paravt_agent.policy.registry import make_policy

    adapter_version = is_adapter_dir(model_dir)
    base = adapter_base(model_dir) if adapter_version else str(model_dir)
    if endpoint is not None:  # the processor is the base model's (an adapter directory has none)
        policy = make_policy("sglang", base, endpoint, api_key=api_key, lora=adapter)
    elif adapter_version:  # a LoRA version: its adapter merged into the base, in this process
        from peft import PeftModel
        from transformers import AutoModelForImageTextToText, AutoProcessor

        merged = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base), str(model_dir))
        policy = make_policy("local", base, model_obj=merged.merge_and_unload().eval(),
                             processor=AutoProcessor.from_pretrained(base), max_batch=16)
    else:
        policy = make_policy("local", str(model_dir), max_batch=16)
    return heldout_scores(policy, agent_config, prompts, concurrency)["eval/scores"]
