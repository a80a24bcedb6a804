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
from collections.abc import Sequence

import numpy as np

from paravt_agent.config import Layout
from paravt_agent.protocol import format_time, labelled_options, neutralize
from paravt_agent.protocol.presets import (
    EVAL_SYSTEM_TEMPLATE,
    HERMES_TOOLS_TEMPLATE,
    RELEASED_SUBAGENT_PROMPT,
    released_tools_block,
)

__all__ = [
    "NO_TOOL_SYSTEM_PROMPT",
    "SUBAGENT_SYSTEM_PROMPT",
    "TOOL_SYSTEM_PROMPT",
    "FINAL_ANSWER_PROMPT",
    "error_slot_text",
    "frame_parts",
    "overview_parts",
    "planner_messages",
    "question_text",
    "subagent_request",
    "window_parts",
    "subagent_messages",
    "tool_response_message",
    "tool_response_messages",
    "tool_system_prompt",
    "layout_system_prompt",
    "layout_planner_messages",
    "layout_subagent_messages",
    "final_prompt",
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

SUBAGENT_SYSTEM_PROMPT = """You are a video inspection sub-agent. You see frames from one temporal window of a video, \
each labelled with its time in seconds.
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


def frame_parts(frames: np.ndarray, timestamps: Sequence[float], labels: bool = True) -> list[dict]:
    """``<t seconds>`` label + image, per frame (the image alone when ``labels`` is off)."""
    parts: list[dict] = []
    for frame, t in zip(frames, timestamps, strict=True):
        if labels:
            parts.append({"type": "text", "text": f"<{t:.1f} seconds>"})
        parts.append({"type": "image", "image": frame, "timestamp": float(t)})
    return parts


def question_text(question: str, options: Sequence[str] | None = None,
                  instruction: str = "Answer with the option's letter.") -> str:
    text = f"Question: {question.strip()}"
    if options:
        text += "\nOptions:\n" + "\n".join(labelled_options(options)) + "\n" + instruction
    return text


def overview_parts(frames: np.ndarray, timestamps: Sequence[float], duration: float, video_name: str,
                   labels: bool = True) -> list[dict]:
    """The planner's view of the video: one intro line, then (labelled) frames."""
    intro = (
        f"Video: {video_name}, duration {duration:.1f} seconds ({format_time(duration)}). "
        f"{len(timestamps)} overview frames follow."
    )
    return [{"type": "text", "text": intro}, *frame_parts(frames, timestamps, labels=labels)]


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
    """``[system, user(overview frames + question)]`` in this project's layout."""

    return layout_planner_messages(Layout(), system, frames, timestamps, duration, question, options, video_name)


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


# --------------------------------------------------------------------------- layouts (paravt_agent.protocol.presets)


def _mmss(seconds: float) -> str:
    """MM:SS as the released sub-agent prompt writes it (whole minutes, then whole seconds)."""
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


def layout_system_prompt(layout, schemas: Sequence[dict], sequential: bool = False) -> str:
    """The planner's system prompt under a :class:`~paravt_agent.config.Layout`; ``schemas`` as offered."""

    if layout.system == "paravt":
        return tool_system_prompt(schemas, sequential=sequential)
    block = released_tools_block(list(schemas))
    if layout.system == "paravt-eval":
        return EVAL_SYSTEM_TEMPLATE.format(tools=block)
    hermes = HERMES_TOOLS_TEMPLATE.format(tools=block)
    if layout.system == "paravt-rl":
        return TOOL_SYSTEM_PROMPT + "\n\n" + hermes
    return hermes


def layout_planner_messages(layout, system: str | None, frames: np.ndarray, timestamps: Sequence[float],
                            duration: float, question: str, options: Sequence[str] | None = None,
                            video_name: str = "video.mp4") -> list[dict]:
    """``[system?, user(overview + question)]`` under a layout (no system message when ``system`` is None)."""
    if layout.overview_intro:
        parts = overview_parts(frames, timestamps, duration, video_name, labels=layout.frame_labels)
    else:
        parts = frame_parts(frames, timestamps, labels=layout.frame_labels)
    text = question_text(question, options, layout.mcq_instruction) + layout.question_suffix.format(
        video_name=video_name)
    parts.append({"type": "text", "text": text})
    head = [{"role": "system", "content": system}] if system is not None else []
    return [*head, {"role": "user", "content": parts}]


def layout_subagent_messages(layout, frames: np.ndarray, timestamps: Sequence[float], window: tuple[float, float],
                             question: str | None, system: str = SUBAGENT_SYSTEM_PROMPT) -> list[dict]:
    """A sub-agent's messages under a layout: this project's (:func:`subagent_messages`) or the released RL
    sub-agent's (no system prompt, unlabelled frames, then its fixed prompt; never the question)."""
    if layout.subagent == "paravt":
        return subagent_messages(frames, timestamps, window, question, system=system)

    a, b = window
    text = RELEASED_SUBAGENT_PROMPT.format(start=_mmss(a), end=_mmss(b), duration=b - a)
    return [{"role": "user", "content": [*frame_parts(frames, timestamps, labels=False),
                                         {"type": "text", "text": text}]}]


def final_prompt(layout, mcq: bool) -> str:
    """The forced last turn's instruction."""
    return layout.final_prompt if mcq or layout.final_prompt_open is None else layout.final_prompt_open


def _wrap(text: str) -> str:
    return f"<tool_response>\n{text}\n</tool_response>"


def tool_response_messages(layout, slots: Sequence[dict]) -> list[dict]:
    """A tool turn's messages under a layout. ``slots`` in call order, each ``{"label", "text", "error"?,
    "frames"?, "timestamps"?, "window"?}``: a summary or tool text in ``text``; in frames mode the crop's
    ``frames`` go to the planner as images before their text. Texts are neutralised (:func:`neutralize`).

    * ``turn``: ONE user turn, ``<tool_response>\\n[1] label: text\\n[2] ...\\n</tool_response>``;
    * ``per_call``: one user message per call, ``[images...,] <tool_response>\\ntext\\n</tool_response>``;
    * ``blocks``: one user turn holding a ``<tool_response>`` block per call (a Hermes template's tool turn).
    """
    if layout.tool_response == "turn":
        if not any(s.get("frames") is not None for s in slots):
            return [tool_response_message([(s["label"], s["text"]) for s in slots])]
        parts: list[dict] = [{"type": "text", "text": "<tool_response>"}]
        for i, s in enumerate(slots, 1):
            line = (f"\n[{i}] {_clip(neutralize(s['label']), 200)}: "
                    f"{_clip(neutralize(s['text'].strip()), MAX_SLOT_CHARS)}")
            parts.append({"type": "text", "text": line})
            if s.get("frames") is not None:
                parts.extend(frame_parts(s["frames"], s["timestamps"], labels=layout.frame_labels))
        parts.append({"type": "text", "text": "\n</tool_response>"})
        return [{"role": "user", "content": parts}]
    if layout.tool_response == "per_call":
        out = []
        for s in slots:
            body = _wrap(_clip(neutralize(s["text"].strip()), MAX_SLOT_CHARS))
            if s.get("frames") is None:
                out.append({"role": "user", "content": body})
            else:
                frames = frame_parts(s["frames"], s["timestamps"], labels=layout.frame_labels)
                out.append({"role": "user", "content": [*frames, {"type": "text", "text": body}]})
        return out
    parts = []
    for i, s in enumerate(slots):
        body = _clip(neutralize(s["text"].strip()), MAX_SLOT_CHARS)
        parts.append({"type": "text", "text": ("\n" if i else "") + "<tool_response>\n"})
        if s.get("frames") is not None:
            parts.extend(frame_parts(s["frames"], s["timestamps"], labels=layout.frame_labels))
        parts.append({"type": "text", "text": body + "\n</tool_response>"})
    if all(p["type"] == "text" for p in parts):
        return [{"role": "user", "content": "".join(p["text"] for p in parts)}]
    return [{"role": "user", "content": parts}]


def error_slot_text(template: str, error: str, window: tuple[float, float] | None) -> str:
    """A failed call's text under a layout's ``error_text`` (``{error}``, ``{start}``, ``{end}``)."""
    try:
        start, end = window if window is not None else (None, None)
        if start is None and ("{start" in template or "{end" in template):
            raise KeyError("start")
        return template.format(error=error, start=start, end=end)
    except (KeyError, ValueError, IndexError):
        return f"[Error: {error}]"
