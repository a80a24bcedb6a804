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

The rollout backend comes by name from the policy registry
(:func:`paravt_agent.policy.registry.make_rollout_policy`): ``local`` (CPU or one GPU; the
rollout policy shares the trained parameters, so there is nothing to sync),
``sglang`` (rollouts on an SGLang server, the actor under ``torchrun`` + FSDP2;
after each update the weights go to the server, generation paused around the
swap: :mod:`paravt_train.sync.disk`), or any registered backend that returns
token ids. Every rank rolls out its share of the prompts; the step's metrics are gathered over all ranks.

The pieces, one concept a module: the update step (:mod:`paravt_train.rl.update`), the objective
(:mod:`paravt_train.rl.objective`), the step's metrics (:mod:`paravt_train.rl.metrics`), checkpoints
(:mod:`paravt_train.rl.checkpoints`, an object the trainer holds:
``self.checkpoints``), the exported model (:mod:`paravt_train.infra.checkpoint`; a LoRA run's adapter:
:mod:`paravt_train.infra.lora`), rollouts (:mod:`paravt_train.rl.rollout`).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import torch

from paravt_agent.agent import Agent
from paravt_agent.config import AgentConfig
from paravt_agent.errors import ConfigError
from paravt_agent.policy.chat import ChatTokenizer
from paravt_agent.policy.families import model_type_of_dir
from paravt_agent.policy.registry import make_rollout_policy
from paravt_train.data import PromptItem, prompts_from_rl
from paravt_train.eval import heldout_scores
from paravt_train.infra import lora
from paravt_train.infra.checkpoint import ServerExport, export_model, load_model_weights
from paravt_train.infra.distributed import (
    all_reduce_sum,
    barrier,
    device,
    init_distributed,
    on_rank0,
    raise_everywhere,
    rank_world,
    shard_model,
    train_device,
)
from paravt_train.infra.interrupt import GracefulStop
from paravt_train.infra.tracking import MetricsLog
from paravt_train.judge import LLMJudge
from paravt_train.methods import agent_config_for
from paravt_train.rl.agents import eval_agent_config, rollout_agent_config
from paravt_train.rl.async_loop import AsyncRollouts, require_served_policy, within_staleness
from paravt_train.rl.checkpoints import TrainerCheckpoints
from paravt_train.rl.config import GRPOConfig, check_served_sampling
from paravt_train.rl.frozen_tools import frozen_tool_policy
from paravt_train.rl.metrics import step_metrics
from paravt_train.rl.objective import episode_advantages
from paravt_train.rl.replay import ReplayBuffer
from paravt_train.rl.rollout import Episode, PromptCache, RolloutSettings, gate_frames, run_group
from paravt_train.rl.scoring import collate, token_logprobs
from paravt_train.rl.step import replay_batch, sample_groups, step_prompts
from paravt_train.rl.update import PolicyUpdate, UpdateItem, sampled_by_older
from paravt_train.sync import make_weight_sync, pushes_to, serving_dtype
from paravt_train.sync.base import renamed, renamed_attribute

__all__ = ["GRPOTrainer", "UpdateItem", "collate", "token_logprobs"]


class GRPOTrainer:
    """``GRPOTrainer(cfg).run()``; ``train_step(prompts)`` is the unit the online loop reuses. ``push_updates``:
    push the weights to the rollout server by itself (at setup, on resume, every ``sync.every`` updates); the online
    learner passes False and pushes only the versions it promotes (:meth:`sync`)."""

    def __init__(self, cfg: GRPOConfig, progress: bool = True, log=print, push_updates: bool = True):
        self.cfg = cfg
        self.progress = progress
        self.log = log
        self.out = Path(cfg.output_dir)
        self.step = 0
        self._ready = False
        self.producer = None  # the asynchronous loop's rollout producer (max_staleness > 0)
        self.stopped: str | None = None  # the signal that ended run() early
        self.restored_queue: dict | None = None  # its unused groups, from a checkpoint (stale_queue_on_resume)
        self.stale_prompts: list[str] = []  # train_step, η > 0: this rank's prompts whose groups were too stale
        self.push_updates = push_updates

    auto_sync = renamed_attribute("GRPOTrainer.auto_sync", "GRPOTrainer(cfg, push_updates=...)", "push_updates")
    update = renamed_attribute("GRPOTrainer.update", "GRPOTrainer.policy_update", "policy_update")

    # ------------------------------------------------------------------ agent configs

    def base_agent_config(self) -> AgentConfig:
        """The run's protocol with the method's agent settings (:func:`paravt_train.methods.agent_config_for`)."""
        return agent_config_for(self.cfg)

    def agent_config(self) -> AgentConfig:
        """The rollout agent (:func:`paravt_train.rl.agents.rollout_agent_config`)."""
        return rollout_agent_config(self.cfg)

    def eval_agent_config(self) -> AgentConfig:
        """The held-out agent, and the config saved with the trained model
        (:func:`paravt_train.rl.agents.eval_agent_config`)."""
        return eval_agent_config(self.cfg)

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        if self._ready:
            return
        from transformers import AutoModelForImageTextToText, AutoProcessor

        cfg = self.cfg
        if not Path(cfg.model).is_dir():
            raise ConfigError(f"model directory {cfg.model} does not exist (build one with `paravt-train toy`)")
        cuda = train_device(cfg.device, cfg.model)  # by the model's size, as the local backend places it
        init_distributed(cfg.collective_timeout_minutes, cuda=cuda)
        self.rank, self.world = rank_world()
        if self.world > 1 and cfg.prompts_per_step % self.world:
            raise ConfigError(f"prompts_per_step ({cfg.prompts_per_step}) must divide by the {self.world} training "
                              "processes: each one rolls out and trains on its share of the prompts")
        self.device = device(cuda)
        use_bf16 = cfg.bf16 == "true" or (cfg.bf16 == "auto" and self.device.type == "cuda")
        self.autocast_dtype = torch.bfloat16 if use_bf16 else None
        torch.manual_seed(cfg.seed)
        self.out.mkdir(parents=True, exist_ok=True)
        self.processor = AutoProcessor.from_pretrained(cfg.model)
        self.chat = ChatTokenizer(self.processor, model_type_of_dir(cfg.model))
        self.eos_id = self.chat.eos_id
        self.model = AutoModelForImageTextToText.from_pretrained(cfg.model, dtype=torch.float32).to(self.device)
        if cfg.lora.enabled:  # adapters only; the KL reference is the base with the adapter disabled (no copy)
            self.model = lora.wrap(self.model, cfg.lora)
        if cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.ref = None
        if cfg.kl_coef > 0 and not cfg.lora.enabled:  # the frozen reference: bf16 on GPUs, sharded like the actor
            ref_dtype = torch.bfloat16 if use_bf16 else torch.float32
            self.ref = AutoModelForImageTextToText.from_pretrained(cfg.model, dtype=ref_dtype).to(self.device)
            self.ref.eval().requires_grad_(False)
            if self.world > 1:
                self.ref = shard_model(self.ref)
        # the sync named by sync.via; the rollout requests name the adapter it serves the weights under, if any;
        # every push journals itself with a lease (paravt serve --sync-lease OUTPUT_DIR/push.json)
        sync = make_weight_sync(cfg, folder=self.out / "weights", export=self.export_for_server, device=self.device,
                                model=self.model, journal=self.out / "push.json" if self.rank == 0 else None)
        policy = make_rollout_policy(cfg.backend, cfg.model, cfg.endpoint, trained_model=self.model,
                                     processor=self.processor, max_batch=cfg.rollout_batch, lora=sync.adapter_name,
                                     api_key=cfg.sync.api_key(), autocast=self.autocast_dtype)
        if self.world > 1 and policy.generates_with(self.model):
            raise ConfigError(f"multi-process training needs a rollout server (backend: sglang): the {cfg.backend} "
                              "backend generates with the trained parameters in this process")
        if self.world > 1:
            self.model = shard_model(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        warm = cfg.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
        # nothing to push to a policy generating with the trained parameters; a server's weights: its admin API only
        self.syncer = sync if pushes_to(policy, self.model) else None
        if self.syncer is not None:  # a min-p the server's seeded sampler would die on, refused before any request
            check_served_sampling(policy, self.agent_config(), self.eval_agent_config())
        self.agent = Agent(policy=policy, config=self.agent_config())
        self.agent.tool_policy = frozen_tool_policy(self, self.agent)  # tool_model_calls freeze: the starting weights
        self.cache = PromptCache(self.agent)
        self.policy_update = PolicyUpdate(self.model, self.optimizer, self.scheduler, self.params, self.chat, cfg,
                                   self.device, self.world, ref=self.ref, autocast_dtype=self.autocast_dtype,
                                   eos_id=self.eos_id, log=self.log)
        self.judge = LLMJudge.from_settings(cfg.reward.judge) if cfg.reward.judge is not None else None
        self.replay = ReplayBuffer.from_settings(cfg.replay, cfg.seed)
        self.extra_state: dict = {}
        self.metrics = MetricsLog(self.out, cfg.report_to, cfg.model_dump(mode="json"), rank=self.rank)
        self.checkpoints = TrainerCheckpoints(self.out, self.rank, self.world, cfg.keep_checkpoints,
                                              keep_queue=cfg.stale_queue_on_resume == "keep", log=self.log)
        self._resume()  # starts self.metrics at the resumed step (a resumed run pushes its checkpoint's weights)
        if self.syncer is not None and self.step == 0 and self.push_updates:
            # a fresh run pushes its starting weights as version "0": the server may hold another policy (an earlier
            # run's pushes, another checkpoint), and step 1's rollouts must come from the policy they train
            self.push_weights()
        self._ready = True

    def _resume(self) -> None:
        """Continue from the newest checkpoint (``resume``): its step, weights, optimizer, replay buffer and
        ``extra_state``; the metrics restart at its step, and a resumed run pushes its weights."""
        self.model.train()
        restored = (self.checkpoints.resume(self.model, self.optimizer, self.scheduler, self.replay)
                    if self.cfg.resume else None)
        if restored is not None:
            self.step, self.extra_state, self.restored_queue = restored.step, restored.extra_state, restored.queue
        self.metrics.start(self.step if restored is not None else 0)  # drops the lines of steps to be redone
        if restored is None:
            return
        self.log(f"resumed from {restored.path} (step {self.step})")
        if self.syncer is not None and self.push_updates:
            self.push_weights()

    def save(self, extra_state: dict | None = None) -> Path:
        """A checkpoint of this step (:meth:`TrainerCheckpoints.save`: model, optimizer, scheduler, RNG, the extra
        state, every rank's replay buffer and, with ``stale_queue_on_resume: keep``, its unused rollouts); the
        ``keep_checkpoints`` newest are kept. ``extra_state``: what the trainer's holder keeps with the weights (the
        online learner's state; restored as :attr:`extra_state`), never read by the trainer."""
        if extra_state is not None:
            self.extra_state = extra_state
        keep = self.producer is not None and self.cfg.stale_queue_on_resume == "keep"
        return self.checkpoints.save(self.step, self.model, self.optimizer, self.scheduler, self.replay,
                                     self.extra_state, queue=self.producer.unused() if keep else None)

    def export(self, path: Path) -> Path:
        """The current weights as a version directory (every rank): a LoRA run's adapter, else the model."""
        return self.save_adapter(path) if self.cfg.lora.enabled else self.save_model(path)

    def load_weights(self, path: Path) -> None:
        """Continue from a saved version's weights (every rank): an adapter directory into a LoRA run's adapter, a
        model directory into the model; the optimizer's moments start again."""
        if lora.is_adapter_dir(path):
            lora.load_adapter(self.model, path)
        else:
            load_model_weights(self.model, path, self.rank, self.world)
        self.optimizer.state.clear()

    def save_model(self, path: Path) -> Path:
        """A plain model directory (+ the agent config it was trained with, greedy, its frame protocol bound to the
        model's geometry) that the agent loads (a LoRA run's adapter merged into a fresh copy of the base)."""
        agent = self.eval_agent_config().model_copy(update={"frames": self.agent.config.frames})
        if self.cfg.lora.enabled:
            return lora.export_merged(self.model, self.processor, self.cfg.model, path, self.cfg.lora, agent.to_yaml())
        return export_model(self.model, self.processor, path, agent.to_yaml())

    def save_adapter(self, path: Path) -> Path:
        """A LoRA run's adapter directory (peft's layout: what SGLang's /load_lora_adapter loads)."""
        return lora.save_adapter(self.model, path, self.cfg.lora, self.cfg.model)

    def export_for_server(self, model, path: Path) -> Path:
        """The model directory a server loads for ``sync.via: disk`` (:class:`ServerExport`: the serving dtype,
        only the parts that changed since the last export rewritten); every rank calls it."""
        if self.cfg.lora.enabled:
            return self.save_adapter(path)
        if getattr(self, "_server_export", None) is None or self._server_export.path != Path(path):
            agent = self.eval_agent_config().model_copy(update={"frames": self.agent.config.frames})
            self._server_export = ServerExport(Path(path), self.processor,
                                               serving_dtype(self.cfg.sync.dtype, self.device), agent.to_yaml())
        return self._server_export.write(model)

    def push_weights(self) -> dict | None:
        """Push the current weights to the rollout server as version ``str(step)`` (nothing to do for an in-process
        policy). Every rank calls it (:mod:`paravt_train.sync`: the disk sync exports the model once from the shards;
        the streamed syncs gather one parameter at a time onto rank 0 while it sends bucket after bucket)."""
        if self.syncer is None:
            return None
        result, error = None, None
        try:
            result = self.syncer.push(self.model, version=str(self.step), rank=self.rank)
        except Exception as exc:  # noqa: BLE001 (raised after the barrier: no rank is left waiting)
            error = exc
        barrier()  # no rank rolls out again before the server holds the new weights
        raise_everywhere(error, "the weight sync")
        return result

    def sync(self) -> dict | None:
        """Deprecated: :meth:`push_weights`."""
        renamed("GRPOTrainer.sync", "GRPOTrainer.push_weights")
        return self.push_weights()

    # ------------------------------------------------------------------ rollouts

    def n_frames_for(self, prompt: PromptItem) -> int | None:
        return gate_frames(self.cfg.seed, prompt.id, self.cfg.gating_choices) if self.cfg.gating else None

    def rollout(self, prompts: list[PromptItem], salt: int = 0, step: int | None = None) -> list[list[Episode]]:
        """``[episodes of prompt 1 (G), episodes of prompt 2, ...]`` for the prompts of ``step`` (default: the
        next one; the asynchronous loop rolls out ahead)."""
        cfg = self.cfg
        step = self.step if step is None else step
        sem = asyncio.Semaphore(cfg.concurrency)

        repeat = [sum(q.id == p.id for q in prompts[:i]) for i, p in enumerate(prompts)]

        async def one(i: int, p: PromptItem):
            # the tag makes every draw's episode ids unique: the same prompt drawn twice in a step (at an epoch
            # boundary) is two groups, never one id for two rollouts (ids key the per-episode loss normaliser),
            # and the repeat samples with its own seed (else it would repeat the first group token for token)
            settings = RolloutSettings(group=cfg.group_size, n_frames=self.n_frames_for(p), reward=cfg.reward,
                                       seed=cfg.seed * 1_000_003 + step * 101 + salt + 7919 * repeat[i],
                                       subagents=cfg.train_subagents, judge=self.judge,
                                       tool_models=cfg.tool_model_calls == "train",
                                       tag=f"s{step}r{self.rank}x{salt}d{i}", banned=tuple(self.chat.placeholder_ids))
            async with sem:
                return await run_group(self.agent, self.cache, p, settings, self.eos_id)

        async def all_():
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

        if self.syncer is None:  # the policy generates with the trained model itself
            self.model.eval()
        return self.agent.run(all_())

    def advantages(self, group: list[Episode]) -> list[Episode]:
        """Group-normalised advantages over the group's usable episodes (failed ones dropped unless kept);
        returns the episodes that train."""
        cfg = self.cfg
        return episode_advantages(group, cfg.failed_episodes == "keep", cfg.advantage_scale, cfg.advantage_eps)

    # ------------------------------------------------------------------ one step

    def _sample_groups(self, prompts: list[PromptItem], pool: list[PromptItem] | None):
        """The step's groups and every group rolled out (:func:`paravt_train.rl.step.sample_groups`)."""
        cfg = self.cfg
        rng = random.Random(cfg.seed * 7919 + self.step * 131 + self.rank)
        return sample_groups(self.rollout, prompts, pool if cfg.dynamic_sampling else None, cfg.max_sampling_rounds,
                             cfg.failed_episodes == "keep", rng)

    def train_step(self, prompts: list[PromptItem], pool: list[PromptItem] | None = None) -> dict:
        """Rollouts for ``prompts`` (this rank's share), one policy update, a sync; returns the step's
        metrics, gathered over all ranks. ``pool`` feeds dynamic sampling.

        With ``max_staleness`` η > 0 (the online learner's asynchronous setting) the update takes the
        asynchronous loop's bound and objective: groups sampled more than η versions before this update (a
        served policy that lags the trainer) are dropped, counted in ``dropped_stale`` and their prompts kept
        in ``stale_prompts`` (this rank's), and the rest train with decoupled PPO."""
        self.setup()
        t0 = time.perf_counter()
        groups, all_groups = self._sample_groups(prompts, pool)
        timing = {"rollout_seconds": time.perf_counter() - t0}
        self.stale_prompts = []
        if self.cfg.max_staleness > 0:
            require_served_policy(self)
            groups, stale = within_staleness(groups, self.step, self.cfg.max_staleness)
            self.stale_prompts = [g[0].prompt_id for g in stale if g]
            timing["dropped_stale"] = len(stale)
        return self.learn(groups, all_groups, prompts, timing)

    def learn(self, groups, all_groups, prompts: list[PromptItem], timing: dict) -> dict:
        """The update on rolled-out groups, the sync, the step's line of ``metrics.jsonl`` (``timing`` joins it)."""
        cfg = self.cfg
        failed = [e.failed for g in groups for e in g if e.failed]
        if failed:  # counted in the metrics; said here, with the first reason (an unreadable video names itself)
            self.log(f"step {self.step + 1} (rank {self.rank}): {len(failed)} episodes failed, e.g. {failed[0]}")
        # rollouts a server sampled with older weights than these (sync.every > 1, η > 0) are corrected, not
        # trained as on-policy: the versions the server reported say which (under η > 0 none reported: older)
        items = [UpdateItem(sequence=s, advantage=e.advantage,
                                stale=sampled_by_older(e.versions, self.step, cfg.max_staleness))
                 for g in groups for e in self.advantages(g) for s in e.sequences]
        replayed, n_drawn = replay_batch(self.replay, cfg, groups, self.world) if cfg.replay.enabled else ([], 0)
        t1 = time.perf_counter()
        stats = self.policy_update(items + replayed, step=self.step)  # the step seeds the mini-batch shuffle
        t_upd = time.perf_counter() - t1
        self.step += 1
        t2 = time.perf_counter()
        if self.syncer is not None and self.push_updates and self.step % cfg.sync.every == 0:
            self.push_weights()
        t_sync = time.perf_counter() - t2
        rec = step_metrics(self.step, groups, all_groups, prompts, stats, n_drawn, cfg, self.world)
        if "dropped_stale" in timing and self.world > 1:  # every rank has the key (the same settings): all ranks'
            timing = {**timing, "dropped_stale": int(all_reduce_sum([timing["dropped_stale"]])[0])}
        rec.update(**timing, update_seconds=t_upd, sync_seconds=t_sync, lr=self.scheduler.get_last_lr()[0],
                   time=time.time())
        self.metrics.log(rec)  # metrics.jsonl and the report_to trackers, rank 0 only
        return rec

    def close(self) -> None:
        """Ends the trackers' runs (metrics.jsonl needs nothing)."""
        if self._ready:
            self.metrics.close()

    # ------------------------------------------------------------------ offline loop

    def prompts_for(self, step: int, prompts: list[PromptItem]) -> list[PromptItem]:
        """This rank's prompts of ``step`` (:func:`paravt_train.rl.step.step_prompts`)."""
        return step_prompts(prompts, step, self.cfg.prompts_per_step, self.cfg.seed, self.rank, self.world)

    def evaluate(self, prompts: list[PromptItem]) -> dict:
        """Greedy held-out scores through the same agent graph, with `paravt-train eval`'s agent config and
        scorer: mean metric per task, overall, and tool calls per question."""

        self.model.eval()
        return heldout_scores(self.agent.policy, self.eval_agent_config(), prompts, self.cfg.concurrency * 2,
                              self.progress)

    def evaluate_once(self, prompts: list[PromptItem]) -> dict:
        """:meth:`evaluate` on rank 0 only (the policy it asks is the rollout server, or this process's model
        when there is one rank), its scores given to every rank."""
        return on_rank0(lambda: self.evaluate(prompts), "the held-out evaluation")

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
        held = prompts_from_rl(cfg.eval.data, cfg.video_root, cfg.eval.limit) if cfg.eval.data else []
        summary: dict = {}
        if held and "eval_before" not in self.extra_state:
            self.extra_state["eval_before"] = self.evaluate_once(held)
            self.log("held-out before: " + _fmt(self.extra_state["eval_before"]))
        bar = tqdm(total=cfg.steps, initial=self.step, desc=f"{cfg.method}", disable=not self.progress or self.rank)
        last = {}
        self.producer = AsyncRollouts(self, prompts, self.restored_queue) if cfg.max_staleness else None
        with GracefulStop() as stop:
            while self.step < cfg.steps:  # η > 0: the producer rolls out ahead; η = 0: rollouts, then the update
                last = (self.producer.train_step() if self.producer else
                        self.train_step(self.prompts_for(self.step, prompts), pool=prompts))
                bar.update(1)
                bar.set_postfix(reward=f"{last['reward']:.2f}", f_tau=f"{last['f_tau']:.2f}",
                                kappa=f"{last['kappa']:.2f}")
                asked = self.step < cfg.steps and stop.requested()  # SIGTERM: keep this step, end the run
                if asked or self.step % cfg.save_every == 0 or self.step == cfg.steps:
                    self.save()
                if asked:
                    self.stopped = stop.signal_name
                    break
        bar.close()
        if self.producer is not None:
            self.producer.stop()
        self.close()
        if self.stopped:
            self.log(f"stopped by {self.stopped} after step {self.step}: checkpoint-{self.step} holds it; run again "
                     "with resume: true (the default) to continue")
            return {"stopped": self.stopped, "last_step": last, "checkpoint": str(self.out / f"checkpoint-{self.step}")}
        final = self.save_model(self.out / "final")
        summary["final_model"] = str(final)
        summary["last_step"] = last
        if held:
            summary["eval_before"] = self.extra_state.get("eval_before")
            summary["eval_after"] = self.evaluate_once(held)
            self.log("held-out after:  " + _fmt(summary["eval_after"]))
        if self.rank == 0:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary


def _fmt(d: dict) -> str:
    return "  ".join(f"{k.split('/', 1)[-1]} {v:.3f}" for k, v in d.items() if isinstance(v, float | int))

