"""The policy update of one GRPO step: sequences → padded micro-batches → clipped-ratio loss → optimizer steps.

The objective itself is :func:`paravt_train.rl.objective.policy_loss` (pure tensors); this module feeds it:

* **Micro-batches.** Items (one token sequence each, with its advantage) are sorted longest first and cut into
  ``micro_batch_size`` rows. Under FSDP every forward/backward is a collective, so every rank runs the same
  number of passes: a rank with fewer micro-batches repeats its last one at weight 0, and a rank with none
  runs a placeholder. A micro-batch without images gets a 1-token dummy image on multi-rank runs
  (:func:`paravt_train.infra.distributed.with_dummy_image`), so the vision tower's collectives run in the same
  order on every rank.
* **Normalisation.** An episode's trained tokens count as a whole even when its sequences fall in different
  micro-batches or on different ranks: the per-episode token counts and the episode count are global
  (:func:`paravt_train.rl.objective.token_scales`). FSDP averages gradients over ranks, so each rank's share of the
  global loss is multiplied by the world size.
* **Ratios.** On-policy samples take the ratio against this model before the update (recomputed here: the
  first pass starts at ratio 1); replayed samples against their stored behaviour logprobs.
* **The behaviour weight** ``w = π_prox / π_behav`` of every on-policy token (π_prox: this model before the
  update; π_behav: the logprobs the rollout engine reported), one quantity for two causes. Rollouts of the current
  weights differ only by the train–inference mismatch (kernels, bf16, batch composition): ``rollout_correction``
  truncates or masks it (:func:`paravt_train.rl.objective.rollout_correction`). Rollouts of an older version
  (``sync.every`` > 1, or a row sampled behind the update with ``max_staleness`` η > 0; under η > 0 a row whose
  versions the server did not report counts as older): decoupled PPO (AReaL), tokens over ``behaviour_weight_cap``
  left out (:func:`behaviour_weights`). A token left out leaves the loss's denominator too
  (its episode's token count, the batch's). The mismatch itself is measured on every on-policy token, corrected
  or not (``mismatch/*``, ``logprob_mismatch``: ~0 when rollouts came from these exact weights in float32).
* **Epochs and mini-batches.** ``ppo_epochs`` passes over the batch, each split into ``mini_batches``
  optimizer steps (verl's PPO mini-batches; 1 × 1 is one step on the whole batch, where the ratio stays 1
  and the clip never acts). Items go to mini-batches by a shuffle seeded by the run's seed and the step
  (:func:`mini_batch_assignment`: the same on every rank and on a resumed run, another each step), never by
  length; inside a mini-batch they are sorted longest first and cut into micro-batches (little padding). Each
  mini-batch's loss is scaled by ``mini_batches`` so a step has the size of a whole-batch step; ``grad_norm`` is
  the mean over the optimizer steps, ``grad_norm_max`` the largest.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, replace

import torch

from paravt_agent.policy.chat import ChatTokenizer
from paravt_train.infra.distributed import (
    all_reduce_max,
    all_reduce_sum,
    clip_grad_norm,
    with_dummy_image,
    world_scale,
)
from paravt_train.rl.metrics import mismatch_means, weight_sketch
from paravt_train.rl.objective import (
    batch_normalised,
    mismatch_sums,
    policy_loss,
    rollout_correction,
    temporal_weights,
    token_scales,
)
from paravt_train.rl.rollout import TokenSequence
from paravt_train.rl.scoring import collate, token_logprobs

__all__ = ["MicroBatch", "PolicyUpdate", "UpdateItem", "behaviour_weights", "mini_batch_assignment",
           "sampled_by_older"]

@dataclass(kw_only=True)  # built by keyword (tests/test_architecture.py)
class UpdateItem:
    """What the update consumes: one sequence, its advantage, its weight (α for replayed rollouts) and
    whether its ratio is taken against the stored behaviour logprobs (off-policy) or against this policy
    before the update (on-policy)."""

    sequence: TokenSequence
    advantage: float
    weight: float = 1.0
    off_policy: bool = False
    #: sampled by another policy version than the one being updated (a server the trainer has not pushed to since:
    #: ``sync.every`` > 1, or η > 0): decoupled PPO's behaviour weight corrects it (on-policy items only)
    stale: bool = False


def sampled_by_older(versions: list[int], step: int, max_staleness: int) -> bool:
    """Whether an episode's tokens came (partly) from another policy version than ``step``, the one being updated:
    a version the server reported that is not ``step``, or, with η = ``max_staleness`` > 0, no version reported at
    all (the asynchronous loop bounds how old a row is; it cannot tell it is current)."""
    if not versions:
        return max_staleness > 0
    return any(v != step for v in versions)


def behaviour_weights(prox_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, cap: float):
    """Decoupled PPO (Hilton et al., "Batch size-invariance for policy optimization"; AReaL's asynchronous loss,
    ``ppo_actor_loss_fn`` with ``behav_imp_weight_cap``): the ratio is taken to the proximal policy π_prox
    (this model at the start of the update) and each token is weighted by π_prox / π_behav, the policy that
    sampled it (the server's recorded logprobs, whatever version produced the token). Tokens whose weight
    exceeds ``cap`` are left out (weight 0), as AReaL filters them. Returns the weights (1 off ``mask``) and
    their statistics (sums over ``mask``)."""
    with torch.no_grad():
        # the rollout correction's token-mask at the cap: one rule for both causes of π_prox ≠ π_behav
        kept, capped = rollout_correction(prox_logp - behaviour_logp, mask, "token-mask", cap)
        valid = mask > 0
        w = torch.exp((prox_logp - behaviour_logp).float().clamp(max=30.0))
        stats = {"sum": float((kept * valid).sum()), "n": float(valid.sum()), "capped": float(capped.sum()),
                 "max": float(w[valid].max()) if bool(valid.any()) else 0.0,
                 "values": w[valid].float().cpu()}  # every token's weight (capped ones too): the quantiles
        return kept, stats


def mini_batch_assignment(n_items: int, n_mini: int, seed: int, step: int) -> list[int]:
    """The mini-batch of each of ``n_items`` items: a shuffle seeded by the run's ``seed`` and the ``step`` (the
    same on every rank and on a resumed run; another order each step), dealt into ``n_mini`` mini-batches of
    equal size (±1). Not by length: in GRPO length correlates with the advantage's sign, and the first
    mini-batch of a step trains at ratio 1, where the clip cannot act."""
    if n_mini <= 1:
        return [0] * n_items
    order = list(range(n_items))
    random.Random(f"paravt-minibatch:{seed}:{step}").shuffle(order)
    out = [0] * n_items
    for k, i in enumerate(order):
        out[i] = k * n_mini // n_items
    return out


@dataclass
class MicroBatch:
    """One forward/backward pass: the model's inputs and what the loss needs per row and per token."""

    tensors: dict  # input_ids, attention_mask, loss_mask, behaviour_logp (+ mm_token_type_ids, pixels)
    advantages: torch.Tensor  # (B,)
    weights: torch.Tensor  # (B,) α for replayed rows, 1 otherwise
    scales: torch.Tensor  # (B,) each row's share of its episode's normaliser
    old_logp: torch.Tensor  # (B, T-1) the ratio's denominator
    token_weights: torch.Tensor | None = None  # (B, T-1) Temporal Advantage Shaping
    ref_logp: torch.Tensor | None = None  # (B, T-1) the frozen reference (KL)
    mismatch: tuple[float, float] = (0.0, 0.0)  # Σ|recomputed - behaviour| and the count, on-policy tokens
    behaviour: dict | None = None  # decoupled PPO: the behaviour weights' statistics (sums and counts)
    dummy: bool = False  # a repeat at weight 0: this rank has fewer micro-batches than the busiest
    mini: int = 0  # the mini-batch (optimizer step) it belongs to
    episodes: list | None = None  # each row's episode id
    rejected: list | None = None  # each row's tokens left out by the behaviour weight (rollout correction, cap)
    correction: dict | None = None  # mismatch_sums of the on-policy tokens, and the corrected tokens' counts

    @property
    def mask(self) -> torch.Tensor:
        return self.tensors["loss_mask"][:, 1:]


class PolicyUpdate:
    """``PolicyUpdate(...)(items) -> stats``: the optimizer steps of one GRPO step on this rank's items."""

    def __init__(self, model, optimizer, scheduler, params, chat: ChatTokenizer, cfg, device, world: int,
                 ref=None, autocast_dtype=None, eos_id: int | None = None, log=print):
        self.model, self.optimizer, self.scheduler, self.params = model, optimizer, scheduler, params
        self.chat, self.cfg, self.device, self.world, self.ref = chat, cfg, device, world, ref
        self.autocast_dtype = autocast_dtype
        self.eos_id = chat.eos_id if eos_id is None else eos_id
        self.log = log
        self._said_capped = False  # mini_batches capped by the items: said once

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    # ------------------------------------------------------------------ planning

    def _gather_episodes(self, per_episode: dict[str, list[int]]) -> dict[str, list[int]]:
        """Per episode, [trained tokens, tokens left out] summed over every rank (an episode's sequences may be
        split over micro-batches and ranks)."""
        if self.world > 1:
            import torch.distributed as dist

            shards: list = [None] * self.world
            dist.all_gather_object(shards, per_episode)
            per_episode = {}
            for shard in shards:
                for e, (n, out) in shard.items():
                    have = per_episode.setdefault(e, [0, 0])
                    have[0], have[1] = have[0] + n, have[1] + out
        return per_episode

    def _batch_normalised(self, items: list[UpdateItem]) -> list[UpdateItem]:
        """``advantage_batch_norm``: advantages normalised over every rank's trained tokens
        (:func:`paravt_train.rl.objective.batch_normalised`)."""
        adv = [it.advantage for it in items]
        tok = [it.sequence.n_trained for it in items]
        sums = all_reduce_sum([sum(a * n for a, n in zip(adv, tok, strict=True)),
                               sum(a * a * n for a, n in zip(adv, tok, strict=True)), float(sum(tok))])
        new = batch_normalised(adv, tok, self.cfg.advantage_eps, sums=(sums[0], sums[1], sums[2]))
        return [replace(it, advantage=a) for it, a in zip(items, new, strict=True)]

    def _prepare(self, chunk: list[UpdateItem], dummy: bool) -> MicroBatch:
        cfg, dev = self.cfg, self.device
        t = collate([c.sequence for c in chunk], self.chat)
        if self.world > 1 and "pixel_values" not in t:
            t = with_dummy_image(t, self.chat)
        t = {k: v.to(dev) for k, v in t.items()}
        mb = MicroBatch(
            tensors=t,
            advantages=torch.tensor([c.advantage for c in chunk], dtype=torch.float32, device=dev),
            weights=torch.tensor([c.weight for c in chunk], dtype=torch.float32, device=dev),
            scales=torch.zeros(len(chunk), dtype=torch.float32, device=dev),  # set once every rank is planned
            old_logp=torch.zeros(0), dummy=dummy, episodes=[c.sequence.episode for c in chunk])
        mask = mb.mask
        if cfg.tas_lambda:
            tw = torch.ones_like(mask)
            for i, w in enumerate(temporal_weights([int(m.sum()) for m in mask], cfg.tas_lambda)):
                tw[i, mask[i] > 0] = w.to(tw.device)
            mb.token_weights = tw
        with torch.no_grad(), self.autocast():
            if self.ref is not None:
                mb.ref_logp, _ = token_logprobs(self.ref, t, cfg.temperature)
            elif cfg.kl_coef > 0 and hasattr(self.model, "disable_adapter"):  # LoRA: the reference is the base
                with self.model.disable_adapter():
                    mb.ref_logp, _ = token_logprobs(self.model, t, cfg.temperature)
            recomputed, _ = token_logprobs(self.model, t, cfg.temperature)
        behaviour = t["behaviour_logp"][:, 1:]
        off = torch.tensor([c.off_policy for c in chunk], device=dev)[:, None]
        # on-policy samples: the update starts at ratio 1 (old = this model before the update: π_prox);
        # replayed samples: importance ratio against the stored behaviour logprobs
        mb.old_logp = torch.where(off, behaviour, recomputed)
        on = (~off).float() * mask
        mb.mismatch = (float(((recomputed - behaviour).abs() * on).sum()), float(on.sum()))
        log_ratio = recomputed - behaviour  # log π_prox / π_behav
        mb.correction = mismatch_sums(log_ratio, on, cfg.rollout_correction_threshold, behaviour)
        # decoupled PPO (AReaL): the rows another policy version sampled (``stale``: the versions the server reported
        # differ from the one being updated, or are unknown under η > 0) are weighted π_prox / π_behav; rows of these
        # very weights keep the configured rollout correction (the train–inference mismatch alone)
        stale_rows = torch.tensor([c.stale and not c.off_policy for c in chunk], device=dev, dtype=on.dtype)[:, None]
        corrected = on * stale_rows
        fresh = on - corrected
        weights = torch.ones_like(mask)
        rejected = torch.zeros_like(mask, dtype=torch.bool)
        if bool(corrected.any()):
            w, mb.behaviour = behaviour_weights(recomputed, behaviour, corrected, cfg.behaviour_weight_cap)
            weights = torch.where(corrected > 0, w, weights)
            rejected |= (corrected > 0) & (w == 0)
        if cfg.rollout_correction != "off" and bool(fresh.any()):
            w, out = rollout_correction(log_ratio, fresh, cfg.rollout_correction, cfg.rollout_correction_threshold)
            weights = torch.where(fresh > 0, w, weights)
            rejected |= out
            clamped = (w >= cfg.rollout_correction_threshold) & (fresh > 0)  # truncation holds w at C exactly
            mb.correction.update(corrected_n=float(fresh.sum()), rejected=float(out.sum()),
                                 truncated=float(clamped.sum()) if cfg.rollout_correction.endswith("truncate") else 0.0)
        if bool(corrected.any()) or (cfg.rollout_correction != "off" and bool(fresh.any())):
            mb.token_weights = weights if mb.token_weights is None else mb.token_weights * weights
        # a token left out leaves the loss and its denominator: out of the loss mask
        mb.rejected = [int(r) for r in rejected.sum(dim=1).tolist()]
        if any(mb.rejected):
            t["loss_mask"][:, 1:] = t["loss_mask"][:, 1:] * (~rejected).to(t["loss_mask"].dtype)
        return mb

    def plan(self, items: list[UpdateItem], step: int = 0) -> tuple[list[MicroBatch], float]:
        """The micro-batches this rank runs (as many per mini-batch as the busiest rank's), each tagged with its
        mini-batch, and this rank's trained-token count. ``step`` seeds the mini-batch shuffle."""
        cfg = self.cfg
        if cfg.advantage_batch_norm and all_reduce_max(len(items)) > 0:
            items = self._batch_normalised(items)
        local_tok = float(sum(it.sequence.n_trained for it in items))
        busiest = all_reduce_max(len(items))
        n_mini = max(1, min(cfg.mini_batches, busiest))
        if n_mini < cfg.mini_batches and busiest and not self._said_capped:  # a mini-batch of no item trains nothing
            self._said_capped = True
            self.log(f"mini_batches {cfg.mini_batches} ran as {n_mini}: the busiest rank had {busiest} sequences to "
                     "split; metrics.jsonl's mini_batches records each step's (said once)")
        where = mini_batch_assignment(len(items), n_mini, cfg.seed, step)
        batches: list[MicroBatch] = []
        for j in range(n_mini):
            # longest first inside the mini-batch (ties in the items' order): little padding per micro-batch
            mine = sorted((i for i in range(len(items)) if where[i] == j),
                          key=lambda i: (-len(items[i].sequence.input_ids), i))
            chunks = [[items[i] for i in mine[k : k + cfg.micro_batch_size]]
                      for k in range(0, len(mine), cfg.micro_batch_size)]
            n_micro = all_reduce_max(len(chunks))
            if n_micro == 0:
                continue
            if not chunks:  # a rank with nothing in this mini-batch still runs the collectives, at weight 0
                e = self.eos_id
                placeholder = TokenSequence(role="placeholder", input_ids=[e, e], loss_mask=[0, 1],
                                            logprobs=[0.0, 0.0], episode="placeholder")
                chunks, n_real = [[UpdateItem(sequence=placeholder, advantage=0.0, weight=0.0)]], 0
            else:
                n_real = len(chunks)
            for k in range(n_micro):
                mb = self._prepare(chunks[min(k, len(chunks) - 1)], k >= n_real)
                mb.mini = j
                batches.append(mb)
        if not batches:
            return [], local_tok
        # the normaliser: trained tokens per episode and the episode count, over every rank, without the tokens
        # the behaviour weight left out (an episode left out whole leaves the episode count)
        per_episode: dict[str, list[int]] = {}
        for it in items:
            per_episode.setdefault(it.sequence.episode, [0, 0])[0] += it.sequence.n_trained
        for b in batches:
            if not b.dummy:
                for e, out in zip(b.episodes, b.rejected, strict=True):
                    if e in per_episode:
                        per_episode[e][1] += out
        per_episode = self._gather_episodes(per_episode)
        kept = {e: n - out for e, (n, out) in per_episode.items()}
        gone = {e for e, (n, out) in per_episode.items() if n > 0 and n - out <= 0}
        totals = (len(per_episode) - len(gone), float(sum(kept.values())))
        kept.setdefault("placeholder", 1)  # a rank without items: its placeholder pass, at weight 0
        for b in batches:
            b.scales = torch.tensor([token_scales([e], [kept[e]], cfg.aggregation, float(cfg.max_new_tokens),
                                                  totals=totals)[0] for e in b.episodes],
                                    dtype=torch.float32, device=self.device)
        return batches, local_tok

    # ------------------------------------------------------------------ the steps

    def __call__(self, items: list[UpdateItem], step: int = 0) -> dict:
        """One or more optimizer steps on ``items`` (this rank's share); returns the update's statistics.
        ``step`` (the trainer's) seeds the mini-batch shuffle."""
        cfg = self.cfg
        batches, local_tok = self.plan(items, step)
        if not batches:
            return {"kl": 0.0, "clip_fraction": 0.0, "entropy": 0.0, "grad_norm": 0.0, "grad_norm_max": 0.0,
                    "loss": 0.0, "ratio_dev_max": 0.0, "logprob_mismatch": 0.0, "sequences": 0, "trained_tokens": 0}
        stats = {"kl": 0.0, "clip_fraction": 0.0, "entropy": 0.0, "loss": 0.0}
        if cfg.dual_clip is not None:
            stats["dual_clip_fraction"] = 0.0
        ratio_dev = 0.0  # the largest |π/π_old - 1|: 0 in a single optimizer step (the clip cannot act)
        real_tok = max(float(sum(float(b.mask.sum()) for b in batches if not b.dummy)), 1.0)
        minis = sorted({b.mini for b in batches})  # the same on every rank (every rank runs every mini-batch)
        n_mini = len(minis)
        self.model.train()
        norms: list[float] = []
        for epoch in range(cfg.ppo_epochs):
            order = list(minis)
            if epoch:  # a later pass visits the mini-batches in another order (the same on every rank)
                random.Random(f"paravt-epoch:{cfg.seed}:{step}:{epoch}").shuffle(order)
            for j in order:
                self.optimizer.zero_grad(set_to_none=True)
                for b in batches:
                    if b.mini != j:
                        continue
                    out, ent = self._loss(b)
                    if b.dummy:
                        (out.loss * 0.0).backward()
                        continue
                    scale = world_scale() * n_mini if n_mini > 1 else world_scale()
                    (out.loss * scale).backward()
                    mask = b.mask
                    frac = float(mask.sum()) / real_tok
                    stats["kl"] += out.kl * frac
                    stats["clip_fraction"] += out.clip_fraction * frac
                    if cfg.dual_clip is not None:
                        stats["dual_clip_fraction"] += out.dual_clip_fraction * frac
                    ratio_dev = max(ratio_dev, out.ratio_dev)
                    stats["entropy"] += float((ent * mask).sum()) / real_tok
                    stats["loss"] += float(out.loss.detach())
                norms.append(float(clip_grad_norm(self.params, cfg.max_grad_norm)))
                self.optimizer.step()
        self.scheduler.step()
        k = cfg.ppo_epochs
        stats = {key: v / k for key, v in stats.items()}
        stats["grad_norm"] = sum(norms) / len(norms)  # the mean over the optimizer steps (mini-batches, epochs)
        stats["grad_norm_max"] = max(norms)
        stats["ratio_dev_max"] = ratio_dev
        real = [b for b in batches if not b.dummy]
        sums = self._mismatch_sums(real)
        stats.update(mismatch_means(sums))
        stats["mismatch_sums"] = sums  # summed over the ranks by step_metrics: each mean over its own count
        bw = [b.behaviour for b in real if b.behaviour is not None]
        if cfg.max_staleness > 0 or bw:  # decoupled PPO: how far the behaviour policy was from the proximal one
            n = max(sum(x["n"] for x in bw), 1.0)
            stats["behaviour_weight"] = sum(x["sum"] for x in bw) / n if bw else 1.0
            stats["behaviour_weight_max"] = max((x["max"] for x in bw), default=1.0)
            stats["capped_tokens"] = sum(x["capped"] for x in bw) / n
            # the distribution, as a sketch step_metrics merges over the ranks into behaviour_weight_p10/p50/p90
            stats["behaviour_weight_sketch"] = weight_sketch(torch.cat([x["values"] for x in bw]) if bw else
                                                             torch.zeros(0))
            stats["stale_tokens"] = sum(x["n"] for x in bw)
        stats["sequences"], stats["trained_tokens"] = len(items), int(local_tok)
        stats["mini_batches"] = n_mini  # optimizer steps per pass: fewer than configured when items are fewer
        return stats

    def _mismatch_sums(self, batches: list[MicroBatch]) -> dict:
        """The sums behind ``logprob_mismatch`` and ``mismatch/*`` on this rank (:func:`~paravt_train.rl.metrics.
        mismatch_means` turns them into means, over one rank or summed over all): the rollout engine against the
        trainer on every on-policy token (corrected or not), and what the rollout correction did."""
        cs = [b.correction for b in batches if b.correction is not None]
        out = {"abs_diff": sum(b.mismatch[0] for b in batches), "on_n": sum(b.mismatch[1] for b in batches)}
        for key in ("n", "k1", "k3", "chi2", "past", "rows", "ppl_ratio", "uncertainty", "corrected_n", "rejected",
                    "truncated"):
            out[key] = sum(c.get(key, 0.0) for c in cs)
        out["abs_max"] = max((c["abs_max"] for c in cs), default=0.0)
        out["corrections"] = sum("corrected_n" in c for c in cs)  # micro-batches the correction acted on
        return out

    def _mismatch_stats(self, batches: list[MicroBatch]) -> dict:
        """``mismatch/*`` of these micro-batches alone (:meth:`_mismatch_sums` made means)."""
        return {k: v for k, v in mismatch_means(self._mismatch_sums(batches)).items() if k.startswith("mismatch/")}

    def _loss(self, b: MicroBatch):
        cfg = self.cfg
        with self.autocast():
            logp, ent = token_logprobs(self.model, b.tensors, cfg.temperature, entropy=True)
        out = policy_loss(logp, b.old_logp, b.advantages, b.mask, clip=cfg.clip, clip_high=cfg.clip_high,
                          ref_logp=b.ref_logp, kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator, scales=b.scales,
                          token_weights=b.token_weights, sample_weights=b.weights, dual_clip=cfg.dual_clip)
        return out, ent
