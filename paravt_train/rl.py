"""The PARA-GRPO trainer: rollouts through the agent graph → rewards → group advantages → clipped
policy update → weight sync → metrics.

One step (``prompts_per_step`` prompts × ``group_size`` rollouts)::

    prompts ──► run_group (Agent graph, G concurrent rollouts, n from nFrames gating)
            ──► score (R_acc + λ_fmt R_fmt + R_tool + bias)  ──► group_advantages
            ──► sequences (planner + sub-agents, sampled tokens only in the loss)
            ──► [replayed sequences from the AVATAR buffer, weight α]
            ──► ppo_epochs × micro-batches: clipped ratio + KL(ref) ──► AdamW step
            ──► weight sync (in process | SGLang, from disk or as tensors) ──► metrics.jsonl

Backends: ``local`` (CPU or one GPU; the rollout policy shares the trained
parameters, so the sync is a no-op) and ``sglang`` (rollouts on an SGLang server,
the actor under ``torchrun`` + FSDP2; after each update rank 0 sends the full
weights to the server, generation paused around the swap: :mod:`paravt_train.weight_sync`).

Presets: ``para-grpo`` (anchor reward, think prefix, nFrames gating on) and
``vanilla-grpo`` (all three off); every component is its own field, so the
paper's ablations (Table 2, Block B) are config overrides.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from paravt_agent.config import AgentConfig
from paravt_agent.errors import ConfigError
from paravt_train.grpo_config import PRESETS, GRPOConfig, PromptItem, ReplaySettings, prompts_from_rl
from paravt_train.plot import plot
from paravt_train.rewards import rollout_metrics
from paravt_train.weight_sync import SGLangTensorSync, SGLangWeightSync

__all__ = [
    "PRESETS",
    "GRPOConfig",
    "GRPOTrainer",
    "PromptItem",
    "ReplaySettings",
    "SGLangTensorSync",
    "SGLangWeightSync",
    "plot",
    "prompts_from_rl",
    "token_logprobs",
]


# --------------------------------------------------------------------------- tensors


def _collate(seqs, processor, pad_id: int, image_id: int) -> dict:
    """Right-padded ids / masks / behaviour logprobs of sequences, with their images' pixel values."""
    import torch

    n = max(len(s.input_ids) for s in seqs)
    B = len(seqs)
    ids = torch.full((B, n), pad_id, dtype=torch.long)
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
    batch = {"input_ids": ids, "attention_mask": att, "mm_token_type_ids": (ids == image_id).long(),
             "loss_mask": mask, "behaviour_logp": blp}
    if images:
        enc = processor.image_processor(images=images, return_tensors="pt")
        batch["pixel_values"], batch["image_grid_thw"] = enc["pixel_values"], enc["image_grid_thw"]
    return batch


def token_logprobs(model, batch: dict, temperature: float, entropy: bool = False):
    """Log-probabilities (under temperature τ, as sampled) of tokens 1..T given their prefixes: (B, T-1).

    Logits are computed only at the positions that predict a trained token (``logits_to_keep``):
    a 64-frame prompt is ~17K tokens, a response ~2K, and full-vocabulary logits over the prompt
    would dominate memory. Other positions are 0.
    """
    import torch

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

    def agent_config(self) -> AgentConfig:
        cfg = self.cfg
        path = cfg.agent_config or (Path(cfg.model) / "agent_config.yaml")
        base = AgentConfig.from_yaml(path) if Path(path).is_file() else AgentConfig()
        if cfg.agent_config and not Path(cfg.agent_config).is_file():
            raise ConfigError(f"agent config {cfg.agent_config} does not exist")
        return base.model_copy(update={
            "mode": "parallel",
            "think_prefix": "<think>\n" if cfg.think_prefix else "",
            "planner_sampling": base.planner_sampling.model_copy(update={
                "temperature": cfg.temperature, "top_p": cfg.top_p, "max_new_tokens": cfg.max_new_tokens}),
            "subagent_sampling": base.subagent_sampling.model_copy(update={
                "temperature": cfg.temperature, "top_p": cfg.top_p, "max_new_tokens": cfg.subagent_max_new_tokens}),
        })

    def setup(self) -> None:
        if self._ready:
            return
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        from paravt_agent.agent import Agent
        from paravt_train.grpo import ReplayBuffer
        from paravt_train.rollout import PromptCache
        from paravt_train.sft import _dist, _maybe_init_distributed, _shard

        cfg = self.cfg
        if not Path(cfg.model).is_dir():
            raise ConfigError(f"model directory {cfg.model} does not exist (build one with `paravt-train toy`)")
        _maybe_init_distributed()
        self.rank, self.world = _dist()
        if self.world > 1 and cfg.backend == "local":
            raise ConfigError("multi-process training needs backend: sglang (the local backend generates with "
                              "the trained parameters in this process)")
        if self.world > 1 and cfg.prompts_per_step % self.world:
            raise ConfigError(f"prompts_per_step ({cfg.prompts_per_step}) must divide by the {self.world} training "
                              "processes: each one rolls out and trains on its share of the prompts")
        self.device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
        torch.manual_seed(cfg.seed)
        self.out.mkdir(parents=True, exist_ok=True)
        self.processor = AutoProcessor.from_pretrained(cfg.model)
        tok = self.processor.tokenizer
        self.eos_id = tok.convert_tokens_to_ids("<|im_end|>")
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.eos_id
        self.image_id = tok.convert_tokens_to_ids(self.processor.image_token)
        self.model = AutoModelForImageTextToText.from_pretrained(cfg.model, dtype=torch.float32).to(self.device)
        if cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.ref = None
        if cfg.kl_coef > 0:
            self.ref = AutoModelForImageTextToText.from_pretrained(cfg.model, dtype=torch.float32).to(self.device)
            self.ref.eval().requires_grad_(False)
        if self.world > 1:
            self.model = _shard(self.model)
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
            self.syncer = (SGLangTensorSync(url, tp_size=cfg.sglang_tp_size) if cfg.weight_sync == "tensor"
                           else SGLangWeightSync(url, self.out / "weights"))
        self.agent = Agent(policy=policy, config=self.agent_config())
        self.cache = PromptCache(self.agent)
        self.replay = ReplayBuffer(capacity=cfg.replay.capacity, tiers=cfg.replay.tiers, alpha=cfg.replay.alpha,
                                   baseline_window=cfg.replay.baseline_window, seed=cfg.seed)
        self.extra_state: dict = {}
        self._resume()
        self._ready = True

    # ------------------------------------------------------------------ checkpoints

    def _latest(self) -> Path | None:
        ckpts = sorted(self.out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        done = [c for c in ckpts if (c / "trainer_state.json").is_file()]
        return done[-1] if done else None

    def _resume(self) -> None:
        from paravt_train.sft import load_blobs, load_checkpoint

        latest = self._latest() if self.cfg.resume else None
        metrics = self.out / "metrics.jsonl"
        if latest is None:  # a fresh start: metrics of an earlier attempt that never checkpointed go
            if metrics.exists():
                metrics.unlink()
            return
        self.model.train()
        self.step = load_checkpoint(latest, self.model, self.optimizer, self.scheduler)
        blobs = load_blobs(latest)
        if "replay" in blobs:
            self.replay.items = blobs["replay"]["items"]
            self.replay.history.update(blobs["replay"]["history"])
            self.replay._rng.setstate(blobs["replay"]["rng"])
        self.extra_state = blobs.get("extra_state", {})
        if metrics.exists():  # drop lines of steps after the checkpoint: they will be redone
            keep = [ln for ln in metrics.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= self.step]
            metrics.write_text("".join(ln + "\n" for ln in keep))
        self.log(f"resumed from {latest} (step {self.step})")
        if self.syncer is not None:
            self.sync()

    def save(self) -> Path:
        from paravt_train.sft import save_checkpoint

        path = self.out / f"checkpoint-{self.step}"
        blobs = {"replay": {"items": self.replay.items, "history": dict(self.replay.history),
                            "rng": self.replay._rng.getstate()},
                 "extra_state": self.extra_state}
        save_checkpoint(path, self.model, self.optimizer, self.scheduler, self.step, blobs=blobs)
        for old in self.out.glob("checkpoint-*"):  # keep the two newest
            if old.is_dir() and old.suffix != ".tmp" and int(old.name.split("-")[1]) < self.step - self.cfg.save_every:
                shutil.rmtree(old, ignore_errors=True)
        return path

    def full_state_dict(self) -> dict:
        """The whole model's parameters by their Hugging Face names (gathered from every rank under FSDP2)."""
        if self.world > 1:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        return self.model.state_dict()

    def save_model(self, path: Path) -> Path:
        """A plain model directory (+ the agent config it was trained with) that the agent loads."""
        from paravt_train.sft import _dist

        path = Path(path)
        if self.world > 1:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            sd = None
        if _dist()[0] == 0:
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
            import yaml

            cfg = self.agent.config.model_copy(update={"planner_sampling": self.agent.config.planner_sampling.model_copy(
                update={"temperature": 0.0}), "subagent_sampling": self.agent.config.subagent_sampling.model_copy(
                update={"temperature": 0.0})})
            (tmp / "agent_config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
            shutil.rmtree(path, ignore_errors=True)
            tmp.rename(path)
        return path

    def sync(self) -> dict | None:
        """Push the current weights to the rollout server (no-op for the local backend)."""
        if self.syncer is None:
            return None
        from paravt_train.sft import _barrier

        if isinstance(self.syncer, SGLangTensorSync):
            state = self.full_state_dict()
            result = self.syncer.push(state.items()) if self.rank == 0 else None
        else:
            path = self.save_model(self.out / "weights" / "current")
            result = self.syncer.push(path) if self.rank == 0 else None
        _barrier()  # no rank rolls out again before the server holds the new weights
        return result

    # ------------------------------------------------------------------ rollouts

    def n_frames_for(self, prompt: PromptItem) -> int | None:
        from paravt_train.rollout import gate_frames

        return gate_frames(self.cfg.seed, prompt.id, self.cfg.gating_choices) if self.cfg.gating else None

    def rollout(self, prompts: list[PromptItem]) -> list:
        """``[episodes of prompt 1 (G), episodes of prompt 2, ...]``."""
        import asyncio

        from paravt_train.rollout import run_group

        cfg = self.cfg
        sem = asyncio.Semaphore(cfg.concurrency)

        async def one(p: PromptItem):
            async with sem:
                return await run_group(
                    self.agent, self.cache, p.id, p.video, p.question, p.options, p.answer, p.task,
                    cfg.group_size, self.n_frames_for(p), self.eos_id, cfg.reward,
                    seed=cfg.seed * 1_000_003 + self.step, subagents=cfg.train_subagents,
                )

        async def all_():
            return await asyncio.gather(*(one(p) for p in prompts))

        self.model.eval()
        return self.agent.run(all_())

    # ------------------------------------------------------------------ update

    def _update(self, items: list[tuple]) -> dict:
        """``items``: (sequence, advantage, weight, use_behaviour_logp). One or more optimizer steps."""
        import torch

        from paravt_train.grpo import policy_loss, temporal_weights

        cfg = self.cfg
        if not items:
            return {"kl": 0.0, "clip_fraction": 0.0, "entropy": 0.0, "grad_norm": 0.0, "loss": 0.0}
        items = sorted(items, key=lambda x: -len(x[0].input_ids))
        micro = [items[i : i + cfg.micro_batch_size] for i in range(0, len(items), cfg.micro_batch_size)]
        # Under FSDP every rank must run the same number of forward/backward passes (each one is a
        # collective) and gradients are AVERAGED over ranks: ranks share the global counts, a rank with
        # fewer micro-batches repeats its last one with weight 0, and each rank's loss is its share of the
        # global mean times the world size.
        counts = [len(items), sum(sum(s.loss_mask[1:]) for s, *_ in items), len(micro)]
        if self.world > 1:
            import torch.distributed as dist

            t = torch.tensor(counts[:2], dtype=torch.float64)
            dist.all_reduce(t)
            m = torch.tensor([counts[2]])
            dist.all_reduce(m, op=dist.ReduceOp.MAX)
            counts = [int(t[0]), float(t[1]), int(m)]
        n_seq, n_tok, n_micro = counts[0], float(counts[1]), counts[2]
        batches = []
        for j in range(n_micro):
            chunk = micro[min(j, len(micro) - 1)]
            b = _collate([c[0] for c in chunk], self.processor, self.pad_id, self.image_id)
            b = {k: v.to(self.device) for k, v in b.items()}
            b["adv"] = torch.tensor([c[1] for c in chunk], dtype=torch.float32, device=self.device)
            b["weight"] = torch.tensor([c[2] for c in chunk], dtype=torch.float32, device=self.device)
            mask = b["loss_mask"][:, 1:]
            if cfg.tas_lambda:
                tw = torch.ones_like(mask)
                for i, w in enumerate(temporal_weights([int(m.sum()) for m in mask], cfg.tas_lambda)):
                    tw[i, mask[i] > 0] = w.to(tw.device)
                b["token_weights"] = tw
            with torch.no_grad():
                if self.ref is not None:
                    b["ref_logp"], _ = token_logprobs(self.ref, b, cfg.temperature)
                recomputed, _ = token_logprobs(self.model, b, cfg.temperature)
            behaviour = b["behaviour_logp"][:, 1:]
            use_beh = torch.tensor([c[3] for c in chunk], device=self.device)[:, None]
            # on-policy samples: the update starts at ratio 1 (old = this model before the update);
            # replayed samples: importance ratio against the stored behaviour logprobs
            b["old_logp"] = torch.where(use_beh, behaviour, recomputed)
            b["mismatch"] = float(((recomputed - behaviour).abs() * mask).sum() / mask.sum().clamp(min=1))
            b["dummy"] = j >= len(micro)
            batches.append(b)
        stats = {"kl": 0.0, "clip_fraction": 0.0, "entropy": 0.0, "loss": 0.0}
        local_tok = float(sum(float(b["loss_mask"][:, 1:].sum()) for b in batches if not b["dummy"]))
        self.model.train()
        for _ in range(cfg.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for b in batches:
                mask = b["loss_mask"][:, 1:]
                logp, ent = token_logprobs(self.model, b, cfg.temperature, entropy=True)
                out = policy_loss(
                    logp, b["old_logp"], b["adv"], mask, clip=cfg.clip, ref_logp=b.get("ref_logp"),
                    kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator, aggregation=cfg.aggregation,
                    constant=float(cfg.max_new_tokens), token_weights=b.get("token_weights"),
                    sample_weights=b["weight"],
                )
                toks = float(mask.sum())
                share = toks / max(n_tok, 1.0) if cfg.aggregation == "token-mean" else len(b["adv"]) / n_seq
                if b["dummy"]:
                    (out.loss * 0.0).backward()
                    continue
                (out.loss * share * self.world).backward()
                frac = toks / max(local_tok, 1.0)
                stats["kl"] += out.kl * frac
                stats["clip_fraction"] += out.clip_fraction * frac
                stats["entropy"] += float((ent.detach() * mask).sum()) / max(local_tok, 1.0)
                stats["loss"] += float(out.loss.detach()) * share * self.world
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm)
            self.optimizer.step()
        self.scheduler.step()
        k = cfg.ppo_epochs
        stats = {key: v / k for key, v in stats.items()}
        stats["grad_norm"] = float(grad_norm)
        real = [b for b in batches if not b["dummy"]]
        stats["logprob_mismatch"] = sum(b["mismatch"] for b in real) / max(len(real), 1)
        stats["sequences"], stats["trained_tokens"] = n_seq, int(n_tok)
        return stats

    def train_step(self, prompts: list[PromptItem]) -> dict:
        """Rollouts for ``prompts``, one policy update, a sync; returns the step's metrics."""
        import torch

        from paravt_train.grpo import group_advantages

        self.setup()
        cfg = self.cfg
        t0 = time.perf_counter()
        groups = self.rollout(prompts)
        t_roll = time.perf_counter() - t0
        episodes = [e for g in groups for e in g]
        rewards = torch.tensor([e.reward.total for e in episodes])
        adv = group_advantages(rewards, cfg.group_size, eps=cfg.advantage_eps, scale=cfg.advantage_scale)
        items = []
        for e, a in zip(episodes, adv.tolist(), strict=True):
            e.advantage = a
            items.extend((s, a, 1.0, False) for s in e.sequences)
        replayed = []
        if cfg.replay.enabled and cfg.replay.per_step:
            for pid, seq, r in self.replay.sample(cfg.replay.per_step):
                replayed.append((seq, r - self.replay.baseline(pid), cfg.replay.alpha, True))
            for e in episodes:
                for s in e.sequences:
                    self.replay.add(e.prompt_id, s, e.reward.total)
        t1 = time.perf_counter()
        stats = self._update(items + replayed)
        t_upd = time.perf_counter() - t1
        self.step += 1
        t2 = time.perf_counter()
        if self.syncer is not None and self.step % cfg.sync_every == 0:
            self.sync()
        t_sync = time.perf_counter() - t2
        texts = [e.text for e in episodes]
        accs = [e.reward.acc for e in episodes]
        m = rollout_metrics(texts, [p.task for p in prompts for _ in range(cfg.group_size)], accs, cfg.reward)
        rec = {
            "step": self.step,
            "prompts": [p.id for p in prompts],
            "reward": float(rewards.mean()),
            "reward_std": float(rewards.std(unbiased=False)),
            "reward/acc": sum(accs) / len(accs),
            "reward/fmt": _mean(e.reward.fmt for e in episodes),
            "reward/base": _mean(e.reward.base for e in episodes),
            "reward/anchor": _mean(e.reward.anchor for e in episodes),
            "reward/tool": _mean(e.reward.tool for e in episodes),
            "degenerate": _mean(float(e.reward.degenerate) for e in episodes),
            "f_tau": m["format_reward"],
            "kappa": m["tool_calls_per_rollout"],
            **{k: v for k, v in m.items() if k.startswith(("closure/", "accuracy"))},
            "n_frames": _mean(float(e.n_frames or 0) for e in episodes),
            "zero_std_groups": sum(1 for g in groups if len({round(e.reward.total, 9) for e in g}) == 1),
            "replayed": len(replayed),
            **stats,
            "lr": self.scheduler.get_last_lr()[0],
            "rollout_seconds": t_roll,
            "update_seconds": t_upd,
            "sync_seconds": t_sync,
        }
        if self.rank == 0:
            with (self.out / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(rec) + "\n")
        return rec

    # ------------------------------------------------------------------ offline loop

    def prompts_for(self, step: int, prompts: list[PromptItem]) -> list[PromptItem]:
        """The prompts of ``step``: epoch-shuffled order, ``prompts_per_step`` at a time, ranks interleaved."""
        from paravt_train.sft import _order

        P = self.cfg.prompts_per_step
        out = []
        for j in range(step * P, (step + 1) * P):
            epoch, pos = divmod(j, len(prompts))
            out.append(prompts[_order(len(prompts), self.cfg.seed, epoch)[pos]])
        return out[self.rank :: self.world] if self.world > 1 else out

    def evaluate(self, prompts: list[PromptItem]) -> dict:
        """Greedy held-out accuracy / tool calls through the same agent graph."""
        from paravt_agent.agent import Agent
        from paravt_train.rewards import accuracy_reward

        cfg = self.agent.config
        greedy = cfg.model_copy(update={
            "planner_sampling": cfg.planner_sampling.model_copy(update={"temperature": 0.0}),
            "subagent_sampling": cfg.subagent_sampling.model_copy(update={"temperature": 0.0})})
        agent = Agent(policy=self.agent.policy, config=greedy)
        self.model.eval()
        answers = agent.answer_many([{"video": p.video, "question": p.question, "options": p.options,
                                      "n_frames": self.cfg.eval_n_frames} for p in prompts], progress=self.progress)
        by: dict[str, list[float]] = {}
        for p, a in zip(prompts, answers, strict=True):
            by.setdefault(p.task, []).append(accuracy_reward(a.trace.response, p.answer, p.task, p.options))
        out = {f"eval/{t}": sum(v) / len(v) for t, v in sorted(by.items())}
        out["eval/accuracy"] = _mean(x for v in by.values() for x in v)
        out["eval/tool_calls"] = _mean(float(a.trace.tool_calls) for a in answers)
        return out

    def run(self) -> dict:
        """The offline loop over ``data``; returns the final metrics (and held-out before/after)."""
        from tqdm.auto import tqdm

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
            last = self.train_step(self.prompts_for(self.step, prompts))
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


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


def _fmt(d: dict) -> str:
    return "  ".join(f"{k.split('/', 1)[-1]} {v:.3f}" for k, v in d.items())
