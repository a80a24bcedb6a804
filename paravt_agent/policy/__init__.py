"""Policies: the model behind the graph. One async interface, several backends."""

from paravt_agent.policy.base import Generation, Policy, Sampling

__all__ = ["Generation", "Policy", "Sampling"]
