"""AVATAR's stratified replay buffer (AVATAR, Section 4.1 and Eq. 11) and how a GRPO step mixes it in.

Stored rollouts keep their token sequences with their behaviour logprobs; a draw enters the update with the
off-policy advantage of Eq. 11 (:func:`paravt_train.rl.objective.offpolicy_advantages`, σ over every rank's draws),
an importance ratio against those logprobs and weight α. Every rank keeps its own buffer (checkpointed per
rank); frames are stored once, by content key, beside the checkpoints.
"""

from __future__ import annotations

import hashlib
import random
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from paravt_train.rl.rollout import TokenSequence

__all__ = ["ReplayBuffer", "ReplayItem", "store_frames"]

def _frame_key(frame) -> str:
    a = np.ascontiguousarray(np.asarray(frame))
    return hashlib.sha1(str(a.shape).encode() + a.tobytes()).hexdigest()


@dataclass(kw_only=True)  # built by keyword (tests/test_architecture.py)
class ReplayItem:
    """One stored rollout: its prompt, its token sequences (behaviour logprobs included), its reward."""

    prompt_id: str
    sequences: list
    reward: float


@dataclass
class ReplayBuffer:
    """AVATAR's stratified replay buffer (AVATAR, Section 4.1 and Eq. 11).

    * Three fixed-capacity tiers, Hard / Medium / Easy = ``tiers`` (40 / 35 / 25 %) of ``capacity``;
      a full tier evicts its oldest rollout at least as easy as the newcomer (else its oldest), so easy
      rollouts never push hard ones out (AVATAR: difficult samples are retained).
    * A rollout's tier comes from its prompt's moving-average reward ``R̄(q)`` (VCRS: the mean of the
      prompt's last ``baseline_window`` on-policy rollout rewards), placed against the 40 % and 75 %
      quantiles of ``R̄`` over the rollouts in the buffer: the bottom 40 % are Hard, the next 35 %
      Medium, the top 25 % Easy.
    * A draw of k takes 40 / 35 / 25 % from the tiers (topped up from the others when one is short).
    * Replayed rollouts enter the loss with the off-policy advantage of Eq. 11
      (:func:`offpolicy_advantages`), an importance ratio from their stored behaviour logprobs, and
      weight ``alpha``.
    """

    capacity: int = 512
    tiers: tuple[float, float, float] = (0.40, 0.35, 0.25)
    alpha: float = 0.6
    baseline_window: int = 20
    seed: int = 0
    store: dict = field(default_factory=lambda: {"hard": deque(), "medium": deque(), "easy": deque()})

    @classmethod
    def from_settings(cls, r, seed: int = 0) -> ReplayBuffer:
        """From a GRPO config's ``replay`` settings."""
        return cls(capacity=r.capacity, tiers=r.tiers, alpha=r.alpha, baseline_window=r.baseline_window, seed=seed)

    def __post_init__(self):
        self._rng = random.Random(self.seed)
        self.history: dict[str, deque] = defaultdict(lambda: deque(maxlen=self.baseline_window))
        caps = [int(self.capacity * f) for f in self.tiers]
        caps[0] += self.capacity - sum(caps)
        self.tier_capacity = dict(zip(("hard", "medium", "easy"), caps, strict=True))

    def __len__(self) -> int:
        return sum(len(t) for t in self.store.values())

    @property
    def items(self) -> list[ReplayItem]:
        return [it for t in self.store.values() for it in t]

    def observe(self, prompt_id: str, reward: float) -> None:
        """One on-policy rollout's reward: updates the prompt's moving average ``R̄(q)``."""
        self.history[prompt_id].append(float(reward))

    def baseline(self, prompt_id: str) -> float:
        """VCRS ``R̄(q)``: the mean of the prompt's last ``baseline_window`` on-policy rollout rewards."""
        h = self.history.get(prompt_id)
        return sum(h) / len(h) if h else 0.0

    def tier_for(self, prompt_id: str) -> str:
        """Hard / Medium / Easy for a rollout of ``prompt_id``: its ``R̄`` against the 40 % / 75 % quantiles of
        ``R̄`` over the buffer's rollouts and this one (its rank: the share of rollouts with a lower ``R̄``).

        Rollouts tied at one ``R̄`` (e.g. every prompt answered alike so far) span a range of quantiles, and are
        shared among the tiers that range covers in proportion to the overlap — each goes where its tie group is
        furthest below its share — so ten equal rollouts split 4 / 3-4 / 2-3 as the tiers intend, not 10 / 0 / 0.
        (A full tier evicts its oldest rollout at least as easy as the newcomer, :meth:`add`.)"""
        value = self.baseline(prompt_id)
        scores = [self.baseline(it.prompt_id) for it in self.items]
        n = len(scores) + 1
        below = sum(1 for s in scores if s < value)
        tied = sum(1 for s in scores if s == value) + 1
        q_hard, q_medium = self.tiers[0], self.tiers[0] + self.tiers[1]
        if tied == 1:
            rank = below / n
            return "hard" if rank < q_hard else "medium" if rank < q_medium else "easy"
        lo, hi = below / n, (below + tied) / n
        bounds = {"hard": (0.0, q_hard), "medium": (q_hard, q_medium), "easy": (q_medium, 1.0)}
        overlap = {t: max(0.0, min(hi, b) - max(lo, a)) for t, (a, b) in bounds.items()}

        candidates = [t for t in ("hard", "medium", "easy") if overlap[t] > 1e-12]
        have = {t: sum(1 for it in self.store[t] if self.baseline(it.prompt_id) == value) for t in candidates}
        deficit = {t: overlap[t] / (hi - lo) * tied - have[t] for t in candidates}
        return max(candidates, key=lambda t: (deficit[t], -candidates.index(t)))

    def add(self, prompt_id: str, sequences: list, reward: float) -> str:
        """Store one rollout (after :meth:`observe`); returns the tier it went to."""
        tier = self.tier_for(prompt_id)
        t = self.store[tier]
        t.append(ReplayItem(prompt_id=prompt_id, sequences=list(sequences), reward=float(reward)))
        value = self.baseline(prompt_id)
        while len(t) > self.tier_capacity[tier]:  # the oldest rollout at least as easy as the newcomer goes (else
            # the oldest): a newcomer never pushes out a harder rollout while an easier one is there to go
            at_least = [i for i, it in enumerate(t) if i < len(t) - 1 and self.baseline(it.prompt_id) >= value]
            del t[at_least[0] if at_least else 0]
        return tier

    def sample(self, k: int) -> list[ReplayItem]:
        """``k`` stored rollouts drawn 40/35/25 from the Hard/Medium/Easy tiers (fewer when the buffer is small)."""
        if not len(self) or k <= 0:
            return []
        want = [round(k * f) for f in self.tiers]
        want[0] += k - sum(want)
        out: list[ReplayItem] = []
        for name, n in zip(("hard", "medium", "easy"), want, strict=True):
            pool = list(self.store[name])
            out.extend(self._rng.sample(pool, min(n, len(pool))))
        rest = [x for x in self.items if all(x is not y for y in out)]
        while len(out) < k and rest:
            out.append(rest.pop(self._rng.randrange(len(rest))))
        return out

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> tuple[dict, dict]:
        """``(state, frames)``: the buffer with every frame replaced by its content key, and the frames by
        key. Checkpoints keep ``state``; the frames go once into a shared frame store, not into every
        checkpoint."""
        frames: dict[str, np.ndarray] = {}

        def strip(seq):
            keys = []
            for img in seq.images:
                key = _frame_key(img)
                frames.setdefault(key, np.asarray(img))
                keys.append(key)
            return {**seq.__dict__, "images": keys}

        store = {name: [{"prompt_id": it.prompt_id, "reward": it.reward, "sequences": [strip(s) for s in it.sequences]}
                        for it in t] for name, t in self.store.items()}
        state = {"store": store, "history": {k: list(v) for k, v in self.history.items()},
                 "rng": self._rng.getstate()}
        return state, frames

    def load_state_dict(self, state: dict, frames) -> None:
        """Restore from :meth:`state_dict`; ``frames`` maps a key to its frame (a dict or a callable)."""
        get = frames if callable(frames) else frames.__getitem__
        for name, items in state["store"].items():
            self.store[name] = deque(
                ReplayItem(prompt_id=it["prompt_id"],
                           sequences=[TokenSequence(**{**s, "images": [get(k) for k in s["images"]]})
                                      for s in it["sequences"]],
                           reward=it["reward"])
                for it in items)
        self.history = defaultdict(lambda: deque(maxlen=self.baseline_window))
        for k, v in state["history"].items():
            self.history[k].extend(v)
        self._rng.setstate(state["rng"])


def store_frames(frames: dict, folder: Path, rank: int = 0) -> None:
    """Write each frame once, by its content key (ranks may store the same frame: written aside, renamed)."""
    if not frames:
        return
    folder.mkdir(parents=True, exist_ok=True)
    for key, frame in frames.items():
        target = folder / f"{key}.npy"
        if not target.exists():
            part = folder / f"{key}.{rank}.part.npy"
            np.save(part, frame)
            part.replace(target)
