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
  Above :data:`~paravt_train.online.bounds.EXACT_MAX` questions the normal approximation is used (its worst
  level there: 10.2 %); the bounds are :mod:`paravt_train.online.bounds`;
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
from statistics import NormalDist

from paravt_agent.errors import ConfigError
from paravt_train.eval import heldout_scores
from paravt_train.infra.lora import adapter_base, is_adapter_dir
from paravt_train.online.bounds import EXACT_MAX, exact_lower, hall_lower, score_lower, t_quantile
from paravt_train.online.config import GateSettings

__all__ = ["MIN_QUESTIONS", "Comparison", "GateResult", "GateSizeError", "compare", "decide", "detectable_margin",
           "evaluate_dir", "gate_margin", "is_binary", "pinned_hash", "questions_needed", "refusal_rate",
           "sized_discordance", "t_quantile"]

MIN_QUESTIONS = 20  # below this the paired t-test's stated level is not to be trusted (nor the sizing's normal power)


class GateSizeError(ConfigError):
    """The pinned set is too small for the configured margin (or for any test at all)."""


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
            return Comparison(mean, exact_lower(wins, losses, n, confidence, margin), n, disc,
                              "exact (Tango-ordered)", wins, losses)
        return Comparison(mean, score_lower(wins, losses, n, confidence), n, disc, "score (Tango)", wins, losses)
    return Comparison(mean, hall_lower(d, confidence), n, disc, "paired t (Hall)", wins, losses)


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
