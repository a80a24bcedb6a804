"""The GRPO objective of PARA-GRPO, as pure functions on tensors.

Simplifications and choices, stated up front (nanochat style):

* Advantages are group-normalised rewards: ``A_i = (r_i - mean(r)) / (std(r) + eps)``
  over the G rollouts of one prompt (``scale="none"`` keeps ``r_i - mean``: Dr. GRPO).
  Every token of a rollout — the planner's turns and, by default, its
  sub-agents' summaries — shares the episode's advantage.
* The policy term is PPO's clipped ratio ``min(ρA, clip(ρ, 1-ε, 1+ε)A)`` with
  ``ρ = exp(logp - logp_old)``; on-policy (one update per batch) ``ρ = 1`` and
  this is the plain policy gradient.
* KL to a frozen reference, per token, estimator ``k1`` (``logp - logp_ref``),
  ``k2`` (½(logp - logp_ref)²) or ``k3`` (Schulman's unbiased ``exp(r) - r - 1``
  with ``r = logp_ref - logp``), coefficient 0.01.
* Token aggregation: ``seq-mean`` (GRPO: mean over each sequence's tokens, then
  over sequences), ``token-mean`` (DAPO: over all tokens of the batch) or
  ``constant`` (Dr. GRPO: sum divided by a fixed normaliser, e.g. max tokens).
* AVATAR options: Temporal Advantage Shaping weights the advantage of token t of
  an L-token sequence by ``w_t = 1 + λ(2t/(L-1) - 1)²`` (λ = 0 is plain GRPO), and
  a stratified replay buffer (:class:`ReplayBuffer`) whose samples enter with an
  importance ratio from stored behaviour logprobs, weighted by α.
"""

from __future__ import annotations

import random
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "ReplayBuffer",
    "group_advantages",
    "kl_penalty",
    "policy_loss",
    "temporal_weights",
]


def group_advantages(rewards: torch.Tensor, group: int, eps: float = 1e-6, scale: str = "std") -> torch.Tensor:
    """``rewards`` of shape (P·G,), grouped consecutively per prompt → advantages of the same shape."""
    r = rewards.view(-1, group).float()
    centred = r - r.mean(dim=1, keepdim=True)
    if scale == "std":
        centred = centred / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    elif scale != "none":
        raise ValueError(f"unknown advantage scale {scale!r}; use std or none")
    return centred.reshape(-1)


def temporal_weights(lengths: Sequence[int], lam: float) -> list[torch.Tensor]:
    """AVATAR's Temporal Advantage Shaping: ``w_t = 1 + λ(2t/(L-1) - 1)²`` per sequence (λ = 0: all ones)."""
    out = []
    for L in lengths:
        if L <= 1 or lam == 0:
            out.append(torch.ones(max(L, 0)))
            continue
        t = torch.arange(L, dtype=torch.float32)
        out.append(1 + lam * (2 * t / (L - 1) - 1) ** 2)
    return out


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(π || π_ref) estimate."""
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k2":
        return 0.5 * (logp - ref_logp) ** 2
    if estimator == "k3":
        r = ref_logp - logp
        return torch.exp(r) - r - 1
    raise ValueError(f"unknown KL estimator {estimator!r}; use k1, k2 or k3")


@dataclass
class LossOut:
    loss: torch.Tensor
    clip_fraction: float
    kl: float
    ratio_mean: float


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, how: str, constant: float | None) -> torch.Tensor:
    if how == "seq-mean":
        per_seq = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)
        return per_seq.mean()
    if how == "token-mean":
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    if how == "constant":
        if not constant:
            raise ValueError("constant aggregation needs a normaliser (e.g. max new tokens)")
        return (per_token * mask).sum() / (constant * per_token.shape[0])
    raise ValueError(f"unknown aggregation {how!r}; use seq-mean, token-mean or constant")


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: float = 0.2,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.01,
    kl_estimator: str = "k3",
    aggregation: str = "seq-mean",
    constant: float | None = None,
    token_weights: torch.Tensor | None = None,
    sample_weights: torch.Tensor | None = None,
) -> LossOut:
    """Clipped GRPO loss over a padded batch.

    Shapes: ``logp``, ``old_logp``, ``mask``, ``ref_logp``, ``token_weights`` are (B, T);
    ``advantages`` and ``sample_weights`` are (B,). ``mask`` marks trained tokens.
    ``token_weights`` multiply the advantage per token (Temporal Advantage Shaping);
    ``sample_weights`` scale whole sequences (replayed samples: α).
    """
    mask = mask.float()
    adv = advantages[:, None].float()
    if token_weights is not None:
        adv = adv * token_weights
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip, 1 + clip) * adv
    per_token = -torch.minimum(unclipped, clipped)
    kl_val = 0.0
    if ref_logp is not None and kl_coef:
        kl = kl_penalty(logp, ref_logp, kl_estimator)
        per_token = per_token + kl_coef * kl
        kl_val = float((kl.detach() * mask).sum() / mask.sum().clamp(min=1))
    if sample_weights is not None:
        per_token = per_token * sample_weights[:, None]
    loss = _aggregate(per_token, mask, aggregation, constant)
    with torch.no_grad():
        clipped_frac = float((((ratio - 1).abs() > clip).float() * mask).sum() / mask.sum().clamp(min=1))
        ratio_mean = float((ratio * mask).sum() / mask.sum().clamp(min=1))
    return LossOut(loss, clipped_frac, kl_val, ratio_mean)


# --------------------------------------------------------------------------- AVATAR replay


@dataclass
class ReplayBuffer:
    """AVATAR's stratified replay buffer.

    Prompts are tiered Hard / Medium / Easy by their moving-average reward
    (quantiles of the buffer's prompts); a replay draw takes 40 / 35 / 25 % from
    the tiers. Each prompt keeps a baseline from its last ``baseline_window``
    rewards. Samples store their behaviour logprobs, so replayed sequences enter
    the loss with a proper importance ratio; their term is weighted by ``alpha``.
    """

    capacity: int = 512
    tiers: tuple[float, float, float] = (0.40, 0.35, 0.25)
    alpha: float = 0.6
    baseline_window: int = 20
    seed: int = 0
    items: deque = field(default_factory=deque)
    history: dict = field(default_factory=lambda: defaultdict(lambda: deque(maxlen=20)))

    def __post_init__(self):
        self._rng = random.Random(self.seed)
        self.history = defaultdict(lambda: deque(maxlen=self.baseline_window))

    def __len__(self) -> int:
        return len(self.items)

    def add(self, prompt_id: str, sample, reward: float) -> None:
        self.history[prompt_id].append(float(reward))
        self.items.append((prompt_id, sample, float(reward)))
        while len(self.items) > self.capacity:
            self.items.popleft()

    def baseline(self, prompt_id: str) -> float:
        h = self.history.get(prompt_id)
        return sum(h) / len(h) if h else 0.0

    def tier_of(self) -> dict[str, str]:
        prompts = sorted({p for p, _, _ in self.items}, key=self.baseline)
        n = len(prompts)
        out = {}
        for i, p in enumerate(prompts):
            q = (i + 0.5) / n
            out[p] = "hard" if q < 1 / 3 else "medium" if q < 2 / 3 else "easy"
        return out

    def sample(self, k: int) -> list:
        """``k`` stored samples drawn 40/35/25 from the Hard/Medium/Easy tiers (fewer when the buffer is small)."""
        if not self.items or k <= 0:
            return []
        tiers = self.tier_of()
        pools = {"hard": [], "medium": [], "easy": []}
        for p, s, r in self.items:
            pools[tiers[p]].append((p, s, r))
        want = [round(k * f) for f in self.tiers]
        want[0] += k - sum(want)
        out = []
        for pool, n in zip(pools.values(), want, strict=True):
            out.extend(self._rng.sample(pool, min(n, len(pool))))
        rest = [x for x in self.items if x not in out]
        while len(out) < k and rest:
            out.append(rest.pop(self._rng.randrange(len(rest))))
        return out
