"""The gate between an online candidate and the users: evaluate, compare, decide — with error rates it states.

A candidate is evaluated on the pinned evaluation set with the serving protocol (the same graph, greedy, the
served agent config) — in this process from its exported model directory, or on a shadow server — and compared
question by question with the served version's scores and with the starting version's (so that a run of
candidates, each a little worse than the last, cannot creep away from the start). A question the runtime failed
(``None``) scores 0 on that side: a candidate's failures count against it.

The test is one of non-inferiority, ``H0: candidate − reference ≤ −margin``, at one-sided ``confidence``:

* binary scores (MCQ accuracy): Tango's score test for the difference of paired proportions (the discordant
  pairs carry it: ``b`` questions only the candidate gets right, ``w`` only the reference does; the variance is
  the constrained maximum-likelihood one under ``H0``, so it holds its level with few or no discordant pairs);
* continuous scores (F1, IoU): the paired t-test on the per-question differences.

Either gives the one-sided lower bound of the paired difference; a candidate is promoted when both bounds (served,
start) are above ``−margin``. The promotion of a candidate exactly ``margin`` worse than a reference is at most
``1 − confidence``; the refusal of an equally good one is at most ``1 − power`` when the versions disagree on at
most ``discordance`` of the questions (the power is split over the two comparisons). That is the sizing
(:func:`detectable_margin`): with ``n`` questions the gate can hold a margin of ``(q_conf + q_pow) · sqrt(d / n)``,
and it refuses to start (:class:`GateSizeError`, with the questions a margin needs, :func:`questions_needed`) when
the operator's margin is below it; without a margin it holds the smallest one ``n`` supports.
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
from paravt_train.online.config import GateSettings

__all__ = ["MIN_QUESTIONS", "Comparison", "GateResult", "GateSizeError", "compare", "decide", "detectable_margin",
           "evaluate_dir", "gate_margin", "is_binary", "pinned_hash", "questions_needed", "t_quantile"]

MIN_QUESTIONS = 20  # below this the paired t-test's (and the score test's) stated levels are not to be trusted


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


def pinned_hash(prompts, n_frames: int | None = None) -> str:
    """A fingerprint of the pinned set (every question, its video, options and answer) and the frames it is seen
    with: scores stored with another fingerprint are stale."""
    rows = [[p.id, str(p.video), p.question, p.options, p.answer, p.task] for p in prompts]
    return hashlib.sha256(json.dumps([rows, n_frames], default=str).encode()).hexdigest()[:16]


def is_binary(*score_lists) -> bool:
    return all(s is None or s in (0.0, 1.0) for scores in score_lists for s in scores)


def _tango_z(wins: int, losses: int, n: int, delta: float) -> float:
    """Tango's (1998) score statistic for ``H0: p_win − p_loss = delta`` on ``n`` paired binary outcomes."""
    a = 2 * n
    b = -wins - losses + (2 * n - wins + losses) * delta
    c = -losses * delta * (1 - delta)
    p_loss = (math.sqrt(max(0.0, b * b - 4 * a * c)) - b) / (2 * a)  # its constrained MLE under H0
    var = n * (2 * p_loss + delta * (1 - delta))
    num = wins - losses - n * delta
    if var <= 1e-15:
        return math.copysign(math.inf, num) if num else 0.0
    return num / math.sqrt(var)


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


def compare(candidate: list, reference: list, confidence: float) -> Comparison:
    """The paired comparison of two score lists (the same questions, in order; ``None`` scores 0)."""
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
        z = NormalDist().inv_cdf(confidence)
        lo, hi = -1 + 1e-12, mean  # the bound inverts the score test: Z(lower) = z
        if _tango_z(wins, losses, n, hi) >= z:  # cannot happen above the estimate; kept for round-off
            return Comparison(mean, mean, n, disc, "score (Tango)", wins, losses)
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if _tango_z(wins, losses, n, mid) >= z else (lo, mid)
        return Comparison(mean, lo, n, disc, "score (Tango)", wins, losses)
    sd = math.sqrt(max(0.0, sum((x - mean) ** 2 for x in d) / max(1, n - 1)))
    low = mean - t_quantile(confidence, max(1, n - 1)) * sd / math.sqrt(n)
    return Comparison(mean, low, n, disc, "paired t", wins, losses)


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
           pinned: str = "") -> GateResult:
    """Compare per-question scores (the same questions, in order; ``None`` — failed in the runtime — scores 0)
    with the served version's and, when another version served first, with the starting version's (``start``);
    promote when both lower bounds are above ``−margin`` (default: :func:`gate_margin` of these questions)."""
    binary = is_binary(candidate, served, start or [])
    n = len(candidate)
    if margin is None:
        margin = gate_margin(n, gate, binary)
    vs = compare(candidate, served, gate.confidence)
    promote = n > 0 and vs.lower >= -margin
    start_rec = None
    if start is not None:
        vs0 = compare(candidate, start, gate.confidence)
        start_rec = {"id": start_id, "diff": vs0.diff, "lower": vs0.lower, "discordance": vs0.discordance}
        promote = promote and vs0.lower >= -margin
    mean = (lambda xs: sum(0.0 if x is None else x for x in xs) / len(xs) if xs else 0.0)  # noqa: E731
    observed = max(vs.discordance, start_rec["discordance"] if start_rec else 0.0)
    detectable = (detectable_margin(n, gate.confidence, gate.power, observed, binary) if n >= 2 else math.inf)
    return GateResult(promote=bool(promote), candidate=mean(candidate), served=mean(served), diff=vs.diff,
                      lower=vs.lower, n=n, margin=margin, confidence=gate.confidence, mode=mode, seconds=seconds,
                      scores=list(candidate), test=vs.test, failed=sum(x is None for x in candidate),
                      discordance=vs.discordance, detectable=detectable, start=start_rec, pinned=pinned)


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
