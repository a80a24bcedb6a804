"""The toy world: long synthetic videos whose evidence sits in short windows.

A world is a timeline of solid-colour segments, 2-4 s each, over 60-120 s,
encoded as a 1 fps 32x32 H.264 mp4. One colour (the "unique" colour) appears
exactly once. Questions, in the paper's three families:

* ``mcq`` — "What colour is shown at second t?" with four options (answered with the
  option's text, which the protocol maps to its letter);
* ``oe``  — the same without options (answer: the colour name; scored by token F1);
* ``tvg`` — "When is the <unique colour> segment shown?" → ``[start, end]``.

Sub-agents see the question. For a colour-at-t question they list the colour of
every second of their 2-second window ("95 red; 96 red; 97 blue"); for grounding
they scan a 15-second window and list the seconds showing the colour asked
about ("cyan at: 21 22 23" or "cyan at: none").

Design (what makes the tool matter): segments are short, so at n = 4 or 8
overview frames the frame nearest to t usually shows another segment, and the
unique segment is usually not in the overview at all; at n = 64 (≈1 frame per
1-2 s) every segment is visible. Sub-agent summaries are per-second
listings (run-length summaries did not learn in a tiny model; listings did). The planner's answer turn copies the entry it needs
into its reasoning before answering ("97 blue."; "cyan at: 21 22 23.") with the
tool response's own tokens, and each training question also appears once with
only the answer turn in the loss (the answer step was the bottleneck). For a
colour-at-t question the planner lists the window starting at t first, so the
needed entry opens the tool response.

Trace formats are built from ground truth with the runtime's own prompt and
protocol functions, so the trained policy and the agent speak the same protocol.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from paravt_agent.prompts import (
    NO_TOOL_SYSTEM_PROMPT,
    SUBAGENT_SYSTEM_PROMPT,
    question_text,
    subagent_request,
    tool_response_message,
    tool_system_prompt,
)
from paravt_agent.protocol import format_time, render_tool_call, split_think

__all__ = ["COLOURS", "World", "make_world", "make_worlds", "nearest_frame_answer", "Question"]

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (230, 25, 75),
    "green": (60, 180, 75),
    "yellow": (255, 225, 25),
    "blue": (0, 110, 220),
    "orange": (245, 130, 48),
    "purple": (145, 30, 180),
    "cyan": (70, 240, 240),
    "white": (250, 250, 250),
}
LETTERS = "ABCD"
MCQ_WINDOW = 2  # MCQ: two parallel windows [t, t+2] and [t-2, t]; both see second t
SCAN_WINDOW = 15  # TVG: windows of 15 s (16 frames at 1 fps) covering the whole video


@dataclass
class Question:
    qid: str
    task: str  # mcq | oe | tvg
    question: str
    answer: str  # letter, colour name, or "[start, end]"
    options: list[str] | None = None
    t: int | None = None
    colour: str | None = None
    span: tuple[int, int] | None = None


@dataclass
class World:
    wid: str
    duration: int
    segments: list[tuple[str, int, int]]  # (colour, start, end) in whole seconds, end exclusive
    unique: str
    video: str = ""
    questions: list[Question] = field(default_factory=list)

    def colour_at(self, t: float) -> str:
        for c, a, b in self.segments:
            if a <= t < b:
                return c
        return self.segments[-1][0]

    def summary(self, q: Question, start: float, end: float) -> str:
        """What a correct sub-agent reports for question ``q`` on window [start, end]."""
        return self.sightings(q.colour, start, end) if q.task == "tvg" else self.listing(start, end)

    def listing(self, start: float, end: float) -> str:
        """The sub-agent's target: one entry per second of the window."""
        secs = range(int(math.ceil(start)), int(math.floor(min(end, self.duration - 1))) + 1)
        return "; ".join(f"{s} {self.colour_at(s)}" for s in secs)

    def sightings(self, colour: str, start: float, end: float) -> str:
        """A grounding sub-agent's target: the seconds of the window that show ``colour``."""
        secs = range(int(math.ceil(start)), int(math.floor(min(end, self.duration - 1))) + 1)
        seen = [str(s) for s in secs if self.colour_at(s) == colour]
        return f"{colour} at: {' '.join(seen) if seen else 'none'}"

    def scan_windows(self) -> list[tuple[int, int]]:
        return [(a, min(a + SCAN_WINDOW, self.duration)) for a in range(0, self.duration - 1, SCAN_WINDOW)]

    def write(self, path: str | Path) -> str:
        from paravt_train.toy.render import write_segments

        segs = [(COLOURS[c], b - a) for c, a, b in self.segments]
        self.video = write_segments(path, segs, fps=1, width=32, height=32, gop=8)
        return self.video


def make_world(seed: int, min_len: int = 60, max_len: int = 90) -> World:
    rng = random.Random(seed)
    duration = rng.randint(min_len, max_len)
    names = list(COLOURS)
    unique = rng.choice(names)
    others = [c for c in names if c != unique]
    segs, t, prev = [], 0, None
    while t < duration:
        n = min(rng.randint(2, 4), duration - t)
        c = rng.choice([c for c in others if c != prev])
        segs.append([c, t, t + n])
        t, prev = t + n, c
    if segs[-1][2] - segs[-1][1] < 2 and len(segs) > 1:  # no 1-second tail
        segs[-2][2] = segs[-1][2]
        segs.pop()
    # the unique colour replaces one inner segment (its neighbours differ from it by construction)
    k = rng.randrange(1, len(segs) - 1)
    segs[k][0] = unique
    world = World(f"w{seed}", duration, [tuple(s) for s in segs], unique)
    world.questions = _questions(world, rng)
    return world


def _questions(w: World, rng: random.Random) -> list[Question]:
    qs = []
    t = rng.randint(MCQ_WINDOW, w.duration - 1 - MCQ_WINDOW)
    colour = w.colour_at(t)
    distract = rng.sample([c for c in COLOURS if c != colour], 3)
    opts = [colour, *distract]
    rng.shuffle(opts)
    qs.append(Question(f"{w.wid}-mcq", "mcq", f"What colour is shown at second {t}?",
                       LETTERS[opts.index(colour)], [f"{LETTERS[i]}. {o}" for i, o in enumerate(opts)], t, colour))
    t2 = rng.randint(MCQ_WINDOW, w.duration - 1 - MCQ_WINDOW)
    qs.append(Question(f"{w.wid}-oe", "oe", f"What colour is shown at second {t2}? Answer with the colour name.",
                       w.colour_at(t2), None, t2, w.colour_at(t2)))
    _, a, b = next(s for s in w.segments if s[0] == w.unique)
    qs.append(Question(f"{w.wid}-tvg", "tvg", f"When is the {w.unique} segment shown? Answer [start, end] in seconds.",
                       f"[{a}, {b}]", None, None, w.unique, (a, b)))
    return qs


def make_worlds(seeds, video_dir: str | Path, progress: bool = False) -> list[World]:
    from tqdm.auto import tqdm

    video_dir = Path(video_dir)
    video_dir.mkdir(parents=True, exist_ok=True)
    worlds = []
    for s in tqdm(list(seeds), desc="toy videos", disable=not progress, leave=False):
        w = make_world(s)
        w.write(video_dir / f"{w.wid}.mp4")
        worlds.append(w)
    return worlds


# --------------------------------------------------------------------------- traces


def windows_for(w: World, q: Question) -> list[tuple[int, int]]:
    if q.task == "tvg":
        return w.scan_windows()
    # the window that starts at t comes first: the needed entry opens the tool response
    return [(q.t, q.t + MCQ_WINDOW), (q.t - MCQ_WINDOW, q.t)]


def answer_turn(w: World, q: Question) -> str:
    """The planner's final turn: copy the needed entry verbatim into the think, then answer with its words.

    The copy repeats the tool response's own tokens ("32 red" → "32 red.", answer " red"), so each
    step is a plain copy for a small model: the match-and-copy of an induction head, no re-spelling.
    Grounding answers the first and last second seen (1 fps evidence cannot place the end more finely).
    """
    if q.task == "tvg":
        a, b = q.span
        secs = list(range(a, b))
        return (f"<think>\n{q.colour} at: {' '.join(map(str, secs))}.</think>\n"
                f"<answer>[{secs[0]}, {secs[-1]}]</answer>")
    # MCQ answers with the option's text; the protocol's choice extraction maps it to its letter
    return f"<think>\n{q.t} {q.colour}.</think>\n<answer> {q.colour}</answer>"


def planner_turn(q: Question, windows: list[tuple[int, int]]) -> str:
    where = f"around second {q.t}" if q.task != "tvg" else "the whole video"
    calls = "\n".join(render_tool_call("crop_video", {"start_time": a, "end_time": b}) for a, b in windows)
    return f"<think>\nInspect {where}.</think>\n{calls}"


def _user(video: str, n: int, q: Question) -> dict:
    return {"role": "user", "content": [{"type": "video", "video": video, "n_frames": n},
                                        {"type": "text", "text": question_text(q.question, q.options)}]}


def _label(a: float, b: float) -> str:
    return f"crop_video({format_time(a)}-{format_time(b)})"


def parallel_trace(w: World, q: Question, video: str, n: int, tools_schema: list[dict]) -> list[dict]:
    wins = windows_for(w, q)
    return [
        {"role": "system", "content": tool_system_prompt(tools_schema)},
        _user(video, n, q),
        {"role": "assistant", "content": planner_turn(q, wins)},
        tool_response_message([(_label(a, b), w.summary(q, a, b)) for a, b in wins]),
        {"role": "assistant", "content": answer_turn(w, q)},
    ]


def sequential_trace(w: World, q: Question, video: str, n: int, tools_schema: list[dict]) -> list[dict]:
    wins = windows_for(w, q)
    msgs = [{"role": "system", "content": tool_system_prompt(tools_schema, sequential=True)}, _user(video, n, q)]
    for a, b in wins:
        msgs.append({"role": "assistant", "content": planner_turn(q, [(a, b)])})
        msgs.append(tool_response_message([(_label(a, b), w.summary(q, a, b))]))
    msgs.append({"role": "assistant", "content": answer_turn(w, q)})
    return msgs


def overview_seconds(duration: int, n: int) -> list[int]:
    from paravt_agent.video import overview_times

    return [int(t) for t in overview_times(float(duration), n=n)]


def nearest_frame_answer(w: World, q: Question, n: int) -> str:
    """The shortcut: read the overview frame nearest to the asked moment (TVG: the visible unique frames)."""
    secs = overview_seconds(w.duration, n)
    if q.task == "tvg":
        seen = [s for s in secs if w.colour_at(s) == q.colour]
        if not seen:
            mid = w.duration // 2
            return f"[{mid - 2}, {mid + 2}]"
        return f"[{seen[0]}, {seen[-1] + 1}]"
    near = min(secs, key=lambda s: (abs(s - q.t), s))
    colour = w.colour_at(near)
    if q.task == "oe":
        return colour
    names = [o.split(". ", 1)[1] for o in q.options]
    return LETTERS[names.index(colour)] if colour in names else "A"


def direct_trace(w: World, q: Question, video: str, n: int) -> list[dict]:
    """Mode none: answer from the overview, reading the nearest frame (what can be seen)."""
    secs = overview_seconds(w.duration, n)
    guess = nearest_frame_answer(w, q, n)
    if q.task == "tvg":
        seen = [s for s in secs if w.colour_at(s) == q.colour]
        think = f"{q.colour} seen at: {' '.join(map(str, seen))}." if seen else f"{q.colour} not seen."
    else:
        near = min(secs, key=lambda s: (abs(s - q.t), s))
        think = f"Nearest frame {near}: {w.colour_at(near)}."
        guess = w.colour_at(near)  # answered with the colour's name, as in the tool traces
    return [
        {"role": "system", "content": NO_TOOL_SYSTEM_PROMPT},
        _user(video, n, q),
        {"role": "assistant", "content": f"<think>\n{think}</think>\n<answer> {guess}</answer>"},
    ]


def subagent_sample(w: World, q: Question, video: str, window: tuple[int, int]) -> list[dict]:
    a, b = window
    return [
        {"role": "system", "content": SUBAGENT_SYSTEM_PROMPT},
        {"role": "user", "content": [{"type": "video", "video": video, "start": a, "end": b},
                                     {"type": "text", "text": subagent_request(q.question)}]},
        {"role": "assistant", "content": w.summary(q, a, b)},
    ]


def sft_rows(worlds: list[World], tools_schema: list[dict], seed: int = 0, nframes=(4, 8, 16, 32, 64),
             video_root: str | Path | None = None) -> list[dict]:
    """SFT rows: parallel traces (most), sequential and direct-answer traces, and sub-agent samples."""
    rng = random.Random(seed)
    rows = []
    for w in worlds:
        video = Path(w.video).name if video_root else w.video
        for q in w.questions:
            n = rng.choice(nframes)
            rows.append({"id": f"{q.qid}-par", "messages": parallel_trace(w, q, video, n, tools_schema)})
            # the answer step is the hard one: a second view of it with the planner turn as context only
            answer_only = parallel_trace(w, q, video, rng.choice(nframes), tools_schema)
            answer_only[2] = {**answer_only[2], "train": False}
            rows.append({"id": f"{q.qid}-ans", "messages": answer_only})
            r = rng.random()
            if r < 0.25:
                rows.append({"id": f"{q.qid}-seq", "messages": sequential_trace(w, q, video, rng.choice(nframes),
                                                                                   tools_schema)})
            elif r < 0.5:
                rows.append({"id": f"{q.qid}-dir", "messages": direct_trace(w, q, video, rng.choice(nframes))})
            wins = windows_for(w, q)
            for win in rng.sample(wins, min(2, len(wins))):
                rows.append({"id": f"{q.qid}-sub{win[0]}", "messages": subagent_sample(w, q, video, win)})
    rng.shuffle(rows)
    return rows


def rl_rows(worlds: list[World], video_root: str | Path | None = None) -> list[dict]:
    rows = []
    for w in worlds:
        video = Path(w.video).name if video_root else w.video
        for q in w.questions:
            prompt = [{"role": "system", "content": "toy"}, _user(video, 64, q)]
            rows.append({"id": q.qid, "prompt": prompt, "videos": [video], "answer": q.answer,
                         "question_type": q.task, "options": q.options, "question": q.question})
    return rows


def corpus(rows: list[dict]) -> list[str]:
    """Every text of the SFT rows, for training the tokenizer."""
    out = []
    for r in rows:
        for m in r["messages"]:
            c = m["content"]
            if isinstance(c, str):
                out.append(c)
            else:
                out.extend(p["text"] for p in c if p.get("type") == "text")
    return out


def check_trace_roundtrip(rows: list[dict]) -> None:
    """Sanity: every trace's assistant turns parse with the runtime's own protocol."""
    from paravt_agent.protocol import extract_answer, parse_tool_calls

    for r in rows:
        for m in r["messages"]:
            if m["role"] == "assistant" and "<tool_call>" in m["content"]:
                assert all(c.ok for c in parse_tool_calls(m["content"])), r["id"]
            if m["role"] == "assistant" and "<answer>" in m["content"]:
                assert extract_answer(m["content"]) and split_think(m["content"])[0], r["id"]
