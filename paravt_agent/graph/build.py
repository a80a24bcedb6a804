"""``build_graph``: the agent graph's wiring (the nodes and the routing live in :mod:`~paravt_agent.graph.nodes`
and :mod:`~paravt_agent.graph.collab`). Only the retry policy and the timeouts (LangGraph's per-node settings)
are fixed at compile time; everything else a run needs comes from its context."""

from __future__ import annotations

from langgraph.graph import END, START, StateGraph
from langgraph.types import RetryPolicy

from paravt_agent.graph.calls import transient_error
from paravt_agent.graph.collab import collab_agent, collab_failed, collab_merge, route_collab, synthesize
from paravt_agent.graph.context import AgentContext
from paravt_agent.graph.nodes import (
    aggregate,
    finish,
    overview,
    planner,
    review,
    route_after_planner,
    route_begin,
    route_calls,
    route_start,
    subagent,
    subagent_failed,
)
from paravt_agent.graph.runtime import node_timeout
from paravt_agent.graph.state import AgentState

__all__ = ["build_graph"]


def build_graph(retries: int = 2, planner_timeout: float | None = None, subagent_timeout: float | None = None,
                *, checkpointer=None, context_schema=AgentContext, input_schema=None, output_schema=None,
                name: str = "paravt"):
    """Compile the agent graph. Only the retry policy and timeouts (LangGraph's per-node settings) are fixed at
    compile time; everything else a run needs comes from its context."""
    retry = RetryPolicy(max_attempts=retries + 1, initial_interval=0.5, retry_on=transient_error)
    g = StateGraph(AgentState, context_schema=context_schema, input_schema=input_schema or AgentState,
                   output_schema=output_schema or AgentState)
    g.add_node("overview", overview)
    g.add_node("planner", planner, retry_policy=retry, timeout=node_timeout(planner_timeout))
    g.add_node("review", review)
    # its input is a CallTask (a Send's payload), never the state's channels: no channels of its own to infer
    g.add_node("subagent", subagent, retry_policy=retry, timeout=node_timeout(subagent_timeout),
               error_handler=subagent_failed, input_schema=AgentState)
    g.add_node("aggregate", aggregate)
    g.add_node("finish", finish)
    g.add_node("collab_agent", collab_agent, retry_policy=retry, timeout=node_timeout(planner_timeout),
               error_handler=collab_failed)
    g.add_node("collab_merge", collab_merge)
    g.add_node("synthesize", synthesize, retry_policy=retry, timeout=node_timeout(planner_timeout))
    g.add_conditional_edges(START, route_start, ["overview", "planner", "collab_agent"])
    g.add_conditional_edges("overview", route_begin, ["planner", "collab_agent"])
    g.add_edge("collab_agent", "collab_merge")
    g.add_conditional_edges("collab_merge", route_collab, ["collab_agent", "synthesize"])
    g.add_edge("synthesize", "finish")
    g.add_conditional_edges("planner", route_after_planner, ["review", "subagent", "aggregate", "finish"])
    g.add_conditional_edges("review", route_calls, ["subagent", "aggregate"])
    g.add_edge("subagent", "aggregate")
    g.add_edge("aggregate", "planner")
    g.add_edge("finish", END)
    return g.compile(checkpointer=checkpointer, name=name)
