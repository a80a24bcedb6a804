"""The online learner's settings: ``online:`` of the run's :class:`~paravt_train.rl.config.GRPOConfig` (one YAML
configures the trainer and the learner) — :class:`OnlineSettings` (promotion cadence, per-user limits, refused
candidates kept), :class:`GateSettings` (the gate before a candidate serves) and :class:`RollbackSettings`.

They are defined beside the config that holds them (:mod:`paravt_train.rl.online_config`): ``rl/`` sits below
``online/`` (the learner holds a GRPO trainer), so ``GRPOConfig`` cannot import them from here without making the
two folders a cycle (tests/test_architecture.py). This module is where the learner's code reads them from.
"""

from paravt_train.rl.online_config import GateSettings, OnlineSettings, RollbackSettings

__all__ = ["GateSettings", "OnlineSettings", "RollbackSettings"]
