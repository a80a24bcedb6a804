"""Protocol presets: the layouts the released checkpoints were trained and evaluated with.

A model answers best under the protocol it saw in training: the same prompts,
frame labels, tool schema, tool-result layout, limits and final-turn wording.
A preset is a named set of :class:`~paravt_agent.config.AgentConfig` settings;
``AgentConfig(preset="paravt-eval")`` (or ``preset: paravt-eval`` in YAML, or
``--preset paravt-eval`` on the CLIs) starts from it, and anything given
explicitly wins. A model directory's ``agent_config.yaml`` names its preset, and a training method
(``method:`` in a GRPO config: ``paravt_train/methods.py``) names the one it trains.

======================  ===================================================================
``paravt`` (default)    this project's layout: what models trained with ``paravt-train`` see
``paravt-rl``           the released ParaVT RL workflow (``paravt/rl/workflow.py``)
``paravt-eval``         the released ParaVT eval driver, ``--prompt_mode agentic_general``
                        (``paravt/eval/driver.py``): the paper's Table 1 protocol
``longvt``              LongVT-RFT-7B's inference example (``examples/eval/single_inference.py``)
``weaver``              Weaver (``weaver.txt``): its six tools, one call per turn, visual tool outputs in the
                        interleaved context, its system prompt (Appendix B.2), turn limit and frame counts
``videochat-m1``        VideoChat-M1 (``videochat-m1-supplement.txt``): four collaborating agents, collaborative
                        policy planning, 5 turns, the consensus answer
======================  ===================================================================

What each preset reproduces, and where it cannot, is written next to its settings
below; ``docs/presets.md`` has the side-by-side table.

A preset states no frame geometry: the frame unit and pixel bounds always come from the model the agent runs
(:meth:`~paravt_agent.video.FrameConfig.bound_to`), so ``weaver`` and ``videochat-m1`` run on a Qwen2.5-VL model (their
papers' family) with its own 28-pixel unit, as on the toy's Qwen3-VL with 32. :data:`PRESET_FAMILIES` names the model
family each preset's released checkpoint (or paper) is.
"""

from __future__ import annotations

import copy
import json

__all__ = [
    "EVAL_SYSTEM_TEMPLATE",
    "HERMES_TOOLS_TEMPLATE",
    "LONGVT_TOOL_PROMPT",
    "PRESETS",
    "PRESET_FAMILIES",
    "RELEASED_SUBAGENT_PROMPT",
    "TOOL_SCHEMAS",
    "WEAVER_SYSTEM_PROMPT",
    "WEAVER_TOOLS",
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

#: Weaver's inference system prompt (Appendix B.2), its usage lines kept (this runtime's parser reads their flat
#: ``{"tool_name": ..., ...}`` calls); spatial_grounding takes the moment to look at (``time``): our tool reads one
#: frame, where Weaver's reads "the current focused context" a preceding tool prepared.
WEAVER_SYSTEM_PROMPT = """You are a helpful multimodal assistant. Your task is to solve complex visual questions by \
thinking step-by-step and using tools.
#Tools
You are provided with following tools:
1. Temporal grounding tool: Grounds a detailed temporal window of a certain event according to the "query". Usage: \
<tool_call>{"tool_name": "temporal_grounding", "query": "the event you want to ground."}</tool_call>
2. Spatial tracking tool: Tracks certain objects in spatial bounding boxes. Usage: <tool_call>{"tool_name": \
"spatial_tracking", "objects": ["object1", "object2", ...]}</tool_call>
3. Frame selection tool: Selects a single, most representative keyframe that best matches a textual query. This is \
ideal for answering questions about static scenes that do not require temporal analysis, such as counting objects or \
identifying attributes. Usage: <tool_call>{"tool_name": "frame_selection", "query": "a textual description of the \
desired scene or moment."}</tool_call>
4. Spatial grounding tool: Locates specified objects with bounding boxes in a specific static scene, the frame at \
"time" (in seconds; e.g. the frame frame_selection found). Usage: <tool_call>{"tool_name": "spatial_grounding", \
"objects": ["object1", "object2", ...], "time": a timestamp in seconds}</tool_call>
5. Trim tool: Grounds a detailed temporal window if you can get direct start and end timestamps from question, options \
or thinking process. It is also useful when you want to look at the video clip which is "before" or "after" some \
events, the default "start" is 0 and "end" is the duration of the video if you don't provide. The timestamp should be \
transferred into seconds. Usage: <tool_call>{"tool_name": "trim", "start": start timestamp, should be a float, "end": \
end timestamp, should be a float.}</tool_call>
6. Temporal Count tool: Ground a detailed event which can happen multiple times in the video, the tool will ground all \
related clip and concat them together. It should be used when the question explicitly requires count the number of \
some events. Usage: <tool_call>{"tool_name": "temporal_count", "query": "the event you want to count."}</tool_call>
#Instructions
1. In each step, you need to give a decomposed thinking process, and evaluate whether it is needed to use tools and \
which tools to use.
2. You need to consider carefully which tool to use for similar type for different question type. (temporal grounding, \
temporal count and frame selection) (spatial tracking and spatial grounding)
3. After calling tools and getting return results, you need to analyze the results and judge whether the results is \
useful. If not, you can recall the tool with different parameters.
4. The results obtained from the tool may not always be accurate. You need to carefully watch the newly obtained \
fragments and analyze whether there is content you need. If not, proceed to the next step of analysis.
5. If you think the process is ended and no more steps in needed, you need to output the final answer in \
<answer></answer> tags. e.g. <answer>Answer here</answer>."""

#: Weaver's tool library (Table 1), in its prompt's order
WEAVER_TOOLS = ["temporal_grounding", "spatial_tracking", "frame_selection", "spatial_grounding", "trim",
                "temporal_count"]

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
    # greedy, no forced final turn. Every call of a response is run (LongVT's model makes one per turn). Our
    # reader samples at most 512 overview frames; the chat template's exact
    # tool-turn wrapping is the Hermes one (a <tool_response> block per result in one user turn).
    "longvt": {
        "frames": {"fps": 1.0, "max_frames": 512, "crop_max_frames": 128, "crop_fps": 1.0},
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
    # Weaver (weaver.txt): the policy calls one of its six tools per turn (Table 1; every tool a model-backed tool
    # of this runtime, or trim), each tool's output goes into the interleaved context as frames (the grounded clip,
    # the selected frame, the spliced clips, the tracked clip with its boxes drawn; a text-only result stays text),
    # all earlier tokens concatenated (the sequential path continues exact ids); its system prompt (B.2, which
    # describes the tools itself); at most 10 conversation turns (Table 7: 9 tool turns, then the episode ends);
    # 128 uniformly sampled overview frames and tool frames at 1 fps (Sec. 4.1; the paper states no per-tool cap:
    # 32 here). Its tools stay frozen in training: the `weaver` training method (paravt_train/methods.py:
    # tool_model_calls freeze, its reward).
    "weaver": {
        "mode": "sequential",
        "tools": list(WEAVER_TOOLS),
        "system_prompt": WEAVER_SYSTEM_PROMPT,
        "frames": {"fps": 2.0, "max_frames": 128, "n_frames": 128, "crop_fps": 1.0, "crop_max_frames": 32},
        "layout": {"evidence": "frames", "final_turn": "none"},
        "max_turns": 9,
        "think_prefix": "",
    },
    # VideoChat-M1 (videochat-m1-supplement.txt): a team of four agents (the paper's are four text LLMs, Qwen3-8B,
    # Qwen3-4B, Qwen2.5-7B, Qwen2.5-3B: give each its `model` and `vision: false` to reproduce that team) plan,
    # run one tool per turn, decide continue() / add tool after every step, answer, and the consensus wins
    # (collab.protocol cpp); at most 5 turns; generation up to 1024 tokens. Its tools map to this runtime's:
    # crop_video (Time Stamp Retrieval + a browser's summary), temporal_grounding (the Grounding Tool),
    # frame_selection (Image Retrieval).
    "videochat-m1": {
        "mode": "collaborative",
        "tools": ["crop_video", "temporal_grounding", "frame_selection"],
        "collab": {"protocol": "cpp", "turns": 5, "consensus": "majority", "reason_summary": True,
                   "agents": [{"name": "alpha"}, {"name": "beta"}, {"name": "gamma"}, {"name": "delta"}],
                   "agent_sampling": {"max_new_tokens": 1024}},
        "think_prefix": "",
    },
}


#: the model family (``model_type``) of each preset's released checkpoint, or of the model its paper trains: ParaVT-8B
#: is a Qwen3-VL-8B; LongVT-RFT-7B, Weaver and VideoChat-M1's VLM are Qwen2.5-VL-7B. Informational: the frame geometry
#: comes from the model the agent runs (a 28-pixel unit for Qwen2.5-VL), never from the preset.
PRESET_FAMILIES: dict[str, str | None] = {
    "paravt": None,  # any model trained here
    "paravt-rl": "qwen3_vl",
    "paravt-eval": "qwen3_vl",
    "longvt": "qwen2_5_vl",
    "weaver": "qwen2_5_vl",
    "videochat-m1": "qwen2_5_vl",
}


def preset_names() -> list[str]:
    return list(PRESETS)


def preset_settings(name: str) -> dict:
    """A copy of a preset's settings (an ``AgentConfig`` dict). Raises ``ValueError`` for an unknown name."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[name])
