"""A reward term: +1 for a short answer, falling to 0 at 20 words (weight it with `reward.extra_terms`)."""

from paravt_agent.protocol import extract_answer


def brevity(text, sample, cfg) -> float:
    words = len(extract_answer(text).split())
    return max(0.0, 1.0 - words / 20)
