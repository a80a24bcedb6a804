"""The toy world: long synthetic videos whose evidence sits in short windows.

A world is a timeline of solid-colour segments over 64, 80, 96, 112 or 128 s
(multiples of the 16-second scan window), encoded as a 1 fps 32x32 H.264 mp4.
Segments last 2-4 s (3-6 s at 128 s): every segment is at least as long as the spacing of a
64-frame overview (so a 64-frame overview sees every segment), while an 8-frame
overview (one frame every 8-16 s) misses most of them. Two colours (the *unique*
colours) appear exactly once each. Questions, in the paper's three families:

* ``mcq`` — "What colour is shown at second t?" with four options (answered with the
  option's text, which the protocol maps to its letter);
* ``oe``  — the same without options (answer: the colour name; scored by token F1);
* ``tvg`` — "When is the segment of colour <unique colour> shown?" → ``[start, end]``.

Each question is drawn from its own seeded generator, so a world's first k
questions do not depend on how many are asked (training asks more per video
than evaluation).

How the tool is used (the traces below are built from ground truth). Each
sub-agent sees its window's frames and the question:

* colour-at-t: the planner copies t from the question and crops one window,
  [t, t.5] (t's token, then ".5": the frame of second t); the sub-agent reports it
  second first ("29 red"); the answer step copies t and the colour after it
  ("29 red.") and answers with the colour's name.
* grounding: the planner copies the duration from the overview's intro line
  ("Scan all 112 seconds.") and scans the whole video with parallel 16-second
  windows (16 frames at 1 fps each, 4-8 of them), last window first: [96, 111],
  [80, 95], ..., [0, 15]. The first call depends on the duration alone (one of five)
  and the rest count down to [0, 15], so every plan stops at the same call and no
  plan adds or compares numbers. Each sub-agent thinks: it repeats the asked colour
  and lists every second of its window, colour first, marking where the asked
  colour starts ("^") and the first entry after it ("$") on the second: "<think>\n
  Looking for colour cyan. red 16; cyan ^17; cyan 18; blue $19; ...</think>" (a run
  that reaches the window's end is closed by "$32", the second after the window).
  Then it gives its finding, the marked seconds ("Found: ^17 $19."), or "Nothing.".
  The agent runs with ``subagent_report: answer``, so the planner reads the
  findings only; the answer step copies the one or two there are, in call order
  ("Reports: Found: ^17 $19.") and answers with the last "^" second and the first
  "$" second (the calls go backwards in time), "[17, 19]".

The shipped policy's recipe (``ToyConfig.plans``, ``then``) starts on the ``neighbours``
plans (:data:`PLANS`), from which a fresh model learns exact listings (trained on the
copy plans alone it does not), then two short stages on the copy plans teach the plans.

Every step is a copy of a token the model has in its context or a comparison of a
colour with the asked one a few tokens back; no step adds to a time. Every copied
time comes after a token that says what it is ("^", "$", "second", "Scan all"), so
copying it is the lookup an induction head does (find the earlier "^", take the
token after it), which the copy warm-up teaches. The toy tokenizer has one token per
whole number ("0" ... "255", ``tiny.NUMBER_TOKENS``), the same in the frame labels
("<17.0 seconds>"), the question, the plan, the listings, the findings and the
answer, so each of those lookups is one token. Earlier designs (README, "The toy
world") split numbers into digits, so every copy was a match of several tokens,
had the planner add one to t or compare its windows with the duration, or had a
sub-agent or the answer step search a listing for the asked colour's run; this
model learned none of those. Run-length summaries, arithmetic and nearest-frame
search are what such a model gets wrong; the no-tool traces need the last one,
which is why the no-tool mode is weak below n = 64.

Trace formats use the runtime's own prompt, protocol and tool-label functions,
so the trained policy and the agent speak the same protocol (a test renders a
trace both ways and compares the tokens).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from paravt_agent.prompts import (
    NO_TOOL_SYSTEM_PROMPT,
    question_text,
    tool_response_message,
    tool_system_prompt,
)
from paravt_agent.protocol import render_tool_call, subagent_report
from paravt_agent.video import overview_times
from paravt_train.toy.render import write_segments
from tools.builtin import CropVideo, CropVideoArgs

__all__ = [
    "COLOURS",
    "MCQ_WINDOW",
    "PLANS",
    "SCAN_WINDOW",
    "Question",
    "World",
    "make_world",
    "make_worlds",
    "nearest_frame_answer",
    "nearest_second",
    "question_message",
    "segment_lengths",
]

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
DURATIONS = (64, 80, 96, 112, 128)  # multiples of the scan window: a scan is 4-8 windows that tile the video
MCQ_WINDOW = 0.5  # colour-at-t: one window [t, t + 0.5], the frame of second t; "t.5" is t's token and ".5"
REPORT_HEAD = "Looking for colour"  # a grounding sub-agent think's first words, before the asked colour (World.summary)
FOUND = "Found:"  # a grounding sub-agent's finding starts with it (World.finding)
NOTHING = "Nothing."  # a grounding sub-agent's reply when its window does not show the asked colour
REPORTS = "Reports:"  # the grounding answer step's think starts with it, then the findings it copies
RUN_NEW, RUN_GONE = "^", "$"  # the marks a grounding listing puts on where the asked colour starts and ends
SCAN_WINDOW = 16  # grounding: windows of 16 frames at 1 fps, [0, 15], [16, 31], ..., tiling the whole video
UNIQUE = 2  # colours that appear exactly once (the grounding targets)


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
    uniques: list[str]
    video: str = ""
    questions: list[Question] = field(default_factory=list)

    def colour_at(self, t: float) -> str:
        for c, a, b in self.segments:
            if a <= t < b:
                return c
        return self.segments[-1][0]

    def span_of(self, colour: str) -> tuple[int, int]:
        return next((a, b) for c, a, b in self.segments if c == colour)

    def seconds(self, start: float, end: float) -> range:
        """The frames (whole seconds) a 1 fps crop of [start, end] returns."""
        return range(int(math.ceil(start)), int(math.floor(min(end, self.duration - 1))) + 1)

    def summary(self, q: Question, start: float, end: float) -> str:
        """What a correct sub-agent replies on window [start, end] for question ``q``.

        * colour-at-t: every second of the window, second first ("28 red; 29 red"; the plan's window [t, t.5]
          has one, "29 red"): the answer step has t and copies the colour after it.
        * grounding: a think that repeats the asked colour as the question words it and lists the window
          colour first, marking the entry where the asked colour starts "^" and the first entry after it "$"
          (:meth:`listing`: "<think>\nLooking for colour cyan. red 16; cyan ^17; cyan 18; red $19;
          ...</think>"), then the finding: the marked seconds ("Found: ^17 $19.",
          :meth:`finding`). Each mark compares the entry's colour and the one before it with the asked
          colour, a few tokens back; each second of the finding is the token after its mark in the listing.
          With ``subagent_report: answer`` the planner reads only the finding (:meth:`report`)."""
        if q.task == "tvg":
            return f"<think>\n{REPORT_HEAD} {q.colour}. {self.listing(start, end, q.colour)}.</think>\n" \
                   f"{self.finding(q, start, end)}"
        return "; ".join(f"{s} {self.colour_at(s)}" for s in self.seconds(start, end))

    def report(self, q: Question, start: float, end: float) -> str:
        """What the planner reads of the sub-agent's reply (``subagent_report: answer``)."""

        return subagent_report(self.summary(q, start, end), "answer")

    def run_in(self, colour: str, start: float, end: float) -> tuple[int, int] | None:
        """The window's first run of ``colour``: its first second and the first second after it (the window's
        last second + 1 when the run reaches the window's end), or None."""
        secs = list(self.seconds(start, end))
        hits = [i for i, s in enumerate(secs) if self.colour_at(s) == colour]
        if not hits:
            return None
        i = hits[0]
        while i + 1 < len(secs) and self.colour_at(secs[i + 1]) == colour:
            i += 1
        return secs[hits[0]], secs[i] + 1

    def runs_in(self, colour: str, start: float, end: float) -> int:
        """How many runs of ``colour`` the window shows."""
        secs = list(self.seconds(start, end))
        on = [self.colour_at(s) == colour for s in secs]
        return sum(1 for i, x in enumerate(on) if x and (i == 0 or not on[i - 1]))

    def finding(self, q: Question, start: float, end: float) -> str:
        """Grounding: "Found: ^a $b." with the window's run of the asked colour as [a, b) (b is the second
        after the run, or the window's last second + 1 when the run reaches its end), else "Nothing."."""
        run = self.run_in(q.colour, start, end)
        return f"{FOUND} {RUN_NEW}{run[0]} {RUN_GONE}{run[1]}." if run else NOTHING

    def listing(self, start: float, end: float, colour: str | None = None) -> str:
        """Every second of the window, colour first: "red 16; red 17; cyan 18". With ``colour``, the entry where
        a run of it starts is marked "^" and the first entry after the run "$", on the second ("red 16; cyan
        ^17; cyan 18; red $19"); a run that reaches the window's end is closed by one more entry, "$" and the
        second after the window ("cyan 30; cyan 31; $32")."""
        out, prev = [], None
        secs = list(self.seconds(start, end))
        for s in secs:
            c = self.colour_at(s)
            if colour is not None and c == colour and prev != colour:
                out.append(f"{c} {RUN_NEW}{s}")
            elif colour is not None and c != colour and prev == colour:
                out.append(f"{c} {RUN_GONE}{s}")
            else:
                out.append(f"{c} {s}")
            prev = c
        if colour is not None and prev == colour and secs:
            out.append(f"{RUN_GONE}{secs[-1] + 1}")
        return "; ".join(out)

    def scan_windows(self) -> list[tuple[int, int]]:
        """Windows of SCAN_WINDOW frames that tile the video: [0, 15], [16, 31], ..., [d - 16, d - 1]."""
        return [(a, a + SCAN_WINDOW - 1) for a in range(0, self.duration, SCAN_WINDOW)]

    def write(self, path: str | Path) -> str:
        segs = [(COLOURS[c], b - a) for c, a, b in self.segments]
        self.video = write_segments(path, segs, fps=1, width=32, height=32, gop=8)
        return self.video


def segment_lengths(duration: int) -> tuple[int, int]:
    """Shortest and longest segment: at least the largest gap between two frames of a 64-frame overview
    (so one of its frames falls in every segment), at least 2 s, and at most twice that."""

    times = overview_times(float(duration), n=64)
    gap = max((b - a for a, b in zip(times, times[1:], strict=False)), default=1.0)
    lo = max(2, math.ceil(gap))
    return lo, 2 * lo


def make_world(seed: int, mcq: int = 1, oe: int = 1, tvg: int = 1, durations: tuple[int, ...] = DURATIONS) -> World:
    """The world of ``seed`` with its first ``mcq`` / ``oe`` / ``tvg`` questions."""
    rng = random.Random(seed)
    d = rng.choice(durations)
    lo, hi = segment_lengths(d)
    names = list(COLOURS)
    uniques = rng.sample(names, UNIQUE)
    others = [c for c in names if c not in uniques]
    segs, t, prev = [], 0, None
    while t < d:
        n = min(rng.randint(lo, hi), d - t)
        c = rng.choice([c for c in others if c != prev])
        segs.append([c, t, t + n])
        t, prev = t + n, c
    if len(segs) > 1 and segs[-1][2] - segs[-1][1] < lo:  # no short tail: the last segment absorbs it
        segs[-2][2] = segs[-1][2]
        segs.pop()
    # the unique colours replace inner segments that are not next to each other
    inner = list(range(1, len(segs) - 1))
    k1 = rng.choice(inner)
    k2 = rng.choice([k for k in inner if abs(k - k1) > 1])
    segs[k1][0], segs[k2][0] = uniques
    world = World(f"w{seed}", d, [tuple(s) for s in segs], uniques)
    world.questions = _questions(world, seed, mcq, oe, tvg)
    return world


def _questions(w: World, seed: int, mcq: int, oe: int, tvg: int) -> list[Question]:
    qs = []
    for i in range(mcq):
        rng = random.Random(f"{seed}/mcq/{i}")
        t = rng.randint(1, w.duration - 2)
        colour = w.colour_at(t)
        opts = [colour, *rng.sample([c for c in COLOURS if c != colour], 3)]
        rng.shuffle(opts)
        qs.append(Question(f"{w.wid}-mcq{i}", "mcq", f"What colour is shown at second {t}?",
                           LETTERS[opts.index(colour)], [f"{LETTERS[j]}. {o}" for j, o in enumerate(opts)], t,
                           colour))
    for i in range(oe):
        rng = random.Random(f"{seed}/oe/{i}")
        t = rng.randint(1, w.duration - 2)
        qs.append(Question(f"{w.wid}-oe{i}", "oe", f"What colour is shown at second {t}? Answer with the colour name.",
                           w.colour_at(t), None, t, w.colour_at(t)))
    for i in range(min(tvg, UNIQUE)):
        colour = w.uniques[i]
        a, b = w.span_of(colour)
        qs.append(Question(f"{w.wid}-tvg{i}", "tvg", grounding_question(colour), f"[{a}, {b}]", None, None, colour,
                           (a, b)))
    return qs


def grounding_question(colour: str) -> str:
    return f"When is the segment of colour {colour} shown? Answer [start, end] in seconds."


def make_worlds(seeds, video_dir: str | Path, progress: bool = False, **questions) -> list[World]:
    """Worlds of ``seeds`` with their videos written to ``video_dir`` (``questions``: counts per task)."""
    from tqdm.auto import tqdm

    video_dir = Path(video_dir)
    video_dir.mkdir(parents=True, exist_ok=True)
    worlds = []
    for s in tqdm(list(seeds), desc="toy videos", disable=not progress, leave=False):
        w = make_world(s, **questions)
        w.write(video_dir / f"{w.wid}.mp4")
        worlds.append(w)
    return worlds


# --------------------------------------------------------------------------- traces


#: A trace's plans (``windows_for``): "copy", the shipped ones; "neighbours", the recipe's first stage: colour-at-t
#: crops [t, t+1] and [t-1, t] (two seconds listed in each), grounding scans forward from [0, 15].
PLANS = ("copy", "neighbours")


def windows_for(w: World, q: Question, plans: str = "copy") -> list[tuple[int, int]]:
    """The windows a correct plan crops for ``q``, in call order, under ``plans`` (:data:`PLANS`)."""
    if plans not in PLANS:
        raise ValueError(f"plans must be one of {', '.join(PLANS)}, got {plans!r}")
    if plans == "neighbours":
        return w.scan_windows() if q.task == "tvg" else [(q.t, q.t + 1), (q.t - 1, q.t)]
    if q.task == "tvg":
        # last window first: the first call depends on the duration alone, the rest count down to [0, 15]
        return w.scan_windows()[::-1]
    return [(q.t, q.t + MCQ_WINDOW)]


def answer_turn(w: World, q: Question, plans: str = "copy") -> str:
    """The planner's final turn: copy what is needed into the think, then answer with its tokens.

    Every step is a copy of a token in the context, with the same tokens as the source (the toy tokenizer
    has one token per whole number, "0" ... "255", ``tiny.NUMBER_TOKENS``; " red" with its space is not "red"):

    * colour-at-t: t from the question, then the colour after it in the sub-agent's report
      ("32 red" → "32 red.", answer " red");
    * grounding: the sub-agents' findings (one, or two when the segment crosses a window's end; the other
      windows say "Nothing."), in call order ("Reports: Found: ^21 $24."); it answers with the last "^"
      second and the first "$" second (the calls go from the video's end to its start), "[21, 24]": the
      segment's start and the second the next segment starts.

    ``plans`` (:data:`PLANS`) orders the findings as the plan's calls are ordered.
    """
    if q.task == "tvg":
        found = " ".join(f for f in (w.finding(q, a, b) for a, b in windows_for(w, q, plans)) if f != NOTHING)
        a, b = w.span_of(q.colour)
        return f"<think>\n{REPORTS} {found}</think>\n<answer>{span_text(a, b)}</answer>"
    # MCQ answers with the option's text; the protocol's choice extraction maps it to its letter
    return f"<think>\n{q.t} {q.colour}.</think>\n<answer> {q.colour}</answer>"


def span_text(a: int, b: int) -> str:
    """A grounding answer as the toy writes it: "[17, 19]" (each number the same single token as in the
    findings and listings: the toy tokenizer has one token per whole number, ``tiny.NUMBER_TOKENS``)."""
    return f"[{a}, {b}]"


def planner_turn(q: Question, windows: list[tuple[int, int]], duration: int | None = None) -> str:
    """The planner's first turn: a short think, then the calls. Grounding copies the duration from the
    overview's intro line (one scan plan per duration, last window first); colour-at-t copies t from the
    question."""
    if q.task == "tvg":
        think = f"Scan all {duration if duration is not None else max(b for _, b in windows) + 1} seconds."
    else:
        think = f"Inspect around second {q.t}."
    calls = "\n".join(render_tool_call("crop_video", {"start_time": a, "end_time": b}) for a, b in windows)
    return f"<think>\n{think}</think>\n{calls}"


def call_label(w: World, a: float, b: float) -> str:
    """The tool-response label the runtime gives this call (the tool's own, after clamping to the video)."""

    return CropVideo().describe_call(CropVideoArgs(start_time=a, end_time=min(b, w.duration)))


def question_message(video: str, n: int, q: Question) -> dict:
    return {"role": "user", "content": [{"type": "video", "video": video, "n_frames": n},
                                        {"type": "text", "text": question_text(q.question, q.options)}]}


def parallel_trace(w: World, q: Question, video: str, n: int, tools_schema: list[dict],
                   plans: str = "copy") -> list[dict]:
    wins = windows_for(w, q, plans)
    return [
        {"role": "system", "content": tool_system_prompt(tools_schema)},
        question_message(video, n, q),
        {"role": "assistant", "content": planner_turn(q, wins, w.duration)},
        tool_response_message([(call_label(w, a, b), w.report(q, a, b)) for a, b in wins]),
        {"role": "assistant", "content": answer_turn(w, q, plans)},
    ]


def sequential_trace(w: World, q: Question, video: str, n: int, tools_schema: list[dict],
                     plans: str = "copy") -> list[dict]:
    wins = windows_for(w, q, plans)
    msgs = [{"role": "system", "content": tool_system_prompt(tools_schema, sequential=True)},
            question_message(video, n, q)]
    for a, b in wins:
        msgs.append({"role": "assistant", "content": planner_turn(q, [(a, b)], w.duration)})
        msgs.append(tool_response_message([(call_label(w, a, b), w.report(q, a, b))]))
    msgs.append({"role": "assistant", "content": answer_turn(w, q, plans)})
    return msgs


def overview_seconds(duration: int, n: int) -> list[int]:
    return [int(t) for t in overview_times(float(duration), n=n)]


def nearest_second(secs: list[int], t: int) -> int:
    return min(secs, key=lambda s: (abs(s - t), s))


def nearest_frame_answer(w: World, q: Question, n: int) -> str:
    """The shortcut: read the overview frame nearest to the asked moment (grounding: from the first
    overview frame showing the colour to one second after the last; the whole video when none does)."""
    secs = overview_seconds(w.duration, n)
    if q.task == "tvg":
        seen = [s for s in secs if w.colour_at(s) == q.colour]
        return f"[{seen[0]}, {seen[-1] + 1}]" if seen else f"[0, {w.duration}]"
    colour = w.colour_at(nearest_second(secs, q.t))
    if q.task == "oe":
        return colour
    names = [o.split(". ", 1)[1] for o in q.options]
    return LETTERS[names.index(colour)] if colour in names else "A"


def direct_trace(w: World, q: Question, video: str, n: int, tools_schema: list[dict] | None = None) -> list[dict]:
    """Answer from the overview, reading the nearest frame (what can be seen): mode none, or — with
    ``tools_schema`` — a planner that has the tool and skips it. The think ("frame 36: red.") differs from
    the tool traces' ("red 37."): the colour comes from an image here, from the tool response there."""
    secs = overview_seconds(w.duration, n)
    if q.task == "tvg":
        seen = [s for s in secs if w.colour_at(s) == q.colour]
        think = f"frames at: {' '.join(map(str, seen))}." if seen else "frames at: none."
        guess = span_text(seen[0], seen[-1] + 1) if seen else span_text(0, w.duration)
    else:
        near = nearest_second(secs, q.t)
        think = f"frame {near}: {w.colour_at(near)}."
        guess = " " + w.colour_at(near)  # answered with the colour's name, as in the tool traces
    system = tool_system_prompt(tools_schema) if tools_schema is not None else NO_TOOL_SYSTEM_PROMPT
    return [
        {"role": "system", "content": system},
        question_message(video, n, q),
        {"role": "assistant", "content": f"<think>\n{think}</think>\n<answer>{guess}</answer>"},
    ]
