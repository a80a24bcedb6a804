"""ParaVT agent runtime: parallel video tool calling for long-video question answering.

``Agent(model=...).answer(video, question)`` is all a new user needs. Heavy
imports (torch, transformers, langgraph) happen lazily, on first use.
"""

from typing import TYPE_CHECKING

from paravt_agent.errors import ConfigError, ParaVTError, PolicyError, ToolError, VideoError

if TYPE_CHECKING:
    from paravt_agent.agent import Agent, Answer
    from paravt_agent.config import AgentConfig, FrameConfig
    from paravt_agent.policy.base import Generation, Policy, Sampling
    from paravt_agent.trajectory import Trace

__version__ = "0.1.0"

_LAZY = {
    "Agent": "paravt_agent.agent",
    "Answer": "paravt_agent.agent",
    "AgentConfig": "paravt_agent.config",
    "FrameConfig": "paravt_agent.config",
    "Generation": "paravt_agent.policy.base",
    "Policy": "paravt_agent.policy.base",
    "Sampling": "paravt_agent.policy.base",
    "Trace": "paravt_agent.trajectory",
}

__all__ = [
    "Agent",
    "AgentConfig",
    "Answer",
    "ConfigError",
    "FrameConfig",
    "Generation",
    "ParaVTError",
    "Policy",
    "PolicyError",
    "Sampling",
    "ToolError",
    "Trace",
    "VideoError",
    "__version__",
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'paravt_agent' has no attribute {name!r}")
