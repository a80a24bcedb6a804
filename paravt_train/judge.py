"""An optional LLM judge for open-ended answers, through any OpenAI-compatible endpoint.

Returns a score in [0, 1], or None on any failure (timeout, unreachable, unparseable
verdict) so the caller falls back to token F1.
"""

from __future__ import annotations

import re

PROMPT = (
    "Question: {question}\nReference answer: {reference}\nCandidate answer: {candidate}\n"
    "Does the candidate answer mean the same as the reference? Reply with a single number between 0 and 1."
)


class LLMJudge:
    def __init__(self, endpoint: str, model: str, api_key: str = "EMPTY", timeout: float = 20.0):
        from openai import OpenAI

        self.client = OpenAI(base_url=endpoint, api_key=api_key, timeout=timeout, max_retries=0)
        self.model = model

    @classmethod
    def from_settings(cls, j) -> LLMJudge:
        """From a reward config's ``judge`` settings (endpoint, model, api_key, timeout)."""
        return cls(j.endpoint, j.model, api_key=j.api_key, timeout=j.timeout)

    def score(self, question: str, candidate: str, reference: str) -> float | None:
        try:
            resp = self.client.chat.completions.create(
                model=self.model, temperature=0, max_tokens=8,
                messages=[{"role": "user", "content": PROMPT.format(
                    question=question, reference=reference, candidate=candidate)}],
            )
            m = re.search(r"\d+(?:\.\d+)?", resp.choices[0].message.content or "")
        except Exception:  # any endpoint failure: fall back to F1
            return None
        return min(1.0, max(0.0, float(m.group()))) if m else None
