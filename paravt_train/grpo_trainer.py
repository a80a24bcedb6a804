"""The PARA-GRPO trainer: rollouts through the agent graph → rewards → group advantages → clipped
policy update → weight sync → metrics.

One step (``prompts_per_step`` prompts × ``group_size`` rollouts)::

    prompts ──► run_group (Agent graph, G concurrent rollouts, n from nFrames gating)
            ──► score (R_acc + λ_fmt R_fmt + R_tool + bias)  ──► group advantages (failed episodes dropped)
            ──► [dynamic sampling: zero-variance groups replaced by further prompts]
            ──► UpdateItems (planner + sub-agent sequences, sampled tokens only in the loss)
            ──► [replayed rollouts from the AVATAR buffer: Eq. 11 advantage, weight α]
            ──► ppo_epochs × micro-batches: clipped ratio + KL(ref), episodes weighed equally ──► AdamW
            ──► weight sync (in process | SGLang, from disk or as tensors) ──► metrics.jsonl

Backends: ``local`` (CPU or one GPU; the rollout policy shares the trained
parameters, so the sync is a no-op) and ``sglang`` (rollouts on an SGLang server,
the actor under ``torchrun`` + FSDP2; after each update rank 0 sends the full
weights to the server, generation paused around the swap: :mod:`paravt_train.weight_sync`).
Every rank rolls out its share of the prompts; the step's metrics are gathered
over all ranks.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from paravt_agent.config import AGENT_CONFIG_FILE, AgentConfig
from paravt_agent.errors import ConfigError
from paravt_agent.policy.chat import ChatTokenizer
from paravt_train.checkpoint import (
    latest_checkpoint,
    load_blobs,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from paravt_train.distributed import (
    all_reduce_max,
    barrier,
    clip_grad_norm,
    data_order,
    device,
    init_distributed,
    rank_world,
    shard_model,
    vision_keepalive,
    world_scale,
)
from paravt_train.grpo import (
    ReplayBuffer,
    offpolicy_advantages,
    policy_loss,
    temporal_weights,
    token_scales,
)
from paravt_train.grpo_config import GRPOConfig
from paravt_train.rewards import rollout_metrics
from paravt_train.rollout import (
    Episode,
    PromptCache,
    PromptItem,
    RolloutError,
    RolloutSettings,
    TokenSequence,
    gate_frames,
    run_group,
)
from paravt_train.weight_sync import SGLangTensorSync, SGLangWeightSync

__all__ = ["GRPOTrainer", "UpdateItem", "collate", "token_logprobs"]


@dataclass
class UpdateItem:
    """What the update consumes: one sequence, its advantage, its weight (α for replayed rollouts) and
    whether its ratio is taken against the stored behaviour logprobs (off-policy) or against this policy
    before the update (on-policy)."""

    sequence: TokenSequence
    advantage: float
    weight: float = 1.0
    off_policy: bool = False


# --------------------------------------------------------------------------- tensors


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
    batch = {"input_ids": ids, "attention_mask": att, "loss_mask": mask, "behaviour_logp": blp}
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
    would dominate memory. Other positions are 0.
    """
    mask = batch["loss_mask"][:, 1:]
    keep = torch.nonzero(mask.any(0)).flatten()  # positions t whose logits predict token t+1
    keys = ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw")
    out = model(**{k: batch[k] for k in keys if k in batch}, use_cache=False, logits_to_keep=keep)
    logits = out.logits.float() / temperature  # (B, K, V)
    logp_all = torch.log_softmax(logits, dim=-1)
    target = batch["input_ids"][:, keep + 1]
    B, T = mask.shape
    lp = torch.zeros((B, T), dtype=logits.dtype, device=logits.device)
    lp[:, keep] = logp_all.gather(-1, target[..., None])[..., 0]
    ent = None
    if entropy:
        ent = torch.zeros((B, T), dtype=logits.dtype, device=logits.device)
        ent[:, keep] = -(logp_all.exp() * logp_all).sum(-1)
    return lp, ent


# --------------------------------------------------------------------------- trainer


class GRPOTrainer:
    """``GRPOTrainer(cfg).run()``; ``train_step(prompts)`` is the unit the online loop reuses."""

    def __init__(self, cfg: GRPOConfig, progress: bool = True, log=print):
        self.cfg = cfg
        self.progress = progress
        self.log = log
        self.out = Path(cfg.output_dir)
        self.step = 0
        self._ready = False

    # ------------------------------------------------------------------ setup

    def base_agent_config(self) -> AgentConfig:
        """The agent config the model was trained with (``agent_config`` or the model's own file)."""
        cfg = self.cfg
        if cfg.agent_config:
            if not Path(cfg.agent_config).is_file():
                raise ConfigError(f"agent config {cfg.agent_config} does not exist")
            return AgentConfig.from_yaml(cfg.agent_config)
        return AgentConfig.for_model(cfg.model) or AgentConfig()

    def agent_config(self) -> AgentConfig:
        """The rollout agent: the model's own protocol (its dispatch mode and layout), the preset's think
        prefix, τ-sampling, the RL token limits."""
        cfg = self.cfg
        base = self.base_agent_config()
        return base.model_copy(update={
            "think_prefix": cfg.think_prefix,
            "planner_sampling": base.planner_sampling.model_copy(update={
                "temperature": cfg.temperature, "top_p": cfg.top_p, "max_new_tokens": cfg.max_new_tokens}),
            "subagent_sampling": base.subagent_sampling.model_copy(update={
                "temperature": cfg.temperature, "top_p": cfg.top_p, "max_new_tokens": cfg.subagent_max_new_tokens}),
        })

    def eval_agent_config(self) -> AgentConfig:
        """The held-out agent: what `paravt-train eval` runs for this model (its agent config, greedy, its
        token limits and frame protocol), with the preset's think prefix."""
        base = self.base_agent_config()
        frames = base.frames if self.cfg.eval_n_frames is None else base.frames.model_copy(
            update={"n_frames": self.cfg.eval_n_frames})
        return base.model_copy(update={
            "frames": frames, "think_prefix": self.cfg.think_prefix,
            "planner_sampling": base.planner_sampling.model_copy(update={"temperature": 0.0}),
            "subagent_sampling": base.subagent_sampling.model_copy(update={"temperature": 0.0})})

    def setup(self) -> None:
        if self._ready:
            return
        from transformers import AutoModelForImageTextToText, AutoProcessor

        from paravt_agent.agent import Agent

        cfg = self.cfg
        if not Path(cfg.model).is_dir():
            raise ConfigError(f"model directory {cfg.model} does not exist (build one with `paravt-train toy`)")
        init_distributed()
        self.rank, self.world = rank_world()
        if self.world > 1 and cfg.backend == "local":
            raise ConfigError("multi-process training needs backend: sglang (the local backend generates with "
                              "the trained parameters in this process)")
        if self.world > 1 and cfg.prompts_per_step % self.world:
            raise ConfigError(f"prompts_per_step ({cfg.prompts_per_step}) must divide by the {self.world} training "
                              "processes: each one rolls out and trains on its share of the prompts")
        self.device = device()
        use_bf16 = cfg.bf16 == "true" or (cfg.bf16 == "auto" and self.device.type == "cuda")
        self.autocast_dtype = torch.bfloat16 if use_bf16 else None
        torch.manual_seed(cfg.seed)
        self.out.mkdir(parents=True, exist_ok=True)
        self.processor = AutoProcessor.from_pretrained(cfg.model)
        self.chat = ChatTokenizer(self.processor)
        self.eos_id = self.chat.eos_id
        self.model = AutoModelForImageTextToText.from_pretrained(cfg.model, dtype=torch.float32).to(self.device)
        if cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.ref = None
        if cfg.kl_coef > 0:  # the frozen reference: bf16 on GPUs, sharded like the actor under FSDP2
            ref_dtype = torch.bfloat16 if use_bf16 else torch.float32
            self.ref = AutoModelForImageTextToText.from_pretrained(cfg.model, dtype=ref_dtype).to(self.device)
            self.ref.eval().requires_grad_(False)
            if self.world > 1:
                self.ref = shard_model(self.ref)
        if self.world > 1:
            self.model = shard_model(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        warm = cfg.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
        if cfg.backend == "local":
            from paravt_agent.policy.local import LocalPolicy

            policy = LocalPolicy(cfg.model, model_obj=self.model, processor=self.processor,
                                 max_batch=cfg.rollout_batch)
            self.syncer = None  # the policy generates with the trained parameters themselves
        else:
            from paravt_agent.policy.sglang_backend import SGLangPolicy

            policy = SGLangPolicy(model=cfg.model, endpoint=cfg.endpoint, processor=self.processor)
            url = cfg.endpoint or "http://127.0.0.1:30000"
            self.syncer = (SGLangTensorSync(url, tp_size=cfg.sglang_tp_size, pause_mode=cfg.sync_pause_mode)
                           if cfg.weight_sync == "tensor"
                           else SGLangWeightSync(url, self.out / "weights", pause_mode=cfg.sync_pause_mode))
        self.agent = Agent(policy=policy, config=self.agent_config())
        self.cache = PromptCache(self.agent)
        self.judge = None
        if cfg.reward.judge is not None:
            from paravt_train.judge import LLMJudge

            j = cfg.reward.judge
            self.judge = LLMJudge(j.endpoint, j.model, api_key=j.api_key, timeout=j.timeout)
        r = cfg.replay
        self.replay = ReplayBuffer(capacity=r.capacity, tiers=r.tiers, alpha=r.alpha,
                                   baseline_window=r.baseline_window, seed=cfg.seed)
        self.extra_state: dict = {}
        self._resume()
        self._ready = True

    # ------------------------------------------------------------------ checkpoints

    @property
    def frame_store(self) -> Path:
        """Replayed rollouts' frames, stored once by content key and shared by every checkpoint."""
        return self.out / "replay_frames"

    def _resume(self) -> None:
        import numpy as np

        latest = latest_checkpoint(self.out) if self.cfg.resume else None
        metrics = self.out / "metrics.jsonl"
        if latest is None:  # a fresh start: metrics of an earlier attempt that never checkpointed go
            if metrics.exists() and self.rank == 0:
                metrics.unlink()
            return
        self.model.train()
        self.step = load_checkpoint(latest, self.model, self.optimizer, self.scheduler)
        blobs = load_blobs(latest)
        if "replay" in blobs:
            self.replay.load_state_dict(blobs["replay"], lambda key: np.load(self.frame_store / f"{key}.npy"))
        self.extra_state = blobs.get("extra_state", {})
        if metrics.exists() and self.rank == 0:  # drop lines of steps after the checkpoint: they will be redone
            keep = [ln for ln in metrics.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= self.step]
            metrics.write_text("".join(ln + "\n" for ln in keep))
        self.log(f"resumed from {latest} (step {self.step})")
        if self.syncer is not None:
            self.sync()

    def save(self) -> Path:
        """A checkpoint of this step (model, optimizer, scheduler, RNG, replay buffer, ``extra_state``);
        the ``keep_checkpoints`` newest are kept."""
        import numpy as np

        path = self.out / f"checkpoint-{self.step}"
        state, frames = self.replay.state_dict()
        if self.rank == 0 and frames:
            self.frame_store.mkdir(parents=True, exist_ok=True)
            for key, frame in frames.items():
                target = self.frame_store / f"{key}.npy"
                if not target.exists():
                    np.save(target, frame)
        blobs = {"replay": state, "extra_state": self.extra_state}
        save_checkpoint(path, self.model, self.optimizer, self.scheduler, self.step, blobs=blobs,
                        extra={"replay_frames": sorted(frames)})
        if self.rank == 0:
            prune_checkpoints(self.out, self.cfg.keep_checkpoints)
            self._collect_frames()
        return path

    def _collect_frames(self) -> None:
        """Delete stored frames no kept checkpoint refers to."""
        if not self.frame_store.is_dir():
            return
        used: set[str] = set()
        for state in self.out.glob("checkpoint-*/trainer_state.json"):
            used.update(json.loads(state.read_text()).get("replay_frames", []))
        for f in self.frame_store.glob("*.npy"):
            if f.stem not in used:
                f.unlink(missing_ok=True)

    def full_state_dict(self) -> dict:
        """The whole model's parameters by their Hugging Face names (gathered from every rank under FSDP2)."""
        if self.world > 1:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        return self.model.state_dict()

    def save_model(self, path: Path) -> Path:
        """A plain model directory (+ the agent config it was trained with, greedy) that the agent loads."""
        path = Path(path)
        if self.world > 1:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            sd = None
        if self.rank == 0:
            tmp = path.with_name(path.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            if sd is not None:
                from transformers import AutoModelForImageTextToText

                plain = AutoModelForImageTextToText.from_pretrained(self.cfg.model)
                plain.load_state_dict(sd)
                plain.save_pretrained(tmp)
            else:
                self.model.save_pretrained(tmp)
            self.processor.save_pretrained(tmp)
            (tmp / AGENT_CONFIG_FILE).write_text(self.eval_agent_config().model_copy(
                update={"frames": self.base_agent_config().frames}).to_yaml())
            shutil.rmtree(path, ignore_errors=True)
            tmp.rename(path)
        barrier()
        return path

    def sync(self) -> dict | None:
        """Push the current weights to the rollout server (no-op for the local backend)."""
        if self.syncer is None:
            return None
        if isinstance(self.syncer, SGLangTensorSync):
            state = self.full_state_dict()
            result = self.syncer.push(state.items(), version=str(self.step)) if self.rank == 0 else None
        else:
            path = self.save_model(self.out / "weights" / "current")
            result = self.syncer.push(path, version=str(self.step)) if self.rank == 0 else None
        barrier()  # no rank rolls out again before the server holds the new weights
        return result

    # ------------------------------------------------------------------ rollouts

    def n_frames_for(self, prompt: PromptItem) -> int | None:
        return gate_frames(self.cfg.seed, prompt.id, self.cfg.gating_choices) if self.cfg.gating else None

    def rollout(self, prompts: list[PromptItem], salt: int = 0) -> list[list[Episode]]:
        """``[episodes of prompt 1 (G), episodes of prompt 2, ...]``."""
        cfg = self.cfg
        sem = asyncio.Semaphore(cfg.concurrency)

        async def one(p: PromptItem):
            settings = RolloutSettings(group=cfg.group_size, n_frames=self.n_frames_for(p), reward=cfg.reward,
                                       seed=cfg.seed * 1_000_003 + self.step * 101 + salt,
                                       subagents=cfg.train_subagents, judge=self.judge)
            async with sem:
                return await run_group(self.agent, self.cache, p, settings, self.eos_id)

        async def all_():
            return await asyncio.gather(*(one(p) for p in prompts))

        self.model.eval()
        return self.agent.run(all_())

    def advantages(self, group: list[Episode]) -> list[Episode]:
        """Group-normalised advantages over the group's usable episodes (failed ones dropped unless kept);
        returns the episodes that train."""
        cfg = self.cfg
        usable = [e for e in group if e.failed is None or cfg.failed_episodes == "keep"]
        if len(usable) < 2:
            return []
        r = torch.tensor([e.reward.total for e in usable])
        centred = r - r.mean()
        if cfg.advantage_scale == "std":
            centred = centred / (r.std(unbiased=False) + cfg.advantage_eps)
        for e, a in zip(usable, centred.tolist(), strict=True):
            e.advantage = a
        return usable

    # ------------------------------------------------------------------ update

    def update(self, items: list[UpdateItem]) -> dict:
        """One or more optimizer steps on ``items`` (this rank's share); returns the update's statistics."""
        cfg = self.cfg
        items = sorted(items, key=lambda it: -len(it.sequence.input_ids))
        micro = [items[i : i + cfg.micro_batch_size] for i in range(0, len(items), cfg.micro_batch_size)]
        # Under FSDP every rank must run the same number of forward/backward passes (each one is a
        # collective) and gradients are AVERAGED over ranks: ranks share the global counts, a rank with
        # fewer micro-batches repeats its last one with weight 0, and each rank's loss is its share of the
        # global loss times the world size.
        local_tok = float(sum(it.sequence.n_trained for it in items))
        per_episode: dict[str, int] = {}
        for it in items:
            per_episode[it.sequence.episode] = per_episode.get(it.sequence.episode, 0) + it.sequence.n_trained
        if self.world > 1:  # an episode's tokens and the episode count are global (its sequences may be split)
            import torch.distributed as dist

            shards: list = [None] * self.world
            dist.all_gather_object(shards, per_episode)
            per_episode = {}
            for shard in shards:
                for e, n in shard.items():
                    per_episode[e] = per_episode.get(e, 0) + n
        n_ep, n_tok = float(len(per_episode)), float(sum(per_episode.values()))
        n_micro = all_reduce_max(len(micro))
        if n_micro == 0:
            return {"kl": 0.0, "clip_fraction": 0.0, "entropy": 0.0, "grad_norm": 0.0, "loss": 0.0,
                    "logprob_mismatch": 0.0, "sequences": 0, "trained_tokens": 0}
        if not micro:  # a rank with nothing to train this step still runs the collectives, at weight 0
            e = self.eos_id
            placeholder = TokenSequence("placeholder", [e, e], [0, 1], [0.0, 0.0], episode="placeholder")
            micro = [[UpdateItem(placeholder, 0.0, 0.0)]]
            per_episode.setdefault("placeholder", 1)
            n_real = 0
        else:
            n_real = len(micro)
        batches = []
        for j in range(n_micro):
            dummy = j >= n_real
            chunk = micro[min(j, len(micro) - 1)]
            b = collate([c.sequence for c in chunk], self.chat)
            b = {k: v.to(self.device) for k, v in b.items()}
            b["adv"] = torch.tensor([c.advantage for c in chunk], dtype=torch.float32, device=self.device)
            b["weight"] = torch.tensor([c.weight for c in chunk], dtype=torch.float32, device=self.device)
            # each episode's trained tokens count as a whole, even when its sequences fall in different batches
            scales = []
            for c in chunk:
                s = token_scales([c.sequence.episode], [per_episode[c.sequence.episode]], cfg.aggregation,
                                 float(cfg.max_new_tokens), totals=(int(n_ep), n_tok))[0]
                scales.append(s)
            b["scales"] = torch.tensor(scales, dtype=torch.float32, device=self.device)
            mask = b["loss_mask"][:, 1:]
            if cfg.tas_lambda:
                tw = torch.ones_like(mask)
                for i, w in enumerate(temporal_weights([int(m.sum()) for m in mask], cfg.tas_lambda)):
                    tw[i, mask[i] > 0] = w.to(tw.device)
                b["token_weights"] = tw
            with torch.no_grad(), self._autocast():
                if self.ref is not None:
                    b["ref_logp"], _ = token_logprobs(self.ref, b, cfg.temperature)
                recomputed, _ = token_logprobs(self.model, b, cfg.temperature)
            behaviour = b["behaviour_logp"][:, 1:]
            off = torch.tensor([c.off_policy for c in chunk], device=self.device)[:, None]
            # on-policy samples: the update starts at ratio 1 (old = this model before the update);
            # replayed samples: importance ratio against the stored behaviour logprobs
            b["old_logp"] = torch.where(off, behaviour, recomputed)
            on = (~off).float() * mask
            b["mismatch"] = (float(((recomputed - behaviour).abs() * on).sum()), float(on.sum()))
            b["dummy"] = dummy
            batches.append(b)
        stats = {"kl": 0.0, "clip_fraction": 0.0, "entropy": 0.0, "loss": 0.0}
        real_tok = max(float(sum(float(b["loss_mask"][:, 1:].sum()) for b in batches if not b["dummy"])), 1.0)
        self.model.train()
        grad_norm = 0.0
        for _ in range(cfg.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for b in batches:
                mask = b["loss_mask"][:, 1:]
                with self._autocast():
                    logp, ent = token_logprobs(self.model, b, cfg.temperature, entropy=True)
                out = policy_loss(
                    logp, b["old_logp"], b["adv"], mask, clip=cfg.clip, clip_high=cfg.clip_high,
                    ref_logp=b.get("ref_logp"), kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator,
                    scales=b["scales"], token_weights=b.get("token_weights"), sample_weights=b["weight"],
                )
                if b["dummy"]:
                    keep = vision_keepalive(self.model, self.device) if "pixel_values" not in b else 0.0
                    (out.loss * 0.0 + keep).backward()
                    continue
                keep = vision_keepalive(self.model, self.device) if self.world > 1 and "pixel_values" not in b else 0.0
                (out.loss * world_scale() + keep).backward()
                frac = float(mask.sum()) / real_tok
                stats["kl"] += out.kl * frac
                stats["clip_fraction"] += out.clip_fraction * frac
                stats["entropy"] += float((ent.detach() * mask).sum()) / real_tok
                stats["loss"] += float(out.loss.detach())
            grad_norm = clip_grad_norm(self.params, cfg.max_grad_norm)
            self.optimizer.step()
        self.scheduler.step()
        k = cfg.ppo_epochs
        stats = {key: v / k for key, v in stats.items()}
        stats["grad_norm"] = float(grad_norm)
        mism = [b["mismatch"] for b in batches if not b["dummy"]]
        stats["logprob_mismatch"] = sum(m[0] for m in mism) / max(sum(m[1] for m in mism), 1.0)
        stats["sequences"], stats["trained_tokens"] = len(items), int(local_tok)
        return stats

    def _autocast(self):
        if self.autocast_dtype is None:
            import contextlib

            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    # ------------------------------------------------------------------ one step

    def _extra_prompts(self, pool: list[PromptItem], k: int, salt: int) -> list[PromptItem]:
        rng = random.Random(self.cfg.seed * 7919 + self.step * 131 + salt * 17 + self.rank)
        return rng.sample(pool, min(k, len(pool)))

    def train_step(self, prompts: list[PromptItem], pool: list[PromptItem] | None = None) -> dict:
        """Rollouts for ``prompts`` (this rank's share), one policy update, a sync; returns the step's
        metrics, gathered over all ranks. ``pool`` feeds dynamic sampling."""
        self.setup()
        cfg = self.cfg
        t0 = time.perf_counter()
        groups = self.rollout(prompts)
        all_groups = list(groups)
        if cfg.dynamic_sampling:  # DAPO: replace zero-variance groups by groups of further prompts
            for rnd in range(1, cfg.max_sampling_rounds + 1):
                informative = [g for g in groups if len({round(e.reward.total, 9) for e in g}) > 1]
                need = len(prompts) - len(informative)
                if need <= 0 or not pool:
                    break
                more = self.rollout(self._extra_prompts(pool, need, rnd), salt=rnd)
                all_groups.extend(more)
                groups = informative + more
            groups = [g for g in groups if len({round(e.reward.total, 9) for e in g}) > 1][: len(prompts)] or groups
        t_roll = time.perf_counter() - t0
        items: list[UpdateItem] = []
        trained: list[Episode] = []
        for g in groups:
            for e in self.advantages(g):
                trained.append(e)
                items.extend(UpdateItem(s, e.advantage) for s in e.sequences)
        replayed, drawn = [], []
        if cfg.replay.enabled:
            drawn = self.replay.sample(cfg.replay.per_step) if cfg.replay.per_step else []
            advs = offpolicy_advantages([it.reward for it in drawn], [self.replay.baseline(it.prompt_id)
                                                                     for it in drawn])
            for it, a in zip(drawn, advs, strict=True):
                replayed.extend(UpdateItem(s, a, cfg.replay.alpha, True) for s in it.sequences)
            for g in groups:
                for e in g:
                    if e.failed is None:
                        self.replay.observe(e.prompt_id, e.reward.total)
                        self.replay.add(e.prompt_id, e.sequences, e.reward.total)
        t1 = time.perf_counter()
        stats = self.update(items + replayed)
        t_upd = time.perf_counter() - t1
        self.step += 1
        t2 = time.perf_counter()
        if self.syncer is not None and self.step % cfg.sync_every == 0:
            self.sync()
        t_sync = time.perf_counter() - t2
        rec = self._metrics(groups, all_groups, prompts, stats, len(drawn))
        rec.update(rollout_seconds=t_roll, update_seconds=t_upd, sync_seconds=t_sync,
                   lr=self.scheduler.get_last_lr()[0])
        if self.rank == 0:
            with (self.out / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(rec) + "\n")
        return rec

    def _metrics(self, groups, all_groups, prompts, stats, replayed: int) -> dict:
        """The step's metrics over every rank's episodes."""
        cfg = self.cfg
        mine = [{"prompt": e.prompt_id, "task": e.task, "text": e.text, "reward": e.reward.total,
                 "terms": e.reward.terms(), "degenerate": e.reward.degenerate, "n_frames": e.n_frames or 0,
                 "failed": e.failed is not None, "subagent_errors": e.subagent_errors,
                 "retokenized": e.retokenized_turns, "round_trip": e.round_trip_turns}
                for g in groups for e in g]
        zero = sum(1 for g in all_groups if len({round(e.reward.total, 9) for e in g}) == 1)
        eps = mine
        shared = {"zero": zero, "groups": len(all_groups), "stats": stats, "prompts": [p.id for p in prompts]}
        if self.world > 1:
            import torch.distributed as dist

            gathered: list = [None] * self.world
            dist.all_gather_object(gathered, (mine, shared))
            eps = [e for m, _ in gathered for e in m]
            shards = [s for _, s in gathered]
            shared = {"zero": sum(s["zero"] for s in shards), "groups": sum(s["groups"] for s in shards),
                      "prompts": [p for s in shards for p in s["prompts"]],
                      "stats": _merge_stats([s["stats"] for s in shards])}
        n = max(len(eps), 1)
        m = rollout_metrics([e["text"] for e in eps], [e["task"] for e in eps],
                            [e["terms"]["acc"] for e in eps], cfg.reward)
        rewards = torch.tensor([e["reward"] for e in eps]) if eps else torch.zeros(1)
        terms = {f"reward/{k}": sum(e["terms"].get(k, 0.0) for e in eps) / n
                 for k in (eps[0]["terms"] if eps else {})}
        return {
            "step": self.step,
            "prompts": shared["prompts"],
            "reward": float(rewards.mean()),
            "reward_std": float(rewards.std(unbiased=False)),
            **terms,
            "degenerate": sum(e["degenerate"] for e in eps) / n,
            "f_tau": m.get("format_reward", 0.0),
            "kappa": m.get("tool_calls_per_rollout", 0.0),
            **{k: v for k, v in m.items() if k.startswith(("closure/", "accuracy", "tool_call_rate"))},
            "n_frames": sum(e["n_frames"] for e in eps) / n,
            "zero_std_groups": shared["zero"],
            "groups": shared["groups"],
            "failed_episodes": sum(e["failed"] for e in eps),
            "subagent_errors": sum(e["subagent_errors"] for e in eps),
            "retokenized_turns": sum(e["retokenized"] for e in eps),
            # model calls whose prompt ids the server did not report (emulated round trip: SGLang < 0.5.19)
            "round_trip_turns": sum(e["round_trip"] for e in eps),
            "replayed": replayed,
            **shared["stats"],
        }

    # ------------------------------------------------------------------ offline loop

    def prompts_for(self, step: int, prompts: list[PromptItem]) -> list[PromptItem]:
        """The prompts of ``step``: epoch-shuffled order, ``prompts_per_step`` at a time, ranks interleaved."""
        P = self.cfg.prompts_per_step
        out = []
        for j in range(step * P, (step + 1) * P):
            epoch, pos = divmod(j, len(prompts))
            out.append(prompts[data_order(len(prompts), self.cfg.seed, epoch)[pos]])
        return out[self.rank :: self.world] if self.world > 1 else out

    def evaluate(self, prompts: list[PromptItem]) -> dict:
        """Greedy held-out scores through the same agent graph, with `paravt-train eval`'s agent config and
        scorer: mean metric per task, overall, and tool calls per question."""
        from paravt_agent.agent import Agent
        from paravt_train.benchmarks import EvalItem
        from paravt_train.eval import evaluate_items
        from paravt_train.rewards import TASK_METRIC

        agent = Agent(policy=self.agent.policy, config=self.eval_agent_config())
        self.model.eval()
        items = [EvalItem("heldout", p.id, p.video, p.question, p.task,
                          json.dumps(p.answer) if isinstance(p.answer, list) else str(p.answer), p.options, p.task)
                 for p in prompts]
        records = agent.run(evaluate_items(agent, items, concurrency=self.cfg.concurrency * 2, progress=self.progress))
        by: dict[str, list[float]] = {}
        for r in records:
            by.setdefault(r["task"], []).append(r[TASK_METRIC[r["task"]]])
        out = {f"eval/{t}": sum(v) / len(v) for t, v in sorted(by.items())}
        out["eval/accuracy"] = _mean(x for v in by.values() for x in v)
        out["eval/tool_calls"] = _mean(float(r["tool_calls"]) for r in records)
        out["eval/n"] = len(records)
        out["eval/scores"] = [r[TASK_METRIC[r["task"]]] for r in records]
        return out

    def run(self) -> dict:
        """The offline loop over ``data``; returns the final metrics (and held-out before/after)."""
        from tqdm.auto import tqdm

        from paravt_train.data import prompts_from_rl

        cfg = self.cfg
        if not cfg.data:
            raise ConfigError("grpo needs data: an RL Parquet file (see `paravt-train validate-data --kind rl`)")
        prompts = prompts_from_rl(cfg.data, cfg.video_root)
        if not prompts:
            raise ConfigError(f"{cfg.data} holds no prompts")
        self.setup()
        held = prompts_from_rl(cfg.eval_data, cfg.video_root, cfg.eval_limit) if cfg.eval_data else []
        summary: dict = {}
        if held and "eval_before" not in self.extra_state:
            self.extra_state["eval_before"] = self.evaluate(held)
            self.log("held-out before: " + _fmt(self.extra_state["eval_before"]))
        bar = tqdm(total=cfg.steps, initial=self.step, desc=f"{cfg.preset}", disable=not self.progress or self.rank)
        last = {}
        while self.step < cfg.steps:
            last = self.train_step(self.prompts_for(self.step, prompts), pool=prompts)
            bar.update(1)
            bar.set_postfix(reward=f"{last['reward']:.2f}", f_tau=f"{last['f_tau']:.2f}", kappa=f"{last['kappa']:.2f}")
            if self.step % cfg.save_every == 0 or self.step == cfg.steps:
                self.save()
        bar.close()
        final = self.save_model(self.out / "final")
        summary["final_model"] = str(final)
        summary["last_step"] = last
        if held:
            summary["eval_before"] = self.extra_state.get("eval_before")
            summary["eval_after"] = self.evaluate(held)
            self.log("held-out after:  " + _fmt(summary["eval_after"]))
        if self.rank == 0:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary


def _merge_stats(stats: list[dict]) -> dict:
    """Update statistics of every rank: sums of counts, token-weighted means of the rest."""
    out = {}
    total = sum(s.get("trained_tokens", 0) for s in stats) or 1
    for key in stats[0]:
        if key in ("sequences", "trained_tokens"):
            out[key] = sum(s[key] for s in stats)
        elif key in ("grad_norm", "loss"):
            out[key] = stats[0][key] if key == "grad_norm" else sum(s[key] for s in stats)
        else:
            out[key] = sum(s[key] * s.get("trained_tokens", 0) for s in stats) / total
    return out


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


def _fmt(d: dict) -> str:
    return "  ".join(f"{k.split('/', 1)[-1]} {v:.3f}" for k, v in d.items() if isinstance(v, float | int))
