"""The gate between an online candidate and the users: evaluate, compare with the served version, decide.

A candidate is evaluated on the pinned evaluation set with the serving protocol (the same graph, greedy, the
served agent config) — in this process from its exported model directory, or on a shadow server — and compared
question by question with the served version's scores (taken when that version passed its own gate). The test is
one of non-inferiority: the paired bootstrap interval of ``candidate − served`` (``confidence``, one-sided) must
lie above ``−margin``. The decision, the scores and the interval are what :class:`GateResult` records.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

from paravt_train.eval import heldout_scores
from paravt_train.online.config import GateSettings

__all__ = ["GateResult", "decide", "evaluate_dir", "lower_bound"]


@dataclass
class GateResult:
    promote: bool
    candidate: float
    served: float
    diff: float
    lower: float  # the one-sided lower bound of the paired difference
    n: int
    margin: float
    confidence: float
    mode: str
    seconds: float = 0.0
    scores: list = field(default_factory=list)  # the candidate's per-question scores (None: failed in the runtime)

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        verdict = "promoted" if self.promote else "refused"
        return (f"{verdict}: {self.candidate:.3f} vs served {self.served:.3f} on {self.n} questions, difference "
                f"{self.diff:+.3f} (lower {self.confidence:.0%} bound {self.lower:+.3f}, margin {self.margin:g}; "
                f"{self.mode}, {self.seconds:.0f} s)")


def lower_bound(diffs: list[float], confidence: float, n: int = 10_000, seed: int = 0) -> float:
    """The one-sided ``confidence`` lower bound of the mean of ``diffs`` (bootstrap, percentile method)."""
    if not diffs:
        return 0.0
    rng = random.Random(seed)
    k = len(diffs)
    means = sorted(sum(diffs[rng.randrange(k)] for _ in range(k)) / k for _ in range(n))
    return means[int((1 - confidence) * n)]


def decide(candidate: list, served: list, gate: GateSettings, mode: str, seconds: float = 0.0) -> GateResult:
    """Compare per-question scores (the same questions, in order; a ``None`` — failed in the runtime — leaves its
    pair out) and decide."""
    if len(candidate) != len(served):
        raise ValueError("the gate compares the same questions: got different lengths")
    pairs = [(c, s) for c, s in zip(candidate, served, strict=True) if c is not None and s is not None]
    diffs = [c - s for c, s in pairs]
    mean = (lambda xs: sum(xs) / len(xs) if xs else 0.0)  # noqa: E731
    low = lower_bound(diffs, gate.confidence)
    return GateResult(promote=bool(pairs) and low >= -gate.margin, candidate=mean([c for c, _ in pairs]),
                      served=mean([s for _, s in pairs]), diff=mean(diffs), lower=low, n=len(pairs),
                      margin=gate.margin, confidence=gate.confidence, mode=mode, seconds=seconds,
                      scores=list(candidate))


def evaluate_dir(model_dir, agent_config, prompts, concurrency: int = 8, endpoint: str | None = None,
                 adapter: str | None = None, api_key: str | None = None) -> list:
    """Per-question scores of the model in ``model_dir``: in this process (``endpoint`` None) or on the SGLang
    server at ``endpoint`` (a shadow server holding it; ``adapter``: the name its weight sync served a LoRA version
    under, which every request names; ``api_key``: the server's key)."""
    # the policy registry imports the backends it names (torch, transformers) on use: a gate run pays for them
    from paravt_agent.policy.registry import make_policy

    config = Path(model_dir) / "adapter_config.json"
    base = json.loads(config.read_text())["base_model_name_or_path"] if config.is_file() else str(model_dir)
    if endpoint is not None:  # the processor is the base model's (an adapter directory has none)
        policy = make_policy("sglang", base, endpoint, api_key=api_key, lora=adapter)
    elif config.is_file():  # a LoRA version: its adapter merged into the base, in this process
        from peft import PeftModel
        from transformers import AutoModelForImageTextToText, AutoProcessor

        merged = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base), str(model_dir))
        policy = make_policy("local", base, model_obj=merged.merge_and_unload().eval(),
                             processor=AutoProcessor.from_pretrained(base), max_batch=16)
    else:
        policy = make_policy("local", str(model_dir), max_batch=16)
    return heldout_scores(policy, agent_config, prompts, concurrency)["eval/scores"]
