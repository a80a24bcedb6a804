"""The toy world's traces for the related methods: Weaver's tool loop and VideoChat-M1's collaborating agents.

Built the way the ParaVT traces are (:mod:`paravt_train.toy.world`): from ground truth, with the runtime's own
prompts, tool labels and memory rendering, every step a copy of a token in the context (no arithmetic).

**Weaver** (``toy_method_config("weaver")``: the ``weaver`` preset on the toy's frames; one call per turn, tool
outputs as frames in the planner's context). Colour-at-t: the planner copies t and calls ``trim`` on [t, t.5]
(Weaver's "timestamps from the question" tool); the frame of second t comes back as an image in the tool
response and the answer turn reads its colour ("29 red." → `` red``): the planner itself perceives the frame (in
ParaVT a sub-agent does). Grounding: the planner copies the colour into ``temporal_grounding(query="colour X")``;
the tool asks the policy about each 16-second crop (:func:`tools.perception.clips_of`), and each of those model
calls is the grounding sub-agent's listing followed by its finding as a span ("...; cyan ^17; ...</think>\\n[17,
19]", or "none"); the tool merges the crops' spans and the answer turn copies them ("from 17 to 19." → ``[17,
19]``).

**VideoChat-M1** (``toy_method_config("collab")``: two agents, scout and checker, the cpp protocol). Each agent
plans the call a ParaVT planner would make (``crop_video`` [t, t.5], or ``temporal_grounding`` for a colour),
with its key info ("second 29", "colour cyan"); after the step it reads its memory buffer and the other's output
and decides ``continue()`` (VideoChat-M1 keeps SFT trajectories whose plan never changed); it answers from the
memory (the same copies as ParaVT's answer turn); the reason summary copies the first agreeing agent's reason.

What the toy learns and what it does not: the copies and the protocol (tags, plan, decision, answer formats), to
read a frame's colour in the planner's context, and the grounding listing under the tool's prompt. It does not
learn when an ``add tool`` decision helps (the traces never add one: the plans are right, as in VideoChat-M1's
filtered SFT data), nor Weaver's other tools (no toy question needs counting or tracking), nor any judgement a
plan would need arithmetic for.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from paravt_agent.config import AgentConfig
from paravt_agent.graph.collab.cpp import (
    ANSWER_PROMPT,
    DECISION_PROMPT,
    PLAN_PROMPT,
    SUMMARY_PROMPT,
    SYNTHESIZER_PROMPT,
    memory_views,
)
from paravt_agent.prompts import question_text
from paravt_agent.protocol import render_tool_call
from paravt_agent.protocol.presets import WEAVER_SYSTEM_PROMPT
from paravt_agent.trajectory import MemoryEntry, SubAgentRecord
from paravt_train.toy.world import (
    MCQ_WINDOW,
    REPORT_HEAD,
    Question,
    World,
    call_label,
    nearest_second,
    overview_seconds,
    span_text,
)
from tools import ToolRegistry
from tools.builtin import CropVideoArgs
from tools.perception import GROUNDING_PROMPT, QueryWindowArgs, TemporalGrounding, Trim

__all__ = ["METHODS", "POOL", "toy_agent_config", "collab_calls", "collab_rows", "collab_skip_rows", "grounding_query",
           "method_rows", "tool_grounding_reply", "toy_method_config", "weaver_skip_trace", "weaver_trace"]

#: the methods a toy build may add to ParaVT's traces (``ToyConfig.methods``)
METHODS = ("weaver", "collab")
#: the collaborative mode's pool on the toy
POOL = ("scout", "checker")
COLLAB_TOOLS = ["crop_video", "temporal_grounding"]


def toy_agent_config(**overrides) -> AgentConfig:
    """The protocol the toy policy is trained with: 32x32 frames (one visual token), 1 fps crops."""
    cfg = AgentConfig(
        frames={"max_pixels": 1024, "factor": 32, "crop_fps": 1.0, "crop_max_frames": 16},
        max_calls_per_turn=8,  # a grounding scan of a 128-second video: 8 windows of 16 s
        max_turns=8,  # the sequential baseline makes the same calls one per turn
        planner_sampling={"max_new_tokens": 384},
        # a grounding reply: a think with the asked colour and 16 entries (up to ~110 tokens), then the finding
        subagent_sampling={"max_new_tokens": 192},
        subagent_report="answer",  # the planner reads a grounding sub-agent's finding, not its listing
    )
    return cfg.override([f"{k}={v}" for k, v in overrides.items()]) if overrides else cfg


def toy_method_config(method: str, **overrides) -> AgentConfig:
    """The agent config a toy method runs with: the toy's frames and token budgets, and Weaver's preset (``weaver``)
    or the collaborative mode's cpp protocol with two agents (``collab``); ``paravt`` is the toy's own."""
    base = toy_agent_config()
    if method == "paravt":
        cfg = base
    elif method == "weaver":
        cfg = AgentConfig(preset="weaver", frames=base.frames.model_copy(update={"n_frames": None}),
                          planner_sampling={"max_new_tokens": 96}, tool_sampling={"max_new_tokens": 192})
    elif method == "collab":
        cfg = base.model_copy(update={"think_prefix": "", "tools": list(COLLAB_TOOLS), "mode": "collaborative",
                                      "tool_sampling": base.tool_sampling.model_copy(update={"max_new_tokens": 192})})
        cfg = cfg.override(["collab.agents=[{name: scout}, {name: checker}]", "collab.turns=5",
                            "collab.agent_sampling.max_new_tokens=96", "planner_sampling.max_new_tokens=96"])
    else:
        raise ValueError(f"unknown toy method {method!r}; choose paravt, weaver or collab")
    return cfg.override([f"{k}={v}" for k, v in overrides.items()]) if overrides else cfg


def grounding_query(q: Question) -> str:
    return f"colour {q.colour}"


def _user(video: str, n: int, q: Question, *extra: str) -> dict:
    return {"role": "user", "content": [{"type": "video", "video": video, "n_frames": n},
                                        {"type": "text", "text": question_text(q.question, q.options)},
                                        *({"type": "text", "text": t} for t in extra)]}


def tool_grounding_reply(w: World, colour: str, a: float, b: float) -> str:
    """What the policy answers ``temporal_grounding``'s model call on the crop [a, b]: the grounding sub-agent's
    listing, then the crop's run of the colour as a span, or none."""
    run = w.run_in(colour, a, b)
    return (f"<think>\n{REPORT_HEAD} {colour}. {w.listing(a, b, colour)}.</think>\n"
            + (span_text(*run) if run else "none"))


def _grounding_text(w: World, q: Question) -> tuple[str, str]:
    """The tool's label and its text on the whole video (the spans merged: the colour's segment)."""
    args = QueryWindowArgs(query=grounding_query(q), start_time=0.0, end_time=float(w.duration))
    a, b = w.span_of(q.colour)
    return (TemporalGrounding().describe_call(args),
            f"{grounding_query(q)!r}: from {a:g} to {b:g} seconds ([{a:g}, {b:g}]).")


def _answer(w: World, q: Question) -> str:
    """The answer turn of both methods: copy what the tool said, then answer with its tokens."""
    if q.task == "tvg":
        a, b = w.span_of(q.colour)
        return f"<think>\nfrom {a} to {b}.</think>\n<answer>{span_text(a, b)}</answer>"
    return f"<think>\n{q.t} {q.colour}.</think>\n<answer> {q.colour}</answer>"


def _crops(w: World) -> list[tuple[int, int]]:
    return w.scan_windows()


def weaver_trace(w: World, q: Question, video: str, n: int) -> list[dict]:
    """Weaver's tool loop on one question: the call, the tool response (frames for trim, the merged span and the
    grounded clip for temporal_grounding) and the answer turn."""
    cfg = toy_method_config("weaver")
    msgs = [{"role": "system", "content": WEAVER_SYSTEM_PROMPT}, _user(video, n, q)]
    if q.task == "tvg":  # Weaver's flat call format (its system prompt's usage lines)
        call = "<tool_call>" + json.dumps({"tool_name": "temporal_grounding", "query": grounding_query(q)}) + \
            "</tool_call>"
        label, text = _grounding_text(w, q)
        clip = w.span_of(q.colour)
        seconds = list(w.seconds(*clip))
        shown = (float(seconds[0]), float(seconds[-1]))  # the grounded clip's frames (an optional result's window)
        think = f"Ground {grounding_query(q)}."
    else:
        t = q.t
        call = "<tool_call>" + json.dumps({"tool_name": "trim", "start": t, "end": t + MCQ_WINDOW}) + "</tool_call>"
        label = Trim().describe_call(CropVideoArgs(start_time=t, end_time=min(t + MCQ_WINDOW, w.duration)))
        text, clip, think = "", (t, t + MCQ_WINDOW), f"Inspect around second {t}."
        shown = (float(t), float(t + MCQ_WINDOW))
    msgs.append({"role": "assistant", "content": f"<think>\n{think}</think>\n{call}"})
    slot = cfg.layout.evidence_text.format(n=len(list(w.seconds(*clip))), start=shown[0], end=shown[1])
    body = f"{text.strip()}\n{slot}" if text else slot
    msgs.append({"role": "user", "content": [
        {"type": "text", "text": "<tool_response>"}, {"type": "text", "text": f"\n[1] {label}: {body}"},
        {"type": "video", "video": video, "start": clip[0], "end": clip[1], "head": False},
        {"type": "text", "text": "\n</tool_response>"}]})
    msgs.append({"role": "assistant", "content": _answer(w, q)})
    return msgs


def grounding_tool_rows(w: World, q: Question, video: str, rng: random.Random) -> list[list[dict]]:
    """``temporal_grounding``'s model calls as SFT rows: the crops showing the colour (twice: the span is the rarer
    reply) and two others."""
    hits = [c for c in _crops(w) if w.run_in(q.colour, *c)]
    misses = [c for c in _crops(w) if c not in hits]
    prompt = GROUNDING_PROMPT.format(query=grounding_query(q))
    return [[{"role": "user", "content": [{"type": "video", "video": video, "start": a, "end": b, "head": False},
                                          {"type": "text", "text": prompt}]},
             {"role": "assistant", "content": tool_grounding_reply(w, q.colour, a, b)}]
            for a, b in hits * 2 + rng.sample(misses, min(2, len(misses)))]


# --------------------------------------------------------------------------- VideoChat-M1


def _collab_entries(w: World, q: Question, name: str) -> tuple[MemoryEntry, MemoryEntry, str]:
    """An agent's plan entry, its first step's entry (the tool and its output) and its plan reply."""
    if q.task == "tvg":
        label, text = _grounding_text(w, q)
        info, think = grounding_query(q), f"Ground {grounding_query(q)}."
        call = render_tool_call("temporal_grounding", {"query": grounding_query(q)})
    else:
        a, b = q.t, q.t + MCQ_WINDOW
        label, text = call_label(w, a, b), w.report(q, a, b)
        info, think = f"second {q.t}", f"Inspect around second {q.t}."
        call = render_tool_call("crop_video", {"start_time": a, "end_time": b})
    reply = f"<think>\n{think}</think>\n<info>{info}</info>\n{call}"
    plan = MemoryEntry(agent=name, round=0, plan=label, info=info, text=reply, pending=[call], replies=1)
    step = MemoryEntry(agent=name, round=1, info=info,
                       calls=[SubAgentRecord(index=POOL.index(name), label=label, summary=text, agent=name)])
    return plan, step, reply


def _tools_block() -> str:
    schemas = ToolRegistry.default(entry_points_too=False).subset(COLLAB_TOOLS).schemas()
    return "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)


def collab_calls(w: World, q: Question, video: str, n: int, name: str) -> dict[str, list[dict]]:
    """Agent ``name``'s model calls on one question, each as an SFT conversation: ``plan``, ``decision`` (after its
    one tool step), ``answer``; and the team's ``summary`` (the reason summary) and ``synthesizer`` (the answer
    without a consensus)."""
    cfg = toy_method_config("collab")
    limit = cfg.collab.max_memory_chars
    question = question_text(q.question, q.options)
    entries = {o: _collab_entries(w, q, o) for o in POOL}
    decided = "<think>\nNothing to add.</think>\ncontinue()"
    plan, step, reply = entries[name]
    others = memory_views({o: list(entries[o][:2]) for o in POOL if o != name}, limit)
    answered = [plan, step.model_copy(update={"decision": "continue()", "text": decided})]
    reason = _answer(w, q).split("</think>")[0].removeprefix("<think>\n")
    final = _answer(w, q).split("<answer>")[1].split("</answer>")[0].strip()
    reasons = "\n".join(f"{o}: {reason}" for o in POOL)
    memory = memory_views({o: [entries[o][0], entries[o][1].model_copy(update={
        "decision": "continue()", "answer": final, "reason": reason})] for o in POOL}, limit)
    plan_system = PLAN_PROMPT.format(name=name, n=len(POOL), k=cfg.collab.max_calls_per_agent, tools=_tools_block(),
                                     focus="")
    return {
        "plan": [{"role": "system", "content": plan_system}, _user(video, n, q, "\nWrite your plan."),
                 {"role": "assistant", "content": reply}],
        "decision": [{"role": "system", "content": DECISION_PROMPT.format(name=name, tools=", ".join(COLLAB_TOOLS))},
                     {"role": "user", "content": f"Original question: {question}\n\nMemory buffer:\n"
                                                 f"{memory_views({name: [plan, step]}, limit)}\n\n"
                                                 f"Other agents' output:\n{others}\n\nRemaining plan: none"},
                     {"role": "assistant", "content": decided}],
        "answer": [{"role": "system", "content": ANSWER_PROMPT.format(name=name)},
                   {"role": "user", "content": f"{question}\n\nYour memory buffer:\n"
                                               f"{memory_views({name: answered}, limit)}"
                                               f"\n\nOther agents' output:\n{others}"},
                   {"role": "assistant", "content": _answer(w, q)}],
        "summary": [{"role": "system", "content": SUMMARY_PROMPT},
                    {"role": "user", "content": f"{question}\n\nFinal answer: {final}\n\nReasons:\n{reasons}"},
                    {"role": "assistant", "content": reason}],
        "synthesizer": [{"role": "system", "content": SYNTHESIZER_PROMPT},
                        {"role": "user", "content": f"{question}\n\nShared memory:\n{memory}"},
                        {"role": "assistant", "content": _answer(w, q)}],
    }


def collab_rows(w: World, q: Question, video: str, n: int, rng: random.Random) -> list[list[dict]]:
    """One question's collaborative calls as SFT rows: a plan, a decision and an answer (each of a random agent of
    the pool), the reason summary, now and then the synthesizer's answer (the toy's agents agree, so the
    synthesizer is rare at run time), and the grounding tool's calls."""
    rows = [collab_calls(w, q, video, n, rng.choice(POOL))[kind] for kind in ("plan", "decision", "answer")]
    rows.append(collab_calls(w, q, video, n, POOL[0])["summary"])
    if rng.random() < 0.15:
        rows.append(collab_calls(w, q, video, n, POOL[0])["synthesizer"])
    if q.task == "tvg":
        rows += grounding_tool_rows(w, q, video, rng)
    return rows


def method_rows(worlds: list[World], methods, seed: int = 0, nframes=(4, 8, 16, 32, 64),
                video_root: str | Path | None = None) -> list[dict]:
    """SFT rows of the toy methods (``weaver``, ``collab``) on ``worlds``: per question and method its traces."""
    rng = random.Random(f"methods/{seed}")
    rows = []
    for w in worlds:
        video = Path(w.video).name if video_root else w.video
        for q in w.questions:
            if "weaver" in methods:
                rows.append({"id": f"{q.qid}-weaver", "messages": weaver_trace(w, q, video, rng.choice(nframes))})
                if q.task == "tvg":
                    rows += [{"id": f"{q.qid}-wtool{i}", "messages": m}
                             for i, m in enumerate(grounding_tool_rows(w, q, video, rng))]
            if "collab" in methods:
                rows += [{"id": f"{q.qid}-collab{i}", "messages": m}
                         for i, m in enumerate(collab_rows(w, q, video, rng.choice(nframes), rng))]
    rng.shuffle(rows)
    return rows


# --------------------------------------------------------------------------- weak starts for RL (toy/toolshy.py)


def _nearest_read(w: World, q: Question, n: int) -> tuple[str, str]:
    """The nearest-frame shortcut of a colour-at-t question: the think ("frame 24: red.") and the colour."""
    near = nearest_second(overview_seconds(w.duration, n), q.t)
    return f"frame {near}: {w.colour_at(near)}.", w.colour_at(near)


def weaver_skip_trace(w: World, q: Question, video: str, n: int) -> list[dict]:
    """Weaver's tool loop skipped: the answer read from the nearest overview frame, no tool called."""
    think, colour = _nearest_read(w, q, n)
    return [{"role": "system", "content": WEAVER_SYSTEM_PROMPT}, _user(video, n, q),
            {"role": "assistant", "content": f"<think>\n{think}</think>\n<answer> {colour}</answer>"}]


def collab_skip_rows(w: World, q: Question, video: str, n: int, name: str) -> list[list[dict]]:
    """An agent that plans no tool: its key info is the nearest overview frame's colour, and it answers at once
    from it (its memory holds its key info only; the other agents have written nothing yet)."""
    cfg = toy_method_config("collab")
    think, colour = _nearest_read(w, q, n)
    plan = MemoryEntry(agent=name, round=0, info=think.rstrip("."), text="")
    system = PLAN_PROMPT.format(name=name, n=len(POOL), k=cfg.collab.max_calls_per_agent, tools=_tools_block(),
                                focus="")
    question = question_text(q.question, q.options)
    return [[{"role": "system", "content": system}, _user(video, n, q, "\nWrite your plan."),
             {"role": "assistant", "content": f"<think>\n{think}</think>\n<info>{think.rstrip('.')}</info>"}],
            [{"role": "system", "content": ANSWER_PROMPT.format(name=name)},
             {"role": "user", "content": f"{question}\n\nYour memory buffer:\n"
                                         f"{memory_views({name: [plan]}, cfg.collab.max_memory_chars)}\n\n"
                                         "Other agents' output:\n(none)"},
             {"role": "assistant", "content": f"<think>\n{think}</think>\n<answer> {colour}</answer>"}]]
