"""A process that answers one question durably (SQLite checkpointer, frame directory) with a scripted policy:
the durable-resume test kills it with SIGKILL mid-fan-out and resumes its thread in another process.

``python durable_worker.py VIDEO DB FRAMES LOG [hang_from]``: sub-agents whose window starts at or after
``hang_from`` seconds never return (the process is killed while they run); every model call is logged to LOG
as ``role start`` before it returns; the answer is printed as JSON."""

from __future__ import annotations

import asyncio
import json
import re
import sys

from paravt_agent.agent import Agent
from paravt_agent.policy.base import text_of
from paravt_agent.policy.scripted import ScriptedPolicy

WINDOWS = [(2, 6), (10, 14), (20, 24), (30, 34)]


def script(role: str, msgs: list[dict]) -> str:
    if role == "subagent":
        m = re.search(r"Window ([\d.]+)-([\d.]+)", text_of(msgs[1]["content"]))
        return f"summary of {float(m.group(1)):g}-{float(m.group(2)):g}"
    if "<tool_response>" in text_of(msgs[-1]["content"]):
        body = text_of(msgs[-1]["content"])
        return f"<think>read {body.count('summary of')} summaries</think><answer>B</answer>"
    return "<think>inspect</think>\n" + "\n".join(
        f'<tool_call>{{"name": "crop_video", "arguments": {{"start_time": {a}, "end_time": {b}}}}}</tool_call>'
        for a, b in WINDOWS)


class Logged(ScriptedPolicy):
    def __init__(self, log: str, hang_from: float | None):
        super().__init__(script)
        self.log, self.hang_from = log, hang_from

    async def generate(self, messages, sampling, prefix="", continuation=None, role="planner"):
        start = None
        if role == "subagent":
            start = float(re.search(r"Window ([\d.]+)", text_of(messages[1]["content"])).group(1))
            if self.hang_from is not None and start >= self.hang_from:
                await asyncio.sleep(3600)  # killed here
        with open(self.log, "a") as f:
            f.write(f"{role} {start}\n")
        return await super().generate(messages, sampling, prefix, role=role)


def main() -> None:
    video, db, frames, log = sys.argv[1:5]
    hang_from = float(sys.argv[5]) if len(sys.argv) > 5 else None
    agent = Agent(policy=Logged(log, hang_from), checkpointer=f"sqlite:///{db}", frames_dir=frames)
    ans = agent.answer(video, "Which colour?", ["red", "green"], thread_id="question-1")
    print(json.dumps({"text": ans.text, "response": ans.trace.response, "choice": ans.choice,
                      "calls": [c.summary for t in ans.trace.turns for c in t.calls]}))


if __name__ == "__main__":
    main()
