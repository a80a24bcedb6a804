"""ParaVT training: SFT cold start, PARA-GRPO (synchronous, asynchronous, online), evaluation, the toy world.

- :mod:`paravt_train.sft`: supervised fine-tuning on parallel tool traces.
- :mod:`paravt_train.rl`: PARA-GRPO (the loop reads top to bottom in its docstring); multi-agent RL in
  :mod:`paravt_train.rl.marl`.
- :mod:`paravt_train.online`: online learning from user feedback (the loop reads top to bottom in its docstring).
- :mod:`paravt_train.sync`: the trained weights onto the SGLang servers that roll out.
- :mod:`paravt_train.data`, :mod:`paravt_train.eval`, :mod:`paravt_train.benchmarks`: data and the records it
  becomes (``PromptItem``), scoring, benchmarks.
- :mod:`paravt_train.rewards`: R = R_acc + λ_fmt·R_fmt + R_tool (pure); :mod:`paravt_train.toy`: the embedded world.
- :mod:`paravt_train.infra`: torchrun/FSDP2 helpers, checkpoints and the one atomic export, LoRA, SIGTERM, metrics
  trackers.
"""

from paravt_agent.compat import MovedModules

#: module paths that moved when the package was regrouped by concept (v0.4) and into rooms by concept (v0.5):
#: importable for one release, with a DeprecationWarning naming the new path
MOVED = {
    "paravt_train.async_rollouts": "paravt_train.rl.async_loop",
    "paravt_train.checkpoint": "paravt_train.infra.checkpoint",
    "paravt_train.convert": "paravt_train.data.convert",
    "paravt_train.distributed": "paravt_train.infra.distributed",
    "paravt_train.grpo": "paravt_train.rl.objective",
    "paravt_train.grpo_checkpoints": "paravt_train.rl.checkpoints",
    "paravt_train.grpo_config": "paravt_train.rl.config",
    "paravt_train.grpo_trainer": "paravt_train.rl.trainer",
    "paravt_train.interrupt": "paravt_train.infra.interrupt",
    "paravt_train.plot": "paravt_train.eval.plot",
    "paravt_train.prefilter": "paravt_train.data.prefilter",
    "paravt_train.replay": "paravt_train.rl.replay",
    "paravt_train.rl.agent_rewards": "paravt_train.rewards.multi_agent",
    "paravt_train.rl.marl.rewards": "paravt_train.rewards.multi_agent",
    "paravt_train.rl.gate": "paravt_train.online.gate",
    "paravt_train.rl.lora": "paravt_train.infra.lora",
    "paravt_train.rl.online": "paravt_train.online.learner",
    "paravt_train.rl.online_cli": "paravt_train.online.cli",
    "paravt_train.rl.online_config": "paravt_train.online.config",
    "paravt_train.rl.promotion": "paravt_train.online.promotion",
    "paravt_train.rl.versions": "paravt_train.online.versions",
    "paravt_train.rollout": "paravt_train.rl.rollout",
    "paravt_train.sft_config": "paravt_train.sft.config",
    "paravt_train.stats": "paravt_train.eval.stats",
    "paravt_train.step_metrics": "paravt_train.rl.metrics",
    "paravt_train.tensor_sync": "paravt_train.sync.streamed",
    "paravt_train.tracking": "paravt_train.infra.tracking",
    "paravt_train.update": "paravt_train.rl.update",
    "paravt_train.weight_sync": "paravt_train.sync.disk",
}
MovedModules.install(MOVED)
