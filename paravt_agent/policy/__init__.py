"""Policies: the model behind the graph. One async interface, several backends (see :mod:`.registry`)."""

from paravt_agent.policy.base import Policy
from paravt_agent.policy.registry import available_policies, make_policy, make_rollout_policy, register_policy
from paravt_agent.types import Continuation, Generation, Sampling

__all__ = ["Continuation", "Generation", "Policy", "Sampling", "available_policies", "make_policy",
           "make_rollout_policy", "register_policy"]
