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
* Dual-clip (Ye et al., "Mastering complex control in MOBA games with deep RL", 2020; verl's ``clip_ratio_c``):
  for ``A < 0`` the loss ``-min(ρA, clip(ρ)A)`` grows with ρ without bound (PPO's clip only bounds ρ from the
  side that helps); it is capped at ``-c·A`` (c = 3 by default), so a token whose ratio exploded while its
  advantage is negative (a replayed or stale one) gives no gradient beyond that.
* The train–inference mismatch (:func:`rollout_correction`, Yao et al., "Your efficient RL framework secretly
  brings you off-policy RL training", 2025): the rollout engine's logprobs are not the trainer's (kernels, bf16,
  batch composition), so each sampled token carries the importance weight ``w = π_train / π_rollout`` (the
  trainer's logprob before the update over the engine's reported one). Truncated (TIS: ``min(w, C)``) or masked
  (tokens above ``C`` leave the loss and its denominator) as ms-swift's ``rollout_importance_sampling_mode`` does.
  The sequence modes weigh a whole sequence by its **geometric mean** ``exp(mean_t log w_t)`` (ms-swift's
  ``_compute_sequence_level_ratios``, GSPO's sequence ratio): a length-independent ratio, so bf16 noise of
  ~0.03 per token leaves it near 1 at any length. The product ``Π_t w_t`` (TRL's ``vllm_importance_sampling_mode``
  sequence modes) is the explicit ``sequence-product-*``: its log is a sum of T noisy terms, so it spreads as √T
  and rejects long turns for rounding alone (a third of 2,000-token turns at C = 2). :func:`mismatch_sums`
  measures the mismatch (KL k1 and k3, χ², PPL ratio).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "ROLLOUT_CORRECTIONS",
    "batch_normalised",
    "episode_advantages",
    "informative_group",
    "group_advantages",
    "kl_penalty",
    "mismatch_sums",
    "offpolicy_advantages",
    "policy_loss",
    "rollout_correction",
    "temporal_weights",
    "token_scales",
]


#: rewards closer than this are alike (a group of them has no advantage)
ALIKE = 1e-9
#: how a token's π_train / π_rollout weight enters the loss (:func:`rollout_correction`)
ROLLOUT_CORRECTIONS = ("off", "token-truncate", "token-mask", "sequence-truncate", "sequence-mask",
                       "sequence-product-truncate", "sequence-product-mask")
#: log-ratios are clamped here before exp (a token the engine gave ~0 probability must not overflow)
LOG_RATIO_CAP = 30.0


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


def batch_normalised(advantages: Sequence[float], tokens: Sequence[int], eps: float = 1e-6,
                     sums: tuple[float, float, float] | None = None) -> list[float]:
    """Batch-level advantage normalisation after the group's (the released ParaVT recipe: AReaL's ``adv_norm``
    with ``mean_level: batch, std_level: batch``): each sequence's advantage minus the mean over the batch's
    trained tokens, divided by their standard deviation (unbiased, AReaL's default). A sequence of n trained
    tokens counts n times, as AReaL normalises per token under the loss mask. ``sums`` = (Σ n·a, Σ n·a², Σ n)
    of the whole batch (every rank's); by default those of the given sequences."""
    if sums is None:
        sums = (sum(n * a for a, n in zip(advantages, tokens, strict=True)),
                sum(n * a * a for a, n in zip(advantages, tokens, strict=True)), float(sum(tokens)))
    s1, s2, n = sums
    if n < 2:
        return list(advantages)
    mean = s1 / n
    var = max(s2 - n * mean * mean, 0.0) / (n - 1)
    return [(a - mean) / (math.sqrt(var) + eps) for a in advantages]


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


def rollout_correction(log_ratio: torch.Tensor, mask: torch.Tensor, mode: str, threshold: float):
    """The train–inference mismatch correction of sampled tokens: ``log_ratio`` (B, T) is ``log π_train − log
    π_rollout`` (the trainer's logprob before the update minus the one the rollout engine reported), ``mask``
    the tokens it applies to. Returns ``(weights, rejected)``: the importance weight each token's policy term is
    multiplied by (1 off ``mask``; 0 where rejected), and the tokens that leave the loss (and its denominator).

    ``token-truncate`` (TIS): ``min(w, C)``. ``token-mask``: ``w``, tokens with ``w > C`` rejected.
    ``sequence-truncate``: every token of a sequence (a row) weighted by ``min(W, C)`` with ``W = exp(mean_t log
    w_t)``, the geometric mean of its token ratios over ``mask`` (ms-swift's ``rollout_importance_sampling_mode``,
    threshold C = 2 there); ``sequence-mask``: by ``W``, rows with ``W > C`` rejected whole.
    ``sequence-product-truncate`` / ``sequence-product-mask``: the same with ``W = Π_t w_t`` (TRL's sequence
    modes). Masks reject above C only, as AReaL's ``behav_imp_weight_cap`` does: a token kept with ``w < 1/C``
    already enters at its small weight. ``off``: weights 1, nothing rejected."""
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"unknown rollout correction {mode!r}; use one of {', '.join(ROLLOUT_CORRECTIONS)}")
    with torch.no_grad():
        valid = mask > 0
        lr = torch.where(valid, log_ratio.float(), torch.zeros_like(log_ratio, dtype=torch.float32))
        lr = lr.clamp(-LOG_RATIO_CAP, LOG_RATIO_CAP)
        ones = torch.ones_like(lr)
        if mode == "off":
            return ones, torch.zeros_like(valid)
        if mode.startswith("sequence"):
            seq = lr.sum(dim=1, keepdim=True)
            if not mode.startswith("sequence-product"):  # the geometric mean: the mean log-ratio of the row
                seq = seq / valid.sum(dim=1, keepdim=True).clamp(min=1)
            w = torch.exp(seq.clamp(-LOG_RATIO_CAP, LOG_RATIO_CAP).expand_as(lr))
        else:
            w = torch.exp(lr)
        if mode.endswith("truncate"):
            w, rejected = w.clamp(max=threshold), torch.zeros_like(valid)
        else:
            rejected = valid & (w > threshold)
            w = torch.where(rejected, torch.zeros_like(w), w)
        return torch.where(valid, w, ones), rejected


def mismatch_sums(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float,
                  rollout_logp: torch.Tensor | None = None) -> dict:
    """Sums (over ``mask``) that measure how far the rollout engine's distribution is from the trainer's on the
    sampled tokens, with ``r = log π_train − log π_rollout`` and ``w = e^r`` (tokens drawn from π_rollout):
    KL(π_rollout ‖ π_train) by ``k1 = −r`` and ``k3 = w − 1 − r`` (Schulman's estimators), χ²(π_train ‖ π_rollout)
    by ``w² − 1``, the tokens with ``w`` past ``threshold`` or below its inverse, per sequence (row) the PPL
    ratio ``PPL_train / PPL_rollout = exp(mean_t −r)``, and with ``rollout_logp`` the tokens' ``1 − p`` (how far
    from certain: logit rounding moves a logprob by at most 2·max|Δz|·(1 − p), so a bf16 mismatch scales with it).
    Means are the sums over ``n`` (tokens) or ``rows``."""
    with torch.no_grad():  # float64 and expm1: in float32, e^r − 1 − r of an r ~ 1e-7 is rounding noise
        valid = mask > 0
        m = valid.double()
        r = torch.where(valid, log_ratio.double(), torch.zeros_like(m)).clamp(-LOG_RATIO_CAP, LOG_RATIO_CAP)
        per_row = m.sum(dim=1)
        rows = per_row > 0
        log_c = math.log(threshold)
        row_log_ppl_ratio = (-r * m).sum(dim=1)[rows] / per_row[rows]
        return {"n": float(m.sum()), "k1": float((-r * m).sum()), "k3": float(((torch.expm1(r) - r) * m).sum()),
                "chi2": float((torch.expm1(2 * r) * m).sum()),
                "past": float((((r > log_c) | (r < -log_c)) & valid).sum()),
                "rows": float(rows.sum()), "ppl_ratio": float(torch.exp(row_log_ppl_ratio).sum()),
                "uncertainty": 0.0 if rollout_logp is None else float(
                    (-torch.expm1(rollout_logp.double().clamp(max=0.0)) * m).sum()),
                "abs_max": float(r[valid].abs().max()) if bool(valid.any()) else 0.0}


@dataclass
class LossOut:
    loss: torch.Tensor
    clip_fraction: float
    kl: float
    ratio_mean: float
    ratio_dev: float = 0.0  # the largest |ratio - 1| on trained tokens: 0 when the clip cannot act
    dual_clip_fraction: float = 0.0  # trained tokens with A < 0 whose ratio is past the dual-clip cap c


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
    dual_clip: float | None = None,
) -> LossOut:
    """Clipped GRPO loss over a padded batch: ``Σ_seq scale_seq · Σ_t mask · per-token loss``.

    Shapes: ``logp``, ``old_logp``, ``mask``, ``ref_logp``, ``token_weights`` are (B, T); ``advantages``,
    ``scales`` and ``sample_weights`` are (B,). ``scales`` come from :func:`token_scales` (default: each
    row its own episode, ``seq-mean``). ``token_weights`` multiply the advantage per token (Temporal
    Advantage Shaping); ``sample_weights`` scale whole sequences (replayed samples: α). The ratio is
    clipped to [1 - clip, 1 + clip_high] (``clip_high`` None: symmetric); ``dual_clip`` c > 1 caps the loss of a
    token with A < 0 at ``-c·A`` (dual-clip PPO; None: off).
    """
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must exceed 1 (got {dual_clip}): it caps the ratio of negative advantages")
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
    if dual_clip is not None:  # A < 0: the loss -ρA grows with ρ unbounded; capped at -c·A
        per_token = torch.where(adv < 0, torch.minimum(per_token, -dual_clip * adv), per_token)
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
        dual = 0.0
        if dual_clip is not None:
            dual = float((((ratio > dual_clip) & (adv < 0)).float() * mask).sum() / mask.sum().clamp(min=1))
    return LossOut(loss, clipped_frac, kl_val, ratio_mean, ratio_dev, dual)
