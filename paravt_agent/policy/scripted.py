"""A policy that answers from a script: a callable of the messages (graph tests, demos of control flow)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from paravt_agent.policy.base import Policy, text_of
from paravt_agent.types import Continuation, Generation, Sampling

Script = Callable[[str, list[dict]], str]


def role_of(messages: list[dict]) -> str:
    """``planner`` or ``subagent``, from the system prompt (or, for the released RL sub-agent, which has
    none, from its fixed prompt)."""
    system = text_of(messages[0]["content"]) if messages and messages[0]["role"] == "system" else ""
    if system.startswith("You are a video inspection sub-agent"):
        return "subagent"
    if not system and len(messages) == 1 and "You are analyzing a video segment from" in text_of(messages[0]["content"]):
        return "subagent"
    return "planner"


class ScriptedPolicy(Policy):
    """``script(role, messages) -> text``; optional fixed ``delay`` seconds per call (awaited, not blocking)."""

    name = "scripted"

    def __init__(self, script: Script, delay: float = 0.0):
        self.script, self.delay = script, delay
        self.calls: list[tuple[str, list[dict]]] = []

    async def generate(self, messages: list[dict], sampling: Sampling, prefix: str = "",
                       continuation: Continuation | None = None) -> Generation:
        t0 = time.perf_counter()
        role = role_of(messages)
        self.calls.append((role, messages))
        if self.delay:
            await asyncio.sleep(self.delay)
        text = self.script(role, messages)
        if prefix and not text.startswith(prefix.strip()):
            text = prefix + text
        words = sum(len(text_of(m["content"]).split()) for m in messages)
        return Generation(text=text, prefix=prefix, prompt_tokens=words, completion_tokens=len(text.split()),
                          latency=time.perf_counter() - t0)
