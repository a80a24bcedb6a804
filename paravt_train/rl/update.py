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
  first pass starts at ratio 1); replayed samples against their stored behaviour logprobs. The mismatch
  between the recomputed and the behaviour logprobs of on-policy tokens is reported (``logprob_mismatch``:
  ~0 when rollouts came from these exact weights).
* **Decoupled PPO** (``max_staleness`` > 0, rollouts from older policy versions): the ratio's denominator
  is π_prox, this model at the start of the update, and each token is weighted by π_prox / π_behav, capped
  (:func:`behaviour_weights`). With η = 0 nothing of it runs: the synchronous update, unchanged.
* **Epochs and mini-batches.** ``ppo_epochs`` passes over the batch, each split into ``mini_batches``
  optimizer steps (verl's PPO mini-batches; 1 × 1 is one step on the whole batch, where the ratio stays 1
  and the clip never acts). Each mini-batch's loss is scaled by ``mini_batches`` so a step has the size of a
  whole-batch step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from paravt_agent.policy.chat import ChatTokenizer, ban
from paravt_train.infra.distributed import all_reduce_max, clip_grad_norm, with_dummy_image, world_scale
from paravt_train.rl.metrics import weight_sketch
from paravt_train.rl.objective import policy_loss, temporal_weights, token_scales
from paravt_train.rl.rollout import RolloutError, TokenSequence

__all__ = ["MicroBatch", "PolicyUpdate", "UpdateItem", "behaviour_weights", "collate", "token_logprobs"]

FORWARD_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw")


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
    #: ``sync_every`` > 1, or η > 0): decoupled PPO's behaviour weight corrects it (on-policy items only)
    stale: bool = False


def collate(seqs: list[TokenSequence], chat: ChatTokenizer) -> dict:
    """Right-padded ids / masks / behaviour logprobs of sequences, with their images' pixel values (at the
    size the policy saw them; a sequence whose recorded patch grids differ is refused)."""
    n = max(len(s.input_ids) for s in seqs)
    B = len(seqs)
    ids = torch.full((B, n), chat.pad_id, dtype=torch.long)
    att = torch.zeros((B, n), dtype=torch.long)
    mask = torch.zeros((B, n), dtype=torch.float32)
    blp = torch.zeros((B, n), dtype=torch.float32)
    images = []
    for i, s in enumerate(seqs):
        L = len(s.input_ids)
        ids[i, :L] = torch.tensor(s.input_ids)
        att[i, :L] = 1
        mask[i, :L] = torch.tensor(s.loss_mask, dtype=torch.float32)
        blp[i, :L] = torch.tensor(s.logprobs, dtype=torch.float32)
        images.extend(s.images)
    batch = {"input_ids": ids, "attention_mask": att, "loss_mask": mask, "behaviour_logp": blp,
             "banned_ids": torch.tensor(chat.placeholder_ids, dtype=torch.long)}  # never sampled: never scored
    if chat.uses_mm_token_types:
        batch["mm_token_type_ids"] = chat.mm_token_types(ids)
    if images:
        batch.update(chat.image_inputs(images))
        recorded = [tuple(g) for s in seqs for g in (s.image_grid_thw or [])]
        computed = [tuple(int(x) for x in g) for g in batch["image_grid_thw"]]
        if recorded and recorded != computed:
            raise RolloutError("the policy saw other patch grids than the trainer computes (its image processor "
                               "resized frames differently); training would score other visual tokens")
    return batch


def token_logprobs(model, batch: dict, temperature: float, entropy: bool = False):
    """Log-probabilities (under temperature τ, as sampled) of tokens 1..T given their prefixes: (B, T-1).

    Logits are computed only at the positions that predict a trained token (``logits_to_keep``):
    a 64-frame prompt is ~17K tokens, a response ~2K, and full-vocabulary logits over the prompt
    would dominate memory. Other positions are 0. ``entropy`` (a statistic, never trained) is computed
    without gradients.
    """
    mask = batch["loss_mask"][:, 1:]
    keep = torch.nonzero(mask.any(0)).flatten()  # positions t whose logits predict token t+1
    out = model(**{k: batch[k] for k in FORWARD_KEYS if k in batch}, use_cache=False, logits_to_keep=keep)
    # (B, K, V), with the samplers' ban (vision placeholders): the behaviour policy never samples them
    logits = ban(out.logits.float(), batch.get("banned_ids")) / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    target = batch["input_ids"][:, keep + 1]
    B, T = mask.shape
    lp = torch.zeros((B, T), dtype=logits.dtype, device=logits.device)
    lp[:, keep] = logp_all.gather(-1, target[..., None])[..., 0]
    ent = None
    if entropy:
        with torch.no_grad():
            detached = logp_all.detach()
            ent = torch.zeros((B, T), dtype=logits.dtype, device=logits.device)
            ent[:, keep] = -(detached.exp() * detached).sum(-1)
    return lp, ent


def behaviour_weights(prox_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, cap: float):
    """Decoupled PPO (Hilton et al., "Batch size-invariance for policy optimization"; AReaL's asynchronous loss,
    ``ppo_actor_loss_fn`` with ``behav_imp_weight_cap``): the ratio is taken to the proximal policy π_prox
    (this model at the start of the update) and each token is weighted by π_prox / π_behav, the policy that
    sampled it (the server's recorded logprobs, whatever version produced the token). Tokens whose weight
    exceeds ``cap`` are left out (weight 0), as AReaL filters them. Returns the weights (1 off ``mask``) and
    their statistics (sums over ``mask``)."""
    with torch.no_grad():
        w = torch.exp((prox_logp - behaviour_logp).clamp(max=30.0))
        valid = mask > 0
        capped = valid & (w > cap)
        kept = torch.where(capped, torch.zeros_like(w), w)
        stats = {"sum": float((kept * valid).sum()), "n": float(valid.sum()), "capped": float(capped.sum()),
                 "max": float(w[valid].max()) if bool(valid.any()) else 0.0,
                 "values": w[valid].float().cpu()}  # every token's weight (capped ones too): the quantiles
        return torch.where(valid, kept, torch.ones_like(w)), stats


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

    @property
    def mask(self) -> torch.Tensor:
        return self.tensors["loss_mask"][:, 1:]


class PolicyUpdate:
    """``PolicyUpdate(...)(items) -> stats``: the optimizer steps of one GRPO step on this rank's items."""

    def __init__(self, model, optimizer, scheduler, params, chat: ChatTokenizer, cfg, device, world: int,
                 ref=None, autocast_dtype=None, eos_id: int | None = None):
        self.model, self.optimizer, self.scheduler, self.params = model, optimizer, scheduler, params
        self.chat, self.cfg, self.device, self.world, self.ref = chat, cfg, device, world, ref
        self.autocast_dtype = autocast_dtype
        self.eos_id = chat.eos_id if eos_id is None else eos_id

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    # ------------------------------------------------------------------ planning

    def _global_episodes(self, items: list[UpdateItem]) -> dict[str, int]:
        """Trained tokens per episode over every rank (an episode's sequences may be split)."""
        per_episode: dict[str, int] = {}
        for it in items:
            per_episode[it.sequence.episode] = per_episode.get(it.sequence.episode, 0) + it.sequence.n_trained
        if self.world > 1:
            import torch.distributed as dist

            shards: list = [None] * self.world
            dist.all_gather_object(shards, per_episode)
            per_episode = {}
            for shard in shards:
                for e, n in shard.items():
                    per_episode[e] = per_episode.get(e, 0) + n
        return per_episode

    def _prepare(self, chunk: list[UpdateItem], dummy: bool, per_episode: dict[str, int],
                 totals: tuple[int, float]) -> MicroBatch:
        cfg, dev = self.cfg, self.device
        t = collate([c.sequence for c in chunk], self.chat)
        if self.world > 1 and "pixel_values" not in t:
            t = with_dummy_image(t, self.chat)
        t = {k: v.to(dev) for k, v in t.items()}
        scales = [token_scales([c.sequence.episode], [per_episode[c.sequence.episode]], cfg.aggregation,
                               float(cfg.max_new_tokens), totals=totals)[0] for c in chunk]
        mb = MicroBatch(
            tensors=t,
            advantages=torch.tensor([c.advantage for c in chunk], dtype=torch.float32, device=dev),
            weights=torch.tensor([c.weight for c in chunk], dtype=torch.float32, device=dev),
            scales=torch.tensor(scales, dtype=torch.float32, device=dev),
            old_logp=torch.zeros(0), dummy=dummy)
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
        # decoupled PPO (AReaL): rows another policy version sampled are weighted π_prox / π_behav; with η > 0 every
        # on-policy row (its version is bounded, not known to be current), else only the rows known to be stale
        corrected = on if cfg.max_staleness > 0 else on * torch.tensor(
            [c.stale and not c.off_policy for c in chunk], device=dev, dtype=on.dtype)[:, None]
        if cfg.max_staleness > 0 or bool(corrected.any()):
            w, mb.behaviour = behaviour_weights(recomputed, behaviour, corrected, cfg.behaviour_weight_cap)
            mb.token_weights = w if mb.token_weights is None else mb.token_weights * w
        return mb

    def plan(self, items: list[UpdateItem]) -> tuple[list[MicroBatch], float]:
        """The micro-batches this rank runs (as many as the busiest rank's) and its trained-token count."""
        cfg = self.cfg
        items = sorted(items, key=lambda it: -len(it.sequence.input_ids))
        micro = [items[i : i + cfg.micro_batch_size] for i in range(0, len(items), cfg.micro_batch_size)]
        local_tok = float(sum(it.sequence.n_trained for it in items))
        per_episode = self._global_episodes(items)
        totals = (int(len(per_episode)), float(sum(per_episode.values())))
        n_micro = all_reduce_max(len(micro))
        if n_micro == 0:
            return [], local_tok
        if not micro:  # a rank with nothing to train this step still runs the collectives, at weight 0
            e = self.eos_id
            placeholder = TokenSequence(role="placeholder", input_ids=[e, e], loss_mask=[0, 1], logprobs=[0.0, 0.0],
                                        episode="placeholder")
            micro = [[UpdateItem(sequence=placeholder, advantage=0.0, weight=0.0)]]
            per_episode.setdefault("placeholder", 1)
            n_real = 0
        else:
            n_real = len(micro)
        batches = [self._prepare(micro[min(j, len(micro) - 1)], j >= n_real, per_episode, totals)
                   for j in range(n_micro)]
        return batches, local_tok

    # ------------------------------------------------------------------ the steps

    def __call__(self, items: list[UpdateItem]) -> dict:
        """One or more optimizer steps on ``items`` (this rank's share); returns the update's statistics."""
        cfg = self.cfg
        batches, local_tok = self.plan(items)
        if not batches:
            return {"kl": 0.0, "clip_fraction": 0.0, "entropy": 0.0, "grad_norm": 0.0, "loss": 0.0,
                    "ratio_dev_max": 0.0, "logprob_mismatch": 0.0, "sequences": 0, "trained_tokens": 0}
        stats = {"kl": 0.0, "clip_fraction": 0.0, "entropy": 0.0, "loss": 0.0}
        ratio_dev = 0.0  # the largest |π/π_old - 1|: 0 in a single optimizer step (the clip cannot act)
        real_tok = max(float(sum(float(b.mask.sum()) for b in batches if not b.dummy)), 1.0)
        n_mini = max(1, min(cfg.mini_batches, len(batches)))
        bounds = [round(i * len(batches) / n_mini) for i in range(n_mini + 1)]  # the same cut on every rank
        self.model.train()
        grad_norm = 0.0
        for _ in range(cfg.ppo_epochs):
            for lo, hi in zip(bounds, bounds[1:], strict=False):
                self.optimizer.zero_grad(set_to_none=True)
                for b in batches[lo:hi]:
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
                    ratio_dev = max(ratio_dev, out.ratio_dev)
                    stats["entropy"] += float((ent * mask).sum()) / real_tok
                    stats["loss"] += float(out.loss.detach())
                grad_norm = clip_grad_norm(self.params, cfg.max_grad_norm)
                self.optimizer.step()
        self.scheduler.step()
        k = cfg.ppo_epochs
        stats = {key: v / k for key, v in stats.items()}
        stats["grad_norm"] = float(grad_norm)
        stats["ratio_dev_max"] = ratio_dev
        mism = [b.mismatch for b in batches if not b.dummy]
        stats["logprob_mismatch"] = sum(m[0] for m in mism) / max(sum(m[1] for m in mism), 1.0)
        bw = [b.behaviour for b in batches if not b.dummy and b.behaviour is not None]
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
        return stats

    def _loss(self, b: MicroBatch):
        cfg = self.cfg
        with self.autocast():
            logp, ent = token_logprobs(self.model, b.tensors, cfg.temperature, entropy=True)
        out = policy_loss(logp, b.old_logp, b.advantages, b.mask, clip=cfg.clip, clip_high=cfg.clip_high,
                          ref_logp=b.ref_logp, kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator, scales=b.scales,
                          token_weights=b.token_weights, sample_weights=b.weights)
        return out, ent
