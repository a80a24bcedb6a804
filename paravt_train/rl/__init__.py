"""PARA-GRPO: the paper's RL stage, one folder by concept. The loop, top to bottom (``GRPOTrainer.run``)::
    config.py      GRPOConfig: every knob with the paper's value and its reference (presets para-grpo, vanilla-grpo,
                   dapo); loaded from YAML, overridden from the CLI
    for step in steps:
      step.py      step_prompts: this rank's prompts of the step (an epoch-shuffled order every rank agrees on)
      rollout.py   run_group: G rollouts per prompt through the agent graph itself (nFrames gating: one n per
                   prompt), each an Episode of token-exact sequences (planner turns, sub-agents; tool responses
                   masked), scored by paravt_train.rewards (R_acc + λ_fmt·R_fmt + R_tool)
      step.py      sample_groups: DAPO's dynamic sampling replaces groups that would train nothing
      objective.py episode_advantages: group-normalised advantages (failed episodes dropped); the clipped PPO
                   loss, KL, TAS, AVATAR's Eq. 11 — pure tensor functions
      step.py      replay_batch: AVATAR's replayed rollouts (replay.py: the stratified buffer) join the batch
      update.py    PolicyUpdate: items → padded micro-batches (every rank the same number of passes) → the loss →
                   ppo_epochs × mini_batches optimizer steps; behaviour-policy correction when rollouts are stale
      trainer.py   sync: the new weights onto the rollout servers (paravt_train.sync), every sync_every steps
      metrics.py   one line of metrics.jsonl over the ranks (f_τ, κ, closure rates, failures apart)
      checkpoints.py  atomic save every save_every steps, exact resume (replay buffers, frames by content)

- ``async_loop.py``: ``max_staleness`` η > 0: a rollout producer runs ahead of the trainer within η versions
  (AReaL's decoupled PPO objective in ``objective.py``); η = 0 is the loop above.
- ``online.py``: the same trainer fed from the trajectory store's feedback (``paravt-train online``).
"""

_LAZY = {
    "GRPOConfig": "paravt_train.rl.config",
    "ReplaySettings": "paravt_train.rl.config",
    "GRPOTrainer": "paravt_train.rl.trainer",
    "OnlineLearner": "paravt_train.rl.online",
    "Episode": "paravt_train.rl.rollout",
    "PromptItem": "paravt_train.rl.rollout",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):  # lazy: importing the config (the CLI's --help) does not import torch
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
