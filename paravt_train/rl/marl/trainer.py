"""Multi-agent RL with several policies: :class:`MultiPolicyTrainer`, one :class:`~paravt_train.rl.trainer.GRPOTrainer`
per policy (its own weights, optimizer, metrics and checkpoints) over one team's rollouts (the step reads top to
bottom in :mod:`paravt_train.rl.marl`)."""

from __future__ import annotations

import asyncio
import time

from paravt_agent.agent import Agent
from paravt_agent.config import ModelSpec
from paravt_train.data.records import PromptItem
from paravt_train.rewards.multi_agent import TEAM_ROLES
from paravt_train.rl.config import GRPOConfig
from paravt_train.rl.rollout import Episode, PromptCache, RolloutSettings, run_group
from paravt_train.rl.trainer import GRPOTrainer

__all__ = ["MultiPolicyTrainer"]


class MultiPolicyTrainer:
    """``MultiPolicyTrainer({"a": cfg_a, "b": cfg_b}, {"scout": "a", "checker": "b"}).train_step(prompts)``: the
    first policy hosts the rollouts and its agent config names the pool; every agent maps to a policy."""

    def __init__(self, configs: dict[str, GRPOConfig], agents: dict[str, str], progress: bool = False, log=print):
        if not configs or set(agents.values()) - set(configs):
            raise ValueError(f"every agent needs one of the policies {list(configs)}, got {agents}")
        self.configs, self.agents, self.log = dict(configs), dict(agents), log
        self.host = next(iter(configs))
        self.trainers = {name: GRPOTrainer(cfg, progress=progress, log=log) for name, cfg in configs.items()}
        self._ready = False

    def agents_of(self, policy: str) -> set[str]:
        """The agents a policy's trainer trains (the host also the team's: the synthesizer's calls, and the summary's
        and failed rollouts' episodes, which train nothing)."""
        return {a for a, p in self.agents.items() if p == policy} | (set(TEAM_ROLES) if policy == self.host else set())

    def team_agent(self, config) -> Agent:
        """An agent of ``config`` whose pool runs on the live policies: the host's policy for its own agents, each
        other trainer's rollout policy for the agents mapped to it."""
        host = self.trainers[self.host]
        pool = []
        for a in config.collab.agents:
            p = self.agents.get(a.name, self.host)
            spec = None if p == self.host else ModelSpec(backend="local", model=self.configs[p].model)
            pool.append(a.model_copy(update={"model": spec}))
        cfg = config.model_copy(update={"collab": config.collab.model_copy(update={"agents": pool})})
        agent = Agent(policy=host.agent.policy, config=cfg, tool_policy=host.agent.tool_policy)
        for a in pool:
            if a.model is not None:  # the cache key AgentContext.policy_for uses: the live policy, never a reload
                agent._others[a.model.model_dump_json(exclude={"box_coordinates"})] = \
                    self.trainers[self.agents[a.name]].agent.policy
        return agent

    def setup(self) -> None:
        if self._ready:
            return
        for tr in self.trainers.values():
            tr.setup()
        host = self.trainers[self.host]
        if host.agent.config.mode != "collaborative" or host.agent.config.collab.protocol != "cpp":
            raise ValueError("multi-policy MARL trains the collaborative mode's cpp protocol: give the host policy "
                             "an agent config with mode collaborative")
        self.agent = self.team_agent(host.agent.config)
        self.cache = PromptCache(self.agent)
        self._ready = True

    def rollout(self, prompts: list[PromptItem]) -> list[list[Episode]]:
        """Every prompt's group, each rollout split into per-agent episodes (every agent's calls, whatever model
        made them: each trainer takes its own)."""
        host, cfg = self.trainers[self.host], self.configs[self.host]
        step = host.step

        async def one(i: int, p: PromptItem):
            settings = RolloutSettings(group=cfg.group_size, n_frames=host.n_frames_for(p), reward=cfg.reward,
                                       seed=cfg.seed * 1_000_003 + step * 101 + 7919 * i,
                                       subagents=cfg.train_subagents, tool_models=cfg.tool_model_calls == "train",
                                       tag=f"s{step}m{i}", agent_policies=[*self.agents, "team"],
                                       banned=tuple(host.chat.placeholder_ids))
            return await run_group(self.agent, self.cache, p, settings, host.eos_id)

        async def all_():
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

        for tr in self.trainers.values():
            tr.model.eval()
        return self.agent.run(all_())

    def train_step(self, prompts: list[PromptItem]) -> dict[str, dict]:
        """One rollout of the team, then one update of every policy on its agents' episodes; each policy's
        metrics (also in its output_dir's metrics.jsonl)."""
        self.setup()
        t0 = time.perf_counter()
        groups = self.rollout(prompts)
        timing = {"rollout_seconds": time.perf_counter() - t0}
        out = {}
        for name, tr in self.trainers.items():
            mine = self.agents_of(name)
            own = [[e for e in g if e.agent in mine] for g in groups]
            out[name] = tr.learn(own, own, prompts, dict(timing))
        return out

    def save_models(self) -> dict[str, str]:
        """Each policy's trained model, in its output_dir's ``final``."""
        return {name: str(tr.save_model(tr.out / "final")) for name, tr in self.trainers.items()}
