"""DAPO-style zero-gradient pre-filter (paper, Section 3.1.3 and Appendix B).

Runs once before RL and removes samples whose GRPO advantage would be zero
whatever the policy does:

* open-ended samples whose ground-truth answer exceeds ``max_answer_words`` (15);
* prompts whose G rollouts under the given policy all score zero accuracy.

The rollouts go through the same :class:`paravt_agent.Agent` that serves users.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from paravt_train.data import RLSample, resolve_video
from paravt_train.rewards import accuracy_reward

__all__ = ["long_answer", "prefilter"]


def long_answer(sample: RLSample, max_words: int = 15) -> bool:
    return sample.task == "oe" and len(sample.answer.split()) > max_words


def prefilter(
    samples: Sequence[RLSample],
    agent=None,
    group: int = 8,
    max_answer_words: int = 15,
    video_root=None,
    progress: bool = True,
) -> tuple[list[RLSample], Counter]:
    """``(kept samples, Counter of drop reasons)``. Without ``agent`` only the length rule runs."""

    dropped: Counter = Counter()
    kept = []
    for s in samples:
        if long_answer(s, max_answer_words):
            dropped[f"open-ended answer over {max_answer_words} words"] += 1
        else:
            kept.append(s)
    if agent is None or not kept:
        return kept, dropped
    items = []
    for s in kept:
        video = str(resolve_video(s.videos[0], video_root)) if s.videos else None
        for _ in range(group):
            items.append({"video": video, "question": s.question_text(), "options": s.options})
    answers = agent.answer_many(items, concurrency=max(1, group), progress=progress)
    out = []
    for k, s in enumerate(kept):
        rollouts = answers[k * group : (k + 1) * group]
        accs = [accuracy_reward(a.trace.response, s.answer_value, s.task, s.options) for a in rollouts]
        if all(a == 0 for a in accs):
            dropped[f"all {group} rollouts scored zero"] += 1
        else:
            out.append(s)
    return out, dropped
