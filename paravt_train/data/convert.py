"""Sequential → parallel trace conversion (paper, Section 3.1.3 and Appendix B).

A sequential trace issues one ``crop_video`` call per assistant turn and gets
the cropped frames back in the next user turn. This module:

1. reads every call with its window and the assistant continuation that
   consumed its frames;
2. replaces each frame response by a text summary of the segment, taken from that
   continuation (its reasoning, tool blocks removed);
3. merges adjacent calls into one parallel turn when they are independent: their
   windows do not overlap, neither summary cites a time inside the other's window,
   and the later call is not announced as a refinement ("closer", "zoom", ...);
   dependent calls stay on their own turn;
4. drops calls with ``start >= end`` and samples whose final answer is empty.

The output uses the runtime's own formats (:func:`paravt_agent.protocol.render_tool_call`,
:func:`paravt_agent.prompts.tool_response_message`), so SFT sees exactly what the agent produces.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from paravt_agent.prompts import tool_response_message
from paravt_agent.protocol import (
    extract_answer,
    format_time,
    parse_time,
    parse_tool_calls,
    render_tool_call,
    split_think,
    strip_tool_blocks,
)

__all__ = ["ConversionStats", "convert_sample", "convert_rows"]

REFINE_WORDS = re.compile(r"\b(closer|zoom|refin\w*|narrow\w*|more precisely|re-?check|again)\b", re.I)
TIME_RE = re.compile(r"\b(\d{1,2}:\d{2}(?::\d{2})?|\d+(?:\.\d+)?\s*(?:s|sec|seconds)\b)")


@dataclass
class Call:
    start: float
    end: float
    think: str  # reasoning of the turn that issued the call
    issued_by: str  # that turn's whole text
    summary: str = ""


@dataclass
class ConversionStats:
    samples_in: int = 0
    samples_out: int = 0
    calls_in: int = 0
    calls_out: int = 0
    turns_in: int = 0
    turns_out: int = 0
    dropped: Counter = field(default_factory=Counter)
    dropped_calls: Counter = field(default_factory=Counter)

    def report(self) -> str:
        per_in = self.calls_in / self.turns_in if self.turns_in else 0.0
        per_out = self.calls_out / self.turns_out if self.turns_out else 0.0
        lines = [
            f"samples: {self.samples_in} in, {self.samples_out} out",
            f"tool calls per turn: {per_in:.2f} before, {per_out:.2f} after "
            f"({self.calls_in} calls in {self.turns_in} turns -> {self.calls_out} calls in {self.turns_out} turns)",
        ]
        for why, n in sorted(self.dropped.items()):
            lines.append(f"dropped sample ({why}): {n}")
        for why, n in sorted(self.dropped_calls.items()):
            lines.append(f"dropped call ({why}): {n}")
        return "\n".join(lines)


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text") or "" for p in content if p.get("type") == "text")


def _times_in(text: str) -> list[float]:
    out = []
    for m in TIME_RE.finditer(text):
        try:
            out.append(parse_time(m.group(1).replace("seconds", "").replace("sec", "").strip()))
        except ValueError:
            continue
    return out


def _cites(summary: str, window: tuple[float, float]) -> bool:
    return any(window[0] <= t <= window[1] for t in _times_in(summary))


def independent(a: Call, b: Call) -> bool:
    """May ``b`` run in the same turn as ``a``?"""
    if a.start < b.end and b.start < a.end:
        return False  # overlapping windows: b refines or re-checks a
    if _cites(b.summary, (a.start, a.end)) or _cites(a.summary, (b.start, b.end)):
        return False
    return not REFINE_WORDS.search(b.think)


def _summary_of(consumer: str) -> str:
    reasoning, rest = split_think(consumer)
    text = reasoning or strip_tool_blocks(rest)
    text = re.sub(r"<answer>.*?(</answer>|$)", "", strip_tool_blocks(text), flags=re.S)
    return " ".join(text.split())


def convert_sample(messages: list[dict], stats: ConversionStats) -> list[dict] | None:
    """One sequential trace → its parallel form, or None when the sample is dropped."""
    stats.samples_in += 1
    if len(messages) < 3 or messages[-1]["role"] != "assistant":
        stats.dropped["no final assistant turn"] += 1
        return None
    final_text = _text(messages[-1]["content"])
    tagged = re.findall(r"<answer>(.*?)</answer>", final_text, re.S)
    answer = (tagged[-1] if tagged else extract_answer(final_text)).strip()
    if not answer:
        stats.dropped["empty answer"] += 1
        return None
    head = [m for m in messages[:2]]
    turns = messages[2:]
    calls: list[Call] = []
    i = 0
    while i < len(turns):
        m = turns[i]
        if m["role"] == "assistant":
            text = _text(m["content"])
            parsed = [c for c in parse_tool_calls(text) if c.ok and c.name == "crop_video"]
            if parsed:
                stats.turns_in += 1
                stats.calls_in += len(parsed)
                consumer = next((_text(t["content"]) for t in turns[i + 1 :] if t["role"] == "assistant"), "")
                for c in parsed:
                    a = c.arguments
                    try:
                        start = parse_time(a.get("start_time", a.get("start")))
                        end = parse_time(a.get("end_time", a.get("end")))
                    except (ValueError, TypeError):
                        stats.dropped_calls["unparseable times"] += 1
                        continue
                    if start >= end:
                        stats.dropped_calls["start >= end"] += 1
                        continue
                    calls.append(Call(start, end, split_think(text)[0], text, _summary_of(consumer)))
        i += 1
    out = list(head)
    group: list[Call] = []

    def flush():
        if not group:
            return
        think = group[0].think or "I will inspect these windows."
        body = "\n".join(render_tool_call("crop_video", {"start_time": c.start, "end_time": c.end}) for c in group)
        out.append({"role": "assistant", "content": f"<think>\n{think}</think>\n{body}"})
        labels = [(f"crop_video({format_time(c.start)}-{format_time(c.end)})", c.summary or "(no summary)")
                  for c in group]
        out.append(tool_response_message(labels))
        stats.turns_out += 1
        stats.calls_out += len(group)
        group.clear()

    for c in calls:
        if group and not all(independent(g, c) for g in group):
            flush()
        group.append(c)
    flush()
    final = _text(messages[-1]["content"])
    reasoning, _ = split_think(final)
    out.append({"role": "assistant", "content": f"<think>\n{reasoning}</think>\n<answer>{answer}</answer>"})
    stats.samples_out += 1
    return out


def convert_rows(rows: list[dict], stats: ConversionStats | None = None) -> tuple[list[dict], ConversionStats]:
    """Convert SFT rows (``messages`` as JSON strings or lists)."""
    import json

    stats = stats or ConversionStats()
    out = []
    for row in rows:
        msgs = row["messages"]
        msgs = json.loads(msgs) if isinstance(msgs, str) else msgs
        conv = convert_sample(msgs, stats)
        if conv is not None:
            out.append({**row, "messages": conv})
    return out, stats
