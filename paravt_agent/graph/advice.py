"""What to change when a run came back degraded or failed for lack of time: which setting ran out, by how much the
work needed more, and how to set it (a trace's ``advice``, printed under its status)."""

from __future__ import annotations

import math

from paravt_agent.config import AgentConfig
from paravt_agent.trajectory import Trace

__all__ = ["advice_for"]


def _raise_to(limit: float, slowest: float) -> int:
    """A new limit: twice the old one, and above the slowest finished call with a half's margin; rounded up to 10 s
    (to 1 s below 10 s)."""
    value = max(2 * limit, 1.5 * slowest)
    step = 10 if value >= 10 else 1
    return int(math.ceil(value / step) * step)


def _how(key: str, value: int) -> str:
    return (f"`paravt answer --set {key}={value}` (as `paravt api --set`), `{key}: {value}` in an agent config YAML, "
            f"or AgentConfig({key}={value}) in the SDK")


def advice_for(trace: Trace, config: AgentConfig) -> list[str]:
    """One line per setting a run's failures point at: ``subagent_timeout`` when tool calls timed out (how many, the
    limit, how long the calls that finished took, a value to raise it to), ``planner_timeout`` and
    ``request_timeout`` likewise. Empty when nothing timed out."""
    out = []
    calls = trace.all_calls()
    timed_out = [c for c in calls if c.runtime_error and (c.error or "").startswith("timed out")]
    if timed_out:
        limit = config.subagent_timeout
        done = [c.latency for c in calls if not c.error]
        took = (f"the {len(done)} that finished took up to {max(done):.1f}s" if done else "none finished")
        value = _raise_to(limit, max(done, default=0.0))
        out.append(f"{len(timed_out)} of {len(calls)} tool calls timed out: each needed more than subagent_timeout "
                   f"= {limit:g}s of work ({took}); on a busy or slow machine raise subagent_timeout to {value} or "
                   f"more: {_how('subagent_timeout', value)}")
    planner = [e for e in trace.run_errors if "timed out" in e and ("planner" in e or "synthesize" in e)]
    if planner:
        value = _raise_to(config.planner_timeout, 0.0)
        out.append(f"the planner's turn timed out after planner_timeout = {config.planner_timeout:g}s; raise it to "
                   f"{value} or more: {_how('planner_timeout', value)}")
    if any("request_timeout" in e for e in trace.run_errors):
        value = _raise_to(config.request_timeout, trace.latency)
        out.append(f"the question ran past request_timeout = {config.request_timeout:g}s; raise it to {value} or "
                   f"more: {_how('request_timeout', value)}")
    return out
