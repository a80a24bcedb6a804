"""The collaborative mode (VideoChat-M1): a pool of agents sharing a memory.

A dispatch mode of the same graph (``mode: collaborative``, settings in ``AgentConfig.collab``)::
    START ─(overview)─┬─ Send("collab_agent", agent 1) ─┐
                      ├─ …                               ├─→ collab_merge ─┬─ next turn (Send × agents)
                      └─ Send("collab_agent", agent N) ─┘                  └─ synthesize → finish

Two protocols share these nodes (``collab.protocol``):

* ``cpp`` (the default): VideoChat-M1's collaborative policy planning, :mod:`~paravt_agent.graph.collab.cpp` (plans, a
  decision after every tool step, per-agent answers, the consensus).
* ``rounds``: each round every agent (a name, and optionally its own model) sees the overview and the question,
  reads the shared memory of the rounds before (its own entries and those the others chose to share), writes its
  plan, calls tools (run exactly as a planner's calls: :func:`paravt_agent.graph.calls.run_call`), notes the key
  information it has so far, and decides whether to share its entry. A synthesizer — the agent's policy, as the
  planner — answers strictly from the memory.

Every agent's model call is a record of role ``agent:<name>``: where the agent uses the agent's policy, RL trains
it (the single-policy case, each agent with its own advantage under ``cpp``); an agent with its own model is
recorded and trained only by a trainer of that model (``paravt_train.rl.marl``).

The folder: :mod:`~paravt_agent.graph.collab.rounds` (the nodes both protocols share, and the ``rounds`` protocol),
:mod:`~paravt_agent.graph.collab.cpp` (VideoChat-M1's collaborative policy planning).
"""

from paravt_agent.graph.collab.cpp import (
    ANSWER_PROMPT,
    DECISION_PROMPT,
    PLAN_PROMPT,
    SUMMARY_PROMPT,
    agent_view,
    answer_key,
    answers_agree,
    consensus,
    cpp_agent,
    cpp_finish,
    cpp_route,
    dropped_agents,
    memory_views,
)
from paravt_agent.graph.collab.rounds import (
    AGENT_PROMPT,
    SYNTHESIZER_PROMPT,
    collab_agent,
    collab_failed,
    collab_merge,
    memory_view,
    route_collab,
    synthesize,
)

__all__ = ["AGENT_PROMPT", "ANSWER_PROMPT", "DECISION_PROMPT", "PLAN_PROMPT", "SUMMARY_PROMPT", "SYNTHESIZER_PROMPT",
           "agent_view", "answer_key", "answers_agree", "collab_agent", "collab_failed", "collab_merge",
           "consensus", "cpp_agent", "cpp_finish", "cpp_route", "dropped_agents", "memory_view",
           "memory_views", "route_collab", "synthesize"]
