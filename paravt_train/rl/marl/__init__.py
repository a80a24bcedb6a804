"""Multi-agent RL (VideoChat-M1's agent team): each collaborating agent trained on its own turns with its own reward.

It is the GRPO loop applied per agent, so it lives inside ``rl/`` and imports it downward only:
:class:`~paravt_train.rl.marl.trainer.MultiPolicyTrainer` is several :class:`~paravt_train.rl.trainer.GRPOTrainer` s.
The rewards each agent is scored by are below both, in :mod:`paravt_train.rewards.multi_agent` (the loop's rollout
splits a collaborative (``cpp``) episode into one episode per agent with them).

- :mod:`~paravt_train.rewards.multi_agent`: each agent's reward, R_res + λ_fmt·R_format + w_col·R_col + R_tool (pure).
- :mod:`~paravt_train.rl.marl.trainer`: :class:`MultiPolicyTrainer`, several policies, each its own trainer.

One policy needs nothing here but the rewards: ``paravt-train grpo`` with a collaborative agent config (protocol
``cpp``) rolls out every agent with the one policy and trains each agent's turns with its own advantage
(:func:`~paravt_train.rl.rollout.agent_episodes`, :func:`~paravt_train.rl.objective.episode_advantages`).

With several policies, :class:`MultiPolicyTrainer` takes one :class:`~paravt_train.rl.config.GRPOConfig` per policy
and the pool's agents mapped to them. One step::

    rollouts: the first policy's trainer hosts the team (its agent config's collab pool); every other policy is
              that agent's own model (a ModelSpec), answered by the LIVE rollout policy of its trainer
    split:    each rollout into per-agent episodes (R_res + R_format + R_col + R_tool each), whatever model made
              the calls (``agent_policies``)
    learn:    each trainer on its own agents' episodes (the host also on the team's: the synthesizer's), each
              agent normalised over the group apart; its own update, metrics.jsonl, checkpoints

VideoChat-M1 trains its four agents this way (A.6: one GRPO objective per agent, a shared team reward average).
The team's call is credited by what it decided (:func:`~paravt_train.rewards.multi_agent.team_role`): without a
consensus the synthesizer's answer is the team's, and it trains with the team's reward, normalised over the
group's synthesizer episodes alone; with a consensus the vote is the answer, and the reason summary (which does not
change it) is not trained.
"""

from paravt_train.rewards.multi_agent import agent_reward, agent_transcript, team_role
from paravt_train.rl.marl.trainer import MultiPolicyTrainer

__all__ = ["MultiPolicyTrainer", "agent_reward", "agent_transcript", "team_role"]
