"""Scoring a batch of token sequences with the trained model: :func:`collate` pads sequences (and their images, at
the size the policy saw them) into the model's inputs, :func:`token_logprobs` gives each trained token's logprob
under the sampling temperature, with the samplers' ban (the vision placeholders are never sampled, so never scored).
The update (:mod:`paravt_train.rl.update`), the trainer's checks and the parity benchmark score this one way."""

from __future__ import annotations

import torch

from paravt_agent.policy.chat import ChatTokenizer, ban
from paravt_train.rl.rollout import RolloutError, TokenSequence

__all__ = ["FORWARD_KEYS", "collate", "token_logprobs"]

FORWARD_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw")


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
    chat.check_inputs(batch, "the trainer's collate")
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
