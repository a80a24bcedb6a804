"""How one step chooses what it trains on, beside the objective: the prompts of a step
(:func:`step_prompts`: an epoch-shuffled order every rank and a resumed run agree on), DAPO's dynamic sampling
(:func:`sample_groups`: groups that would train nothing replaced by groups of further prompts), and AVATAR's
replayed rollouts (:func:`replay_batch`: drawn from the buffer, Eq. 11 advantages, then this step's episodes go
in)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from paravt_train.infra.distributed import data_order
from paravt_train.rl.objective import informative_group, offpolicy_advantages
from paravt_train.rl.replay import ReplayBuffer
from paravt_train.rl.rollout import PromptItem
from paravt_train.rl.update import UpdateItem

__all__ = ["replay_batch", "sample_groups", "step_prompts"]


def step_prompts(prompts: list[PromptItem], step: int, per_step: int, seed: int, rank: int = 0,
                 world: int = 1) -> list[PromptItem]:
    """The prompts of ``step``: an epoch-shuffled order (a function of the seed and the epoch only, so a
    resumed run and every rank agree), ``per_step`` at a time, ranks interleaved (this rank's share)."""
    out = []
    for j in range(step * per_step, (step + 1) * per_step):
        epoch, pos = divmod(j, len(prompts))
        out.append(prompts[data_order(len(prompts), seed, epoch)[pos]])
    return out[rank::world] if world > 1 else out


def sample_groups(rollout, prompts: list[PromptItem], pool: list[PromptItem] | None, rounds: int,
                  keep_failed: bool, rng) -> tuple[list, list]:
    """The step's groups and every group rolled out (for the zero-variance count). With a ``pool`` (DAPO's
    dynamic sampling), groups that would train nothing are replaced by groups of further prompts drawn from it,
    for up to ``rounds`` rounds. ``rollout(prompts, salt=round)`` rolls groups out."""
    groups = rollout(prompts)
    all_groups = list(groups)
    if not pool:
        return groups, all_groups
    for rnd in range(1, rounds + 1):
        informative = [g for g in groups if informative_group(g, keep_failed)]
        need = len(prompts) - len(informative)
        if need <= 0:
            break
        more = rollout(rng.sample(pool, min(need, len(pool))), salt=rnd)
        all_groups.extend(more)
        groups = informative + more
    return [g for g in groups if informative_group(g, keep_failed)][: len(prompts)] or groups, all_groups


def replay_batch(buffer: ReplayBuffer, cfg, groups, world: int = 1) -> tuple[list, int]:
    """This step's replayed update items (``cfg.replay.per_step`` drawn rollouts: Eq. 11 advantage, weight α,
    ratio against their behaviour logprobs) and how many rollouts were drawn; then this step's finished
    episodes go into the buffer. Every rank calls it (σ is gathered)."""
    r = cfg.replay
    drawn = buffer.sample(r.per_step) if r.per_step else []
    rewards = [it.reward for it in drawn]
    # σ_R,off: the spread of this step's rewards, off-policy draws and on-policy rollouts together, every rank's
    # (the draws alone are often a handful of equal rewards); |A| then stays on the on-policy scale
    spread = rewards + [e.reward.total for g in groups for e in g if e.failed is None]
    everyone = spread
    if world > 1:
        shards: list = [None] * world
        dist.all_gather_object(shards, spread)
        everyone = [x for shard in shards for x in shard]
    sigma = float(torch.tensor(everyone, dtype=torch.float64).std(unbiased=False)) if len(everyone) > 1 else 0.0
    clip = r.max_advantage if r.max_advantage is not None else (cfg.group_size - 1) ** 0.5
    advs = offpolicy_advantages(rewards, [buffer.baseline(it.prompt_id) for it in drawn], sigma=sigma,
                                min_std=r.min_std, clip=clip)
    items = [UpdateItem(sequence=s, advantage=a, weight=r.alpha, off_policy=True)
             for it, a in zip(drawn, advs, strict=True) for s in it.sequences]
    for g in groups:
        for e in g:
            if e.failed is None:
                buffer.observe(e.prompt_id, e.reward.total)
                buffer.add(e.prompt_id, e.sequences, e.reward.total)
    return items, len(drawn)
