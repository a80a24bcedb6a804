"""Prompts and message construction.

Messages are plain dicts in one neutral layout that every policy backend
converts to its own wire format::

    {"role": "system" | "user" | "assistant", "content": str | [part, ...]}
    part = {"type": "text", "text": str}
         | {"type": "image", "image": np.ndarray (H, W, 3) uint8, "timestamp": float}

Each frame is preceded by a ``<t seconds>`` text label (ARCHITECTURE.md, decision 1).
The planner's tool prompt is the paper's (Appendix C), so the released ParaVT
checkpoint sees the prompt it was trained with; the tool schemas follow it.

Tool output is data, never protocol: every result is neutralised
(:func:`neutralize`) before it enters the planner's context, so the
``<tool_response>`` wrapper is the only tag a tool turn carries, in serving and
in training alike. No instruction the agent injects carries a protocol tag.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import numpy as np

from paravt_agent.protocol import format_time, labelled_options

__all__ = [
    "NO_TOOL_SYSTEM_PROMPT",
    "SUBAGENT_SYSTEM_PROMPT",
    "TOOL_SYSTEM_PROMPT",
    "FINAL_ANSWER_PROMPT",
    "frame_parts",
    "neutralize",
    "overview_parts",
    "planner_messages",
    "question_text",
    "subagent_request",
    "window_parts",
    "subagent_messages",
    "tool_response_message",
    "tool_system_prompt",
]

#: Paper, Appendix C: the SFT cold-start / RL system prompt for tool-augmented samples.
TOOL_SYSTEM_PROMPT = """You are a video understanding agent.

# Workflow
1. Think inside <think>...</think> about which video
   segments contain the evidence needed to answer.
2. Call tools using <tool_call>...</tool_call> blocks.
   You may issue multiple <tool_call> blocks in one turn
   to inspect different temporal windows in parallel.
3. After receiving <tool_response>, place your final
   answer inside <answer>...</answer>.

# Format
<think>your reasoning here</think>
<tool_call>{"name": "crop_video",
           "arguments": {"video_path": "...",
                        "start_time": ...,
                        "end_time": ...}}</tool_call>
... (more <tool_call> blocks if needed) ...
[After tool responses arrive]
<answer>your final answer</answer>

# Important
- ONLY use <tool_call> with the JSON format above.
- Do NOT use <tool_code>, Python syntax, or any other
  tool format.
- Do NOT call the same temporal window twice."""

#: Sequential dispatch (the paper's baseline): the same prompt, one call per turn.
SEQUENTIAL_NOTE = "\n- Issue exactly ONE <tool_call> per turn; you may call again after each <tool_response>."

#: Paper, Appendix C: the prompt of non-tool sources (dispatch mode ``none``).
NO_TOOL_SYSTEM_PROMPT = """You are a helpful video understanding assistant.
First, reason about the question inside <think>...</think>.
Then provide your final answer inside <answer>...</answer>."""

SUBAGENT_SYSTEM_PROMPT = """You are a video inspection sub-agent. You see frames from one temporal window of a video, each labelled with its time in seconds.
Describe concisely what the frames show that is relevant to the question, citing times. Reply with the summary only."""

#: The forced last turn once ``max_turns`` is used up. No protocol tags: an instruction the agent injects is
#: never scored, and must not hand the policy the tags it is rewarded for writing.
FINAL_ANSWER_PROMPT = "The tool budget is used up. Give your final answer now, without calling tools."


def tool_system_prompt(tool_schemas: Sequence[dict], sequential: bool = False, base: str = TOOL_SYSTEM_PROMPT) -> str:
    """The planner's system prompt: the paper's prompt plus the tools as OpenAI-style functions."""
    text = base + (SEQUENTIAL_NOTE if sequential else "")
    if tool_schemas:
        tools = "\n".join(json.dumps(s, ensure_ascii=False) for s in tool_schemas)
        text += f"\n\n# Tools\n<tools>\n{tools}\n</tools>"
    return text


def frame_parts(frames: np.ndarray, timestamps: Sequence[float]) -> list[dict]:
    """``<t seconds>`` label + image, per frame."""
    parts: list[dict] = []
    for frame, t in zip(frames, timestamps, strict=True):
        parts.append({"type": "text", "text": f"<{t:.1f} seconds>"})
        parts.append({"type": "image", "image": frame, "timestamp": float(t)})
    return parts


def question_text(question: str, options: Sequence[str] | None = None) -> str:
    text = f"Question: {question.strip()}"
    if options:
        text += "\nOptions:\n" + "\n".join(labelled_options(options)) + "\nAnswer with the option's letter."
    return text


def overview_parts(frames: np.ndarray, timestamps: Sequence[float], duration: float, video_name: str) -> list[dict]:
    """The planner's view of the video: one intro line, then labelled frames."""
    intro = (
        f"Video: {video_name}, duration {duration:.1f} seconds ({format_time(duration)}). "
        f"{len(timestamps)} overview frames follow."
    )
    return [{"type": "text", "text": intro}, *frame_parts(frames, timestamps)]


def window_parts(frames: np.ndarray, timestamps: Sequence[float], window: tuple[float, float]) -> list[dict]:
    """A sub-agent's view of its window: one head line, then labelled frames."""
    head = f"Window {window[0]:.1f}-{window[1]:.1f} seconds, {len(timestamps)} frames."
    return [{"type": "text", "text": head}, *frame_parts(frames, timestamps)]


def subagent_request(question: str | None) -> str:
    """The text after a sub-agent's frames."""
    return f"Question: {question.strip()}\nSummarise this window." if question else "Summarise this window."


def planner_messages(
    system: str,
    frames: np.ndarray,
    timestamps: Sequence[float],
    duration: float,
    question: str,
    options: Sequence[str] | None = None,
    video_name: str = "video.mp4",
) -> list[dict]:
    """``[system, user(overview frames + question)]``."""
    content = [*overview_parts(frames, timestamps, duration, video_name), {"type": "text", "text": question_text(question, options)}]
    return [{"role": "system", "content": system}, {"role": "user", "content": content}]


def subagent_messages(
    frames: np.ndarray,
    timestamps: Sequence[float],
    window: tuple[float, float],
    question: str | None,
    system: str = SUBAGENT_SYSTEM_PROMPT,
) -> list[dict]:
    """``[system, user(window frames + question)]`` for one sub-agent."""
    content = [*window_parts(frames, timestamps, window), {"type": "text", "text": subagent_request(question)}]
    return [{"role": "system", "content": system}, {"role": "user", "content": content}]


_PROTOCOL_TAG_RE = re.compile(r"<(/?)(think|answer|tool_call|tool_code|tool_response)>|<\|([A-Za-z_]+)\|>", re.I)


def neutralize(text: str) -> str:
    """Tool output as data: protocol tags (``<answer>``, ``</think>``, ``<tool_call>``, ...) and chat-template
    control tokens (``<|im_end|>``) are escaped (``&lt;answer&gt;``), so text a tool read from a user's
    file or a sub-agent wrote can neither earn a reward nor forge a turn. Everything else is kept."""

    def esc(m: re.Match) -> str:
        return "&lt;" + m.group(0)[1:-1] + "&gt;"

    return _PROTOCOL_TAG_RE.sub(esc, text)


#: Characters of one slot of a tool response (a label or a text beyond it is cut, saying so).
MAX_SLOT_CHARS = 4000


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f" … [{len(text) - limit} characters cut]"


def tool_response_message(results: Sequence[tuple[str, str]]) -> dict:
    """ONE user turn holding every result of the turn, in call order: ``[(label, text), ...]``; labels and
    texts are neutralised (:func:`neutralize`) and each slot is at most :data:`MAX_SLOT_CHARS` long."""
    body = "\n".join(f"[{i}] {_clip(neutralize(label), 200)}: {_clip(neutralize(text.strip()), MAX_SLOT_CHARS)}"
                     for i, (label, text) in enumerate(results, 1))
    return {"role": "user", "content": f"<tool_response>\n{body}\n</tool_response>"}
