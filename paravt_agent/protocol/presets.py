"""Protocol presets: the layouts the released checkpoints were trained and evaluated with.

A model answers best under the protocol it saw in training: the same prompts,
frame labels, tool schema, tool-result layout, limits and final-turn wording.
A preset is a named set of :class:`~paravt_agent.config.AgentConfig` settings;
``AgentConfig(preset="paravt-eval")`` (or ``preset: paravt-eval`` in YAML, or
``--preset paravt-eval`` on the CLIs) starts from it, and anything given
explicitly wins. A model directory's ``agent_config.yaml`` names its preset.

======================  ===================================================================
``paravt`` (default)    this project's layout: what models trained with ``paravt-train`` see
``paravt-rl``           the released ParaVT RL workflow (``paravt/rl/workflow.py``)
``paravt-eval``         the released ParaVT eval driver, ``--prompt_mode agentic_general``
                        (``paravt/eval/driver.py``): the paper's Table 1 protocol
``longvt``              LongVT-RFT-7B's inference example (``examples/eval/single_inference.py``)
======================  ===================================================================

What each preset reproduces, and where it cannot, is written next to its settings
below; ``docs/presets.md`` has the side-by-side table.
"""

from __future__ import annotations

import copy
import json

__all__ = [
    "EVAL_SYSTEM_TEMPLATE",
    "HERMES_TOOLS_TEMPLATE",
    "LONGVT_TOOL_PROMPT",
    "PRESETS",
    "RELEASED_SUBAGENT_PROMPT",
    "TOOL_SCHEMAS",
    "preset_names",
    "preset_settings",
    "released_tools_block",
]

#: Qwen's Hermes tool block: what the released RL workflow appends to the system prompt
#: (``tools_system_message``) and what the eval driver's ``agentic_minimal`` mode uses as the whole prompt.
HERMES_TOOLS_TEMPLATE = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n"
    "{tools}\n"
    "</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    "<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n'
    "</tool_call>"
)

#: The released eval driver's ``agentic_general`` system prompt (``GENERAL_AGENTIC_SYSTEM``).
EVAL_SYSTEM_TEMPLATE = (
    "You are a video understanding agent that can analyze videos by cropping and examining specific segments.\n\n"
    "Available tool:\n"
    "<tools>\n"
    "{tools}\n"
    "</tools>\n\n"
    "For tool calls, return a JSON object within <tool_call></tool_call> XML tags:\n"
    "<tool_call>\n"
    '{{"name": "crop_video", "arguments": {{"video_path": "...", "start_time": 0, "end_time": 10}}}}\n'
    "</tool_call>\n\n"
    "You may emit **multiple <tool_call> blocks in one turn** to analyze different segments in parallel — this "
    "is more efficient than sequential calls and is the recommended dispatch shape for this agent.\n\n"
    "Format strictly as:\n"
    "<think>your reasoning here</think>\n"
    "<tool_call>...</tool_call>  (zero or more, parallel if multiple)\n"
    "<answer>your final answer</answer>\n\n"
    "Always wrap your reasoning in <think> tags and your final answer in <answer> tags."
)

#: The released RL sub-agent's prompt (``CroppedVideoSubagent.build_prompt``): after the crop's frames, no
#: system prompt, no question. ``{start}`` / ``{end}`` are MM:SS (minutes, then whole seconds).
RELEASED_SUBAGENT_PROMPT = (
    "You are analyzing a video segment from {start} to {end} (duration: {duration:.1f} seconds).\n\n"
    "The images shown are frames sampled from this video segment. Carefully examine each frame in sequence to "
    "understand the temporal progression of events.\n\n"
    "Your task: Provide a concise summary of what happens in this video segment.\n\n"
    "Guidelines:\n"
    "- Describe the key actions, events, or changes that occur across the frames\n"
    "- Note any important objects, people, or elements visible in the scene\n"
    "- Capture the temporal flow (what happens first, then, finally)\n"
    "- Focus on factual observations rather than interpretations\n\n"
    "Summary:"
)

#: LongVT's tool-mode instruction, appended to the question (``TOOL_PROMPT``).
LONGVT_TOOL_PROMPT = ("Think first, call **crop_video** if needed, then answer. Format strictly as: "
                      "<think>...</think> <tool_call>...</tool_call> (if needed) <answer>...</answer>.")

_PATH = {"type": "string", "description": "Path to the video file"}
_START = {"type": "number", "description": "Start time in seconds"}
_END = {"type": "number", "description": "End time in seconds"}
_REQUIRED = ["video_path", "start_time", "end_time"]

#: ``crop_video`` as each released source describes it, key order kept (it is serialised into the prompt).
TOOL_SCHEMAS: dict[str, dict] = {
    # paravt/eval/driver.py TOOL_SCHEMA ("matches SFT training")
    "paravt-eval": {"type": "function", "function": {
        "name": "crop_video",
        "description": "Analyze a cropped video segment by sampling frames from a specific time range.",
        "parameters": {"type": "object", "properties": {"video_path": _PATH, "start_time": _START, "end_time": _END},
                       "required": _REQUIRED}}},
    # paravt/rl/subagents: the manager emits the ToolDescription's parameters as they are (no "type"/"required")
    "paravt-rl": {"type": "function", "function": {
        "name": "crop_video",
        "description": "Analyze a cropped video segment by sampling fixed number of frames and providing a summary "
                       "of the content. Use this when you need to understand what happens in a specific time range "
                       "of a video.",
        "parameters": {"video_path": _PATH, "start_time": _START, "end_time": _END}}},
    # LongVT examples/eval/single_inference.py CROP_VIDEO_TOOL
    "longvt": {"type": "function", "function": {
        "name": "crop_video",
        "description": "Crop a video to a specified duration. Use this tool to zoom in on specific time segments "
                       "for detailed analysis.",
        "parameters": {"type": "object", "properties": {"video_path": _PATH, "start_time": _START, "end_time": _END},
                       "required": _REQUIRED}}},
}


def released_tools_block(schemas: list[dict]) -> str:
    """Tool schemas one JSON object per line, serialised as the released code does (``json.dumps``)."""
    return "\n".join(json.dumps(s) for s in schemas)


_GREEDY = {"temperature": 0.0, "top_p": 1.0}

PRESETS: dict[str, dict] = {
    "paravt": {},
    # The released RL workflow (what ParaVT-8B was trained on). System prompt: the training data's (Appendix C)
    # with Qwen's Hermes tools block appended, as the workflow does when the data's prompt has no <tools>
    # block. Overview frames labelled "<t.1f seconds>", no intro line; think prefix appended; every crop goes to
    # a weight-sharing sub-agent at 1 fps, <=16 frames, whose summary (<=512 tokens: the sub-agent's token cap)
    # comes back as ONE user message per call; no cap on calls per turn (all are gathered; 64 here, the
    # parser's bound); up to max_turns + 1 = 4 planner responses, no forced final turn.
    "paravt-rl": {
        "frames": {"fps": 1.0, "max_frames": 64, "crop_max_frames": 16, "crop_fps": 1.0},
        "layout": {"system": "paravt-rl", "tool_schema": "paravt-rl", "overview_intro": False, "frame_labels": True,
                   "evidence": "summary", "tool_response": "per_call", "subagent": "paravt-rl",
                   "error_text": "[Error: crop_video failed: {error}]", "final_turn": "none"},
        "max_turns": 3,
        "max_calls_per_turn": 64,
        "think_prefix": "<think>\n",
        "question_to_subagents": False,
        "strict_video_path": False,
        "subagent_sampling": {"max_new_tokens": 512},
    },
    # The released eval driver, agentic_general (the paper's Table 1 numbers): its own system prompt and tool
    # schema, 64 overview frames without labels, the question followed by "The video path for this video is:
    # NAME", NO sub-agent (the crop's frames go to the planner, then "<tool_response>\nN frames from X s to Y
    # s.\n</tool_response>", one user message per call), greedy, 2048 tokens, 3 tool turns of at most 5 calls
    # (extra calls dropped), then the forced letter answer (64 tokens; 128 for grounding). No think prefix.
    "paravt-eval": {
        "frames": {"fps": 1.0, "max_frames": 64, "n_frames": 64, "crop_max_frames": 16, "crop_fps": 1.0},
        "layout": {"system": "paravt-eval", "tool_schema": "paravt-eval", "overview_intro": False,
                   "frame_labels": False, "mcq_instruction": "Answer with the option letter only.",
                   "question_suffix": " The video path for this video is: {video_name}",
                   "evidence": "frames", "tool_response": "per_call",
                   "evidence_text": "{n} frames from {start:.1f}s to {end:.1f}s.",
                   "error_text": "[Error cropping {start:.1f}s-{end:.1f}s]", "extra_calls": "drop",
                   "final_turn": "after_tools",
                   "final_prompt": "Based on the video and cropped segments above, answer with ONLY the letter.",
                   "final_prompt_open": "Based on the video and any cropped segments, provide your final answer "
                                        "about when the event happens. Use the format: 'The event happens in the "
                                        "X.X - Y.Y seconds.'",
                   "final_max_new_tokens": 64, "final_max_new_tokens_open": 128,
                   "grounding_question": (
                       "Please find the visual event described by a sentence in the video, determining its "
                       "starting and ending times. The format should be: 'The event happens in the start time - "
                       "end time'. For example, The event 'person turn a light on' happens in the 24.3 - 30.4 "
                       "seconds. Now I will give you the textual sentence: \"{query}\". Please return its start "
                       "time and end time.")},
        "max_turns": 3,
        "max_calls_per_turn": 5,
        "think_prefix": "",
        "strict_video_path": False,
        "planner_sampling": {**_GREEDY, "max_new_tokens": 2048},
    },
    # LongVT-RFT-7B (sequential predecessor, Qwen2.5-VL): no system prompt of its own (the tool goes through the
    # API's `tools`, which a Hermes chat template renders as the tools block), the whole video at 1 fps (<=512
    # frames, 224x224, no labels), the question followed by LongVT's tool prompt, crops at 1 fps (<=128 frames)
    # returned as frames with "Cropped Xs-Ys, got N frames." in a tool turn; up to 6 responses of 4096 tokens,
    # greedy, no forced final turn. Every call of a response is run (LongVT's model makes one per turn). Our reader samples at most 512 overview frames; the chat template's exact
    # tool-turn wrapping is the Hermes one (a <tool_response> block per result in one user turn).
    "longvt": {
        "frames": {"fps": 1.0, "max_frames": 512, "factor": 28, "crop_max_frames": 128, "crop_fps": 1.0},
        "layout": {"system": "hermes", "tool_schema": "longvt", "overview_intro": False, "frame_labels": False,
                   "question_suffix": " " + LONGVT_TOOL_PROMPT, "evidence": "frames", "tool_response": "blocks",
                   "evidence_text": "Cropped {start:g}s-{end:g}s, got {n} frames.", "error_text": "Error: {error}",
                   "final_turn": "none"},
        "max_turns": 5,
        "max_calls_per_turn": 64,
        "think_prefix": "",
        "strict_video_path": False,
        "planner_sampling": {**_GREEDY, "max_new_tokens": 4096},
    },
}


def preset_names() -> list[str]:
    return list(PRESETS)


def preset_settings(name: str) -> dict:
    """A copy of a preset's settings (an ``AgentConfig`` dict). Raises ``ValueError`` for an unknown name."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[name])
