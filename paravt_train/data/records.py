"""The records training data becomes, below the loops that use them: an RL prompt (:class:`PromptItem`, what
``prompts_from_rl``, the online learner's feedback and the GRPO loop hand each other) and the transcript a reward
scores (:func:`episode_transcript`, read off an agent's answer by the RL rollout and by the pre-filter alike)."""

from __future__ import annotations

from dataclasses import dataclass

from paravt_agent.policy.base import text_of
from paravt_agent.types import Answer
from paravt_train.rewards import transcript

__all__ = ["PromptItem", "episode_transcript"]


@dataclass(kw_only=True)  # built by keyword (tests/test_architecture.py)
class PromptItem:
    """One RL prompt: what the agent is asked and what the reward checks against."""

    id: str
    video: str
    question: str
    options: list[str] | None
    answer: object  # a letter / text, or [start, end] for tvg
    task: str  # mcq | tvg | oe


def episode_transcript(answer: Answer) -> str:
    """Planner responses (prefix included) interleaved with the tool-response turns that followed them
    (one turn, or one message per call: the layout's choice, joined in order). Only the runtime's own
    ``<tool_response>`` turns are included: an instruction the agent injects (the forced final-answer turn)
    is never scored."""
    responses: list[str] = []
    tools: list[list[str]] = []
    for m in answer.messages or []:
        if m["role"] == "assistant":
            responses.append(m["content"])
            tools.append([])
        elif m["role"] == "user" and responses:
            text = text_of(m["content"])  # frame labels may precede the wrapper (frames evidence)
            if "<tool_response>" in text:
                tools[-1].append(text[text.index("<tool_response>"):])
    return transcript(responses, ["\n".join(t) for t in tools])
