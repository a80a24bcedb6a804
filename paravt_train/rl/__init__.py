"""PARA-GRPO: the paper's RL stage, one folder by concept. The loop, top to bottom (``GRPOTrainer.run``)::
    config.py      GRPOConfig: every knob with the paper's value and its reference (its ``method`` from
                   paravt_train.methods: para-grpo, vanilla-grpo, dapo, ...); loaded from YAML, overridden from the CLI
    for step in steps:
      step.py      step_prompts: this rank's prompts of the step (an epoch-shuffled order every rank agrees on)
      rollout.py   run_group: G rollouts per prompt (paravt_train.data's PromptItem) through the agent graph
                   itself (nFrames gating: one n per prompt), each an Episode of token-exact sequences (planner
                   turns, sub-agents; tool responses masked), scored by paravt_train.rewards (R_acc + λ_fmt·R_fmt +
                   R_tool); a collaborative episode split per agent (paravt_train.rewards.multi_agent: each
                   agent's own reward)
      step.py      sample_groups: DAPO's dynamic sampling replaces groups that would train nothing
      objective.py episode_advantages: group-normalised advantages (failed episodes dropped); the clipped PPO
                   loss, KL, TAS, AVATAR's Eq. 11 — pure tensor functions
      step.py      replay_batch: AVATAR's replayed rollouts (replay.py: the stratified buffer) join the batch
      update.py    PolicyUpdate: items → padded micro-batches (every rank the same number of passes) → the loss →
                   ppo_epochs × mini_batches optimizer steps; behaviour-policy correction when rollouts are stale
      trainer.py   push_weights: the new weights onto the rollout servers (paravt_train.sync), every sync.every
                   steps
      metrics.py   one line of metrics.jsonl over the ranks (f_τ, κ, closure rates, failures apart)
      checkpoints.py  atomic save every save_every steps, exact resume (replay buffers, frames by content):
                   TrainerCheckpoints, an object the trainer holds; the exported model and LoRA: paravt_train.infra

- ``async_loop.py``: ``max_staleness`` η > 0: a rollout producer runs ahead of the trainer within η versions
  (AReaL's decoupled PPO objective in ``objective.py``); η = 0 is the loop above.
- ``agents.py``: the rollout and held-out agent configs; ``scoring.py``: ``collate`` and ``token_logprobs``.
- ``marl/``: multi-agent RL (VideoChat-M1): ``MultiPolicyTrainer`` (several policies, one GRPOTrainer each); it imports
  this folder, never the reverse.

Above this folder: :mod:`paravt_train.online` (the same trainer fed from the trajectory store's feedback,
``paravt-train online``). Below it: data/ (PromptItem), sync/, eval/, infra/ — nothing below imports rl/.
"""

_LAZY = {
    "GRPOConfig": "paravt_train.rl.config",
    "ReplaySettings": "paravt_train.rl.config",
    "GRPOTrainer": "paravt_train.rl.trainer",
    "Episode": "paravt_train.rl.rollout",
    "PromptItem": "paravt_train.data.records",
}
#: names that moved out of this folder: still given (with a DeprecationWarning naming the new place) for one release
_MOVED = {"OnlineLearner": "paravt_train.online"}
__all__ = sorted([*_LAZY, "trainer_class"])


def trainer_class(method: str) -> type:
    """The trainer a method (:mod:`paravt_train.methods`, which names none) runs with: every one trains with
    :class:`~paravt_train.rl.trainer.GRPOTrainer`; the name is checked (a typo is refused with the methods)."""
    # lazy: importing the package (the config, the CLI's --help) does not import the trainer (torch)
    from paravt_train.methods import method as method_of
    from paravt_train.rl.trainer import GRPOTrainer

    method_of(method)
    return GRPOTrainer


def __getattr__(name: str):  # lazy: importing the config (the CLI's --help) does not import torch
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _MOVED:
        import warnings

        from paravt_agent.compat import REMOVED_IN  # only a deprecated name pays for it

        warnings.warn(f"paravt_train.rl.{name} moved to {_MOVED[name]}.{name}; the old name goes away in {REMOVED_IN}",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
