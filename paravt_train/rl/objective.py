"""The GRPO objective of PARA-GRPO, as pure functions on tensors, and AVATAR's replay buffer.

Simplifications and choices, stated up front (nanochat style):

* Advantages are group-normalised rewards: ``A_i = (r_i - mean(r)) / (std(r) + eps)``
  over the G rollouts of one prompt (``scale="none"`` keeps ``r_i - mean``: Dr. GRPO).
  Every token of a rollout — the planner's turns and, by default, its
  sub-agents' summaries — shares the episode's advantage. Multi-agent RL (the
  collaborative mode's cpp protocol) splits a rollout into one episode per agent,
  each normalised over the group's rollouts apart: every agent's turns train with
  its own advantage.
* The policy term is PPO's clipped ratio ``min(ρA, clip(ρ, 1-ε_low, 1+ε_high)A)`` with
  ``ρ = exp(logp - logp_old)``; ``ε_high > ε_low`` is DAPO's clip-higher. On-policy
  (one update per batch) ``ρ = 1`` and this is the plain policy gradient.
* KL to a frozen reference, per token, estimator ``k1`` (``logp - logp_ref``),
  ``k2`` (½(logp - logp_ref)²) or ``k3`` (Schulman's unbiased ``exp(r) - r - 1``
  with ``r = logp_ref - logp``), coefficient 0.01.
* Aggregation weighs *episodes*, not sequences (an episode is one rollout: its
  planner sequence and its sub-agent sequences): ``seq-mean`` (GRPO) averages each
  episode's trained tokens, then the episodes, so an episode with K tool calls
  weighs the same as one without; ``token-mean`` (DAPO) averages every trained token
  of the batch; ``constant`` (Dr. GRPO) sums each episode's tokens, divides by a
  fixed normaliser (max new tokens) and averages the episodes. :func:`token_scales`
  turns this into one scale per sequence, so a batch may hold any mix of sequences.
* AVATAR options: Temporal Advantage Shaping weights the advantage of token t of
  an L-token sequence by ``w_t = 1 + λ(2t/(L-1) - 1)²`` (λ = 0 is plain GRPO), and
  a stratified replay buffer (:class:`ReplayBuffer`) whose samples enter with an
  importance ratio from stored behaviour logprobs, weighted by α, with the
  off-policy advantage of AVATAR Eq. 11 (the buffer: :mod:`paravt_train.rl.replay`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "episode_advantages",
    "informative_group",
    "group_advantages",
    "kl_penalty",
    "offpolicy_advantages",
    "policy_loss",
    "temporal_weights",
    "token_scales",
]


#: rewards closer than this are alike (a group of them has no advantage)
ALIKE = 1e-9


def group_advantages(rewards: torch.Tensor, group: int, eps: float = 1e-6, scale: str = "std") -> torch.Tensor:
    """``rewards`` of shape (P·G,), grouped consecutively per prompt → advantages of the same shape."""
    if scale not in ("std", "none"):
        raise ValueError(f"unknown advantage scale {scale!r}; use std or none")
    # float64, and exactly 0 where a group's rewards are alike: in float32 the mean of eight rewards of 1.45 is
    # off by ~1e-7, which divided by the std's eps gave every rollout of such a group an advantage of 0.11
    r = rewards.view(-1, group).double()
    centred = r - r.mean(dim=1, keepdim=True)
    if scale == "std":
        centred = centred / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    alike = (r.amax(dim=1, keepdim=True) - r.amin(dim=1, keepdim=True)) <= ALIKE
    return torch.where(alike, torch.zeros_like(centred), centred).float().reshape(-1)


def episode_advantages(group: list, keep_failed: bool = False, scale: str = "std", eps: float = 1e-6) -> list:
    """Group-normalised advantages (set on each episode) over a group's usable episodes: failed ones are dropped
    unless ``keep_failed``; fewer than two usable ones train nothing. Returns the episodes that train.

    Multi-agent RL (episodes with an ``agent``: the collaborative mode's cpp protocol): each agent's episodes are
    normalised apart, over the group's rollouts, so every agent's turns train with its own advantage."""
    agents = list(dict.fromkeys(getattr(e, "agent", None) for e in group))
    return [e for a in agents for e in _normalise([x for x in group if getattr(x, "agent", None) == a], keep_failed,
                                                  scale, eps)]


def _normalise(group: list, keep_failed: bool, scale: str, eps: float) -> list:
    usable = [e for e in group if e.failed is None or keep_failed]
    if len(usable) < 2:
        return []
    r = torch.tensor([e.reward.total for e in usable], dtype=torch.float64)
    centred = r - r.mean()
    if scale == "std":
        centred = centred / (r.std(unbiased=False) + eps)
    if float(r.max() - r.min()) <= ALIKE:  # a group whose rewards are alike teaches nothing: exactly 0
        centred = torch.zeros_like(centred)
    for e, a in zip(usable, centred.tolist(), strict=True):
        e.advantage = a
    return usable


def informative_group(group: list, keep_failed: bool = False) -> bool:
    """Whether a group trains something (DAPO's dynamic sampling keeps these): two or more usable episodes whose
    rewards differ."""
    usable = [e for e in group if e.failed is None or keep_failed]
    return len(usable) > 1 and len({round(e.reward.total, 9) for e in usable}) > 1


def offpolicy_advantages(rewards: Sequence[float], baselines: Sequence[float], eps: float = 1e-6,
                         sigma: float | None = None, min_std: float = 0.0, clip: float | None = None) -> list[float]:
    """AVATAR Eq. 11: ``A_off = (R(o) - R̄(q)) / σ_R,off``, with ``R̄(q)`` the prompt's moving-average reward
    (VCRS) and ``σ_R,off`` the spread of rewards the replayed rollouts are judged against (``sigma``: the trainer
    passes the standard deviation over this step's off-policy draws and on-policy rollouts together, every rank's;
    else these rewards'). σ is floored at ``min_std`` and ``|A|`` clipped at ``clip``: Eq. 11 normalises a
    difference from a moving average by the spread of a handful of draws, which can be ~0 (one draw, or draws of
    equal reward such as every well-formed wrong MCQ) — without the bounds a replayed draw's advantage reaches
    10 or 1e5 while an on-policy group of G gives at most √(G−1)."""
    if not rewards:
        return []
    if sigma is None:
        r = torch.tensor(list(rewards), dtype=torch.float64)
        sigma = float(r.std(unbiased=False)) if len(r) > 1 else 0.0
    scale = max(sigma, min_std) + eps
    out = [(x - b) / scale for x, b in zip(rewards, baselines, strict=True)]
    return out if clip is None else [max(-clip, min(clip, a)) for a in out]


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


def token_scales(episodes: Sequence, tokens: Sequence[int], how: str, constant: float | None = None,
                 totals: tuple[int, float] | None = None) -> list[float]:
    """The per-token loss scale of each sequence, so that ``Σ scale · per-token loss`` is the aggregated loss.

    ``episodes[i]`` names the episode of sequence i, ``tokens[i]`` its trained tokens. ``totals`` =
    (episodes, trained tokens) of the *global* batch (all micro-batches, all ranks); by default those of
    the given sequences. ``seq-mean``: 1 / (tokens of the episode × episodes); ``token-mean``: 1 / tokens;
    ``constant``: 1 / (constant × episodes).
    """
    per_episode: dict = defaultdict(int)
    for e, n in zip(episodes, tokens, strict=True):
        per_episode[e] += n
    n_ep, n_tok = totals if totals is not None else (len(per_episode), float(sum(tokens)))
    n_ep, n_tok = max(n_ep, 1), max(n_tok, 1.0)
    if how == "seq-mean":
        return [1.0 / (max(per_episode[e], 1) * n_ep) for e in episodes]
    if how == "token-mean":
        return [1.0 / n_tok for _ in episodes]
    if how == "constant":
        if not constant:
            raise ValueError("constant aggregation needs a normaliser (e.g. max new tokens)")
        return [1.0 / (constant * n_ep) for _ in episodes]
    raise ValueError(f"unknown aggregation {how!r}; use seq-mean, token-mean or constant")


@dataclass
class LossOut:
    loss: torch.Tensor
    clip_fraction: float
    kl: float
    ratio_mean: float
    ratio_dev: float = 0.0  # the largest |ratio - 1| on trained tokens: 0 when the clip cannot act


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: float = 0.2,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.01,
    kl_estimator: str = "k3",
    scales: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    sample_weights: torch.Tensor | None = None,
    clip_high: float | None = None,
) -> LossOut:
    """Clipped GRPO loss over a padded batch: ``Σ_seq scale_seq · Σ_t mask · per-token loss``.

    Shapes: ``logp``, ``old_logp``, ``mask``, ``ref_logp``, ``token_weights`` are (B, T); ``advantages``,
    ``scales`` and ``sample_weights`` are (B,). ``scales`` come from :func:`token_scales` (default: each
    row its own episode, ``seq-mean``). ``token_weights`` multiply the advantage per token (Temporal
    Advantage Shaping); ``sample_weights`` scale whole sequences (replayed samples: α). The ratio is
    clipped to [1 - clip, 1 + clip_high] (``clip_high`` None: symmetric).
    """
    mask = mask.float()
    if scales is None:
        scales = torch.tensor(token_scales(list(range(len(mask))), [int(m.sum()) for m in mask], "seq-mean"),
                              dtype=torch.float32, device=logp.device)
    adv = advantages[:, None].float()
    if token_weights is not None:
        adv = adv * token_weights
    high = clip if clip_high is None else clip_high
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip, 1 + high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    kl_val = 0.0
    if ref_logp is not None and kl_coef:
        kl = kl_penalty(logp, ref_logp, kl_estimator)
        per_token = per_token + kl_coef * kl
        kl_val = float((kl.detach() * mask).sum() / mask.sum().clamp(min=1))
    row = scales.to(per_token.dtype)
    if sample_weights is not None:
        row = row * sample_weights.to(per_token.dtype)
    loss = (per_token * mask * row[:, None]).sum()
    with torch.no_grad():
        active = ((ratio < 1 - clip) & (adv < 0)) | ((ratio > 1 + high) & (adv > 0))
        clipped_frac = float((active.float() * mask).sum() / mask.sum().clamp(min=1))
        ratio_mean = float((ratio * mask).sum() / mask.sum().clamp(min=1))
        ratio_dev = float(((ratio - 1).abs() * mask).max()) if bool(mask.any()) else 0.0
    return LossOut(loss, clipped_frac, kl_val, ratio_mean, ratio_dev)
