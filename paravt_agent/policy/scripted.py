"""A policy that answers from a script: a callable of the messages (graph tests, demos of control flow)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from paravt_agent.policy.base import Policy, text_of
from paravt_agent.types import Continuation, Generation, Sampling

Script = Callable[[str, list[dict]], str]


class ScriptedPolicy(Policy):
    """``script(role, messages) -> text`` (``role`` as the graph states it: ``planner``, ``subagent``, …);
    optional fixed ``delay`` seconds per call (awaited, not blocking)."""

    name = "scripted"

    def __init__(self, script: Script, delay: float = 0.0):
        self.script, self.delay = script, delay
        self.calls: list[tuple[str, list[dict]]] = []

    async def generate(self, messages: list[dict], sampling: Sampling, prefix: str = "",
                       continuation: Continuation | None = None, role: str = "planner") -> Generation:
        t0 = time.perf_counter()
        self.calls.append((role, messages))
        if self.delay:
            await asyncio.sleep(self.delay)
        text = self.script(role, messages)
        if prefix and not text.startswith(prefix.strip()):
            text = prefix + text
        words = sum(len(text_of(m["content"]).split()) for m in messages)
        return Generation(text=text, prefix=prefix, prompt_tokens=words, completion_tokens=len(text.split()),
                          latency=time.perf_counter() - t0)
