"""The agent as a LangGraph graph: planner → ``Send`` × K sub-agents → aggregator → planner → … → finish.

::
    START ─┬─ overview ─┐ (LangGraph Server: from a bare question)
           └────────────┴→ planner ─┬─ [review] ─┬─ Send("subagent", call 1) ─┐
                                    │            ├─ …                         ├─→ aggregate → planner …
                                    │            └─ Send("subagent", call K) ─┘
                                    └─ finish → END

- :mod:`~paravt_agent.graph.state`: the state (plain data: what a checkpointer saves), the way in and out.
- :mod:`~paravt_agent.graph.context`: the run context (policy, tools, config, frames, the open video) and the
  question → first prompt step.
- :mod:`~paravt_agent.graph.nodes`: the nodes and the routing; :mod:`~paravt_agent.graph.build`: the wiring.
- :mod:`~paravt_agent.graph.runtime`: what nodes share (the model call, time budgets that count work, events).
- :mod:`~paravt_agent.graph.calls`: one tool call, validated and run; :mod:`~paravt_agent.graph.collab`: the
  collaborative mode (VideoChat-M1).
- :mod:`~paravt_agent.graph.frames`: frames by content key; :mod:`~paravt_agent.graph.checkpoints`: savers.
"""

from paravt_agent.graph.build import build_graph
from paravt_agent.graph.runtime import DEFAULT_CONTEXT, event_json
from paravt_agent.graph.state import STATE_TYPES, AgentState, final_answer, initial_state, trace_of

__all__ = ["DEFAULT_CONTEXT", "STATE_TYPES", "AgentState", "build_graph", "event_json", "final_answer", "initial_state",
           "trace_of"]
