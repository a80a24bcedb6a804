"""A policy backend: answers every planner turn with the first option, every sub-agent with its window."""

from paravt_agent.policy.base import Policy, text_of
from paravt_agent.types import Generation


class EchoPolicy(Policy):
    name = "echo"

    def __init__(self, model=None, endpoint=None, api_key=None, **options):
        self.model = model

    async def generate(self, messages, sampling, prefix="", continuation=None, role="planner"):
        last = text_of(messages[-1]["content"])
        if role == "subagent":
            return Generation(text=last.split(",")[0])
        return Generation(text=prefix + "the first option.</think><answer>A</answer>", prefix=prefix)
