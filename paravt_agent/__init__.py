"""ParaVT agent runtime: parallel video tool calling for long-video question answering.

``Agent(model=...).answer(video, question)`` is all a new user needs. Heavy
imports (torch, transformers, langgraph) happen lazily, on first use. The types
that cross layers live in :mod:`paravt_agent.types`.
"""

from typing import TYPE_CHECKING

from paravt_agent.compat import MovedModules
from paravt_agent.errors import ConfigError, ParaVTError, PolicyError, PromptTooLong, ToolError, VideoError

if TYPE_CHECKING:
    from paravt_agent.agent import Agent
    from paravt_agent.config import AgentConfig
    from paravt_agent.policy.base import Policy
    from paravt_agent.trajectory import Trace
    from paravt_agent.types import (
        Answer,
        AnswerEvent,
        Generation,
        GenerationRecord,
        OverviewEvent,
        PlannedCall,
        PlannerEvent,
        ReviewEvent,
        RolloutInput,
        Sampling,
        SubAgentEvent,
    )
    from paravt_agent.video import FrameConfig

__version__ = "0.5.3"

#: module paths that moved when the package was regrouped by concept (v0.4): importable for one release, with a
#: DeprecationWarning naming the new path (:mod:`paravt_agent.compat`)
MOVED = {
    "paravt_agent.answers": "paravt_agent.protocol.answers",
    "paravt_agent.api": "paravt_agent.serving.api",
    "paravt_agent.api_request": "paravt_agent.serving.request",
    "paravt_agent.calls": "paravt_agent.graph.calls",
    "paravt_agent.checkpoints": "paravt_agent.graph.checkpoints",
    "paravt_agent.collab": "paravt_agent.graph.collab",
    "paravt_agent._moved": "paravt_agent.compat",
    "paravt_agent.context": "paravt_agent.graph.context",
    "paravt_agent.feedback": "paravt_agent.store.feedback",
    "paravt_agent.frames": "paravt_agent.graph.frames",
    "paravt_agent.graph.cpp": "paravt_agent.graph.collab.cpp",
    "paravt_agent.graph_runtime": "paravt_agent.graph.runtime",
    "paravt_agent.presets": "paravt_agent.protocol.presets",
    "paravt_agent.serve": "paravt_agent.serving.sglang_launch",
    "paravt_agent.server_graph": "paravt_agent.serving.server_graph",
    "paravt_agent.state": "paravt_agent.graph.state",
}
MovedModules.install(MOVED)

_LAZY = {
    "Agent": "paravt_agent.agent",
    "AgentConfig": "paravt_agent.config",
    "FrameConfig": "paravt_agent.video",
    "Policy": "paravt_agent.policy.base",
    "Trace": "paravt_agent.trajectory",
    **{name: "paravt_agent.types" for name in (
        "Answer", "AnswerEvent", "Generation", "GenerationRecord", "OverviewEvent", "PlannedCall", "PlannerEvent",
        "ReviewEvent", "RolloutInput", "Sampling", "SubAgentEvent")},
}

__all__ = [
    "Agent",
    "AgentConfig",
    "Answer",
    "AnswerEvent",
    "ConfigError",
    "FrameConfig",
    "Generation",
    "GenerationRecord",
    "OverviewEvent",
    "ParaVTError",
    "PlannedCall",
    "PlannerEvent",
    "Policy",
    "PolicyError",
    "PromptTooLong",
    "ReviewEvent",
    "RolloutInput",
    "Sampling",
    "SubAgentEvent",
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
