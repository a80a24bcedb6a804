"""DAPO-style zero-gradient pre-filter (paper, Section 3.1.3 and Appendix B).

Runs once before RL and removes samples whose GRPO advantage would be zero:

* open-ended samples whose ground-truth answer exceeds ``max_answer_words`` (15): the F1 reward stays near zero
  whatever the policy writes;
* prompts whose G rollouts under the given (starting) policy all score alike (:func:`zero_variance`): the
  group-normalised advantage of every rollout is 0, so the prompt teaches nothing — the paper's "unanimously
  negative rollouts" are the commonest case, and an all-correct group is the other.

The rollouts go through the same :class:`paravt_agent.Agent` that serves users and are scored with the RL
reward itself (R_acc + λ_fmt·R_fmt + R_tool, :func:`paravt_train.rewards.score`): alike means alike under what
GRPO normalises. A rollout the runtime failed (a timeout, an endpoint error) is asked again once and otherwise
left out of its group; a prompt left with fewer than two scorable rollouts is kept (nothing is known).

Which protocol and reward: the run's (``paravt-train prefilter --config grpo.yaml``: the GRPO config's agent
protocol and method, its reward, τ, G, rollout backend and judge), so a ``dapo``, ``weaver`` or ``vanilla-grpo``
data set is filtered under the protocol and reward it will train with.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from paravt_train.data.formats import RLSample, resolve_video
from paravt_train.data.records import episode_transcript
from paravt_train.rewards import RewardConfig, score

__all__ = ["long_answer", "prefilter", "zero_variance"]


def long_answer(sample: RLSample, max_words: int = 15) -> bool:
    return sample.task == "oe" and len(sample.answer.split()) > max_words


def zero_variance(rewards: Sequence[float], tol: float = 1e-9) -> bool:
    """Whether a group's rewards are all alike (GRPO's advantages would all be 0): at least two rewards, spread
    within ``tol``."""
    return len(rewards) >= 2 and max(rewards) - min(rewards) <= tol


def prefilter(
    samples: Sequence[RLSample],
    agent=None,
    group: int = 8,
    max_answer_words: int = 15,
    video_root=None,
    progress: bool = True,
    reward: RewardConfig | None = None,
    judge=None,
) -> tuple[list[RLSample], Counter]:
    """``(kept samples, Counter of drop reasons)``. Without ``agent`` only the length rule runs. ``reward`` and
    ``judge`` score the rollouts (default: the paper's reward, token F1), as the run that trains on them will."""
    reward = reward or RewardConfig()
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
    answers = agent.answer_many(items, concurrency=max(1, group), progress=progress, reruns=1)
    out = []
    for k, s in enumerate(kept):
        rollouts = [a for a in answers[k * group: (k + 1) * group] if a.trace.scorable]
        # scored as the trainer scores a rollout (rl.rollout.run_group): the final response, the calls that worked
        scores = [score(episode_transcript(a), s.answer_value, s.task, s.options, reward, judge, s.question_text(),
                        a.trace.response, sum(1 for c in a.trace.all_calls() if not c.error)) for a in rollouts]
        totals = [r.total for r in scores]
        if zero_variance(totals):
            accs = {round(r.acc, 6) for r in scores}
            kind = "wrong" if accs == {0.0} else "right" if accs == {1.0} else "alike"
            dropped[f"all {len(totals)} rollouts scored alike ({kind})"] += 1
        else:
            out.append(s)
    return out, dropped
