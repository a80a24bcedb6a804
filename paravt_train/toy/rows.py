"""The toy world's datasets: SFT rows (parallel, sequential and direct traces, sub-agent samples, copy rows)
and RL rows, from the worlds of :mod:`paravt_train.toy.world`."""

from __future__ import annotations

import random
from pathlib import Path

from paravt_agent.prompts import SUBAGENT_SYSTEM_PROMPT, subagent_request
from paravt_agent.protocol import extract_answer, parse_tool_calls, split_think
from paravt_train.toy.world import (
    COLOURS,
    SCAN_WINDOW,
    Question,
    World,
    direct_trace,
    grounding_question,
    parallel_trace,
    question_message,
    sequential_trace,
    windows_for,
)

__all__ = ["check_trace_roundtrip", "copy_rows", "copy_sample", "corpus", "listing_copy_sample", "random_listing",
           "rl_rows", "sft_rows", "subagent_sample"]


def subagent_sample(w: World, q: Question, video: str, window: tuple[int, int]) -> list[dict]:
    """One sub-agent turn: the window's frames and the question, and the report."""
    a, b = window
    return [
        {"role": "system", "content": SUBAGENT_SYSTEM_PROMPT},
        {"role": "user", "content": [{"type": "video", "video": video, "start": a, "end": b},
                                     {"type": "text", "text": subagent_request(q.question)}]},
        {"role": "assistant", "content": w.summary(q, a, b)},
    ]


def extra_subagent_samples(w: World, video: str, rng: random.Random, count: int = 4) -> list[list[dict]]:
    """Sub-agent samples on ``count`` random windows of 2 to 16 frames at random offsets: half asking the
    colour at a second of the window, half a grounding question for a colour the window shows as one run
    (a finding) or does not show ("Nothing."), in turn. Colours with two runs in the window are not asked:
    a grounding target appears once in the video."""
    out = []
    for i in range(count):
        length = rng.randint(1, SCAN_WINDOW - 1)
        a = rng.randint(0, w.duration - 1 - length)
        if i % 2 == 0:
            t = rng.randint(a, a + length)
            q = Question("extra", "oe", f"What colour is shown at second {t}?", w.colour_at(t), t=t,
                         colour=w.colour_at(t))
        else:
            runs = {c: w.runs_in(c, a, a + length) for c in COLOURS}
            shown = [c for c, n in runs.items() if n == 1]
            absent = [c for c, n in runs.items() if n == 0]
            want_shown = (i // 2) % 2 == 0
            colour = rng.choice(shown if shown and (want_shown or not absent) else absent)
            q = Question("extra", "tvg", grounding_question(colour), "", colour=colour)
        out.append(subagent_sample(w, q, video, (a, a + length)))
    return out


def subagent_windows(w: World, q: Question, rng: random.Random, plans: str = "copy") -> list[tuple[int, int]]:
    """The windows a question's sub-agent samples come from: the colour-at-t plan's windows; for grounding
    the window(s) that see the colour, four times (the findings are the rarer reply), plus two others."""
    wins = windows_for(w, q, plans)
    if q.task != "tvg":
        return wins
    hits = [x for x in wins if any(w.colour_at(s) == q.colour for s in w.seconds(*x))]
    misses = [x for x in wins if x not in hits]
    return hits * 4 + rng.sample(misses, min(2, len(misses)))


def sft_rows(worlds: list[World], tools_schema: list[dict], seed: int = 0, nframes=(4, 8, 16, 32, 64),
             video_root: str | Path | None = None, p_sequential: float = 0.2, p_direct: float = 0.4,
             direct_nframes=(16, 32, 64, 64), answer_only=(("mcq", 0.5), ("oe", 0.5), ("tvg", 1.0)),
             extra_subagents: int = 4, plans: str = "copy") -> list[dict]:
    """SFT rows. Per question: a parallel trace; with the task's probability in ``answer_only`` the same
    again with only the answer turn trained; with probability ``p_sequential`` a sequential trace; with
    probability ``p_direct`` a direct-answer (no tool) trace at an n from ``direct_nframes``; sub-agent
    samples of its windows. Per world: extra sub-agent samples on random windows. ``plans`` (world.PLANS):
    which windows the traces' plans crop."""
    p_answer = dict(answer_only)
    rng = random.Random(seed)
    rows = []
    for w in worlds:
        video = Path(w.video).name if video_root else w.video
        for q in w.questions:
            rows.append({"id": f"{q.qid}-par", "messages": parallel_trace(w, q, video, rng.choice(nframes),
                                                                          tools_schema, plans)})
            if rng.random() < p_answer.get(q.task, 0.0):  # the answer step again, the planner turn as context
                answer = parallel_trace(w, q, video, rng.choice(nframes), tools_schema, plans)
                answer[2] = {**answer[2], "train": False}
                rows.append({"id": f"{q.qid}-ans", "messages": answer})
            if rng.random() < p_sequential:
                rows.append({"id": f"{q.qid}-seq", "messages": sequential_trace(w, q, video, rng.choice(nframes),
                                                                                   tools_schema, plans)})
            if rng.random() < p_direct:
                rows.append({"id": f"{q.qid}-dir", "messages": direct_trace(w, q, video,
                                                                            rng.choice(direct_nframes))})
            seen = []
            for a, b in subagent_windows(w, q, rng, plans):
                sid = f"{q.qid}-sub{a}" + "r" * seen.count((a, b))  # a hit window's later samples
                seen.append((a, b))
                rows.append({"id": sid, "messages": subagent_sample(w, q, video, (a, b))})
        for i, msgs in enumerate(extra_subagent_samples(w, video, rng, extra_subagents)):
            rows.append({"id": f"{w.wid}-xsub{i}", "messages": msgs})
    rng.shuffle(rows)
    return rows


def copy_sample(rng: random.Random, vocabulary: list[str], length: tuple[int, int] = (20, 80)) -> list[dict]:
    """A text-only row that keeps the copy skill (see ``tiny.copy_warmup``) while the traces are learned:
    the user gives a random sequence of ``vocabulary`` pieces (``tiny.copy_vocabulary``: the tokenizer's
    ordinary tokens), the assistant repeats it. No video, no tool: it teaches nothing about the world,
    only to continue a sequence seen earlier in the context. The pieces must be arbitrary tokens, not the
    toy's words: repeats of toy words are mostly predictable from the words before them, and a model
    learns no copying from them (README, the toy world)."""
    seq = "".join(rng.choice(vocabulary) for _ in range(rng.randint(*length))).strip()
    return [{"role": "user", "content": f"Repeat: {seq}"},
            {"role": "assistant", "content": f"<think>\n{seq}</think>\n<answer>{seq.split()[-1]}</answer>"}]


def random_listing(rng: random.Random, entries: tuple[int, int] = (4, 16)) -> str:
    """Random entries in the grounding listings' shape, colour first ("cyan 75; red 12; white 3"): the pieces
    the grounding copies are made of. Its 8 colours, 10 digits and separators repeat, so copying it takes a
    match of several tokens back, which random-token copies never teach (README, the toy world)."""
    names = list(COLOURS)
    return "; ".join(f"{rng.choice(names)} {rng.randrange(128)}" for _ in range(rng.randint(*entries)))


def listing_copy_sample(rng: random.Random, entries: tuple[int, int] = (4, 16)) -> list[dict]:
    """A text-only copy row of a random listing (``random_listing``), shaped like ``copy_sample``."""
    seq = random_listing(rng, entries) + "."
    return [{"role": "user", "content": f"Repeat: {seq}"},
            {"role": "assistant", "content": f"<think>\n{seq}</think>\n<answer>{seq.split()[-1]}</answer>"}]


def copy_rows(count: int, vocabulary: list[str], seed: int = 0, length: tuple[int, int] = (20, 80),
              kind: str = "tokens") -> list[dict]:
    """``count`` copy rows, seeded: random tokens (``copy_sample``, ``length`` pieces each) or random
    listings (``listing_copy_sample``)."""
    if kind not in ("tokens", "listings"):
        raise ValueError(f"copy row kind must be tokens or listings, got {kind!r}")
    rng = random.Random(f"copy/{seed}")
    if kind == "listings":
        return [{"id": f"copy{i}", "messages": listing_copy_sample(rng)} for i in range(count)]
    return [{"id": f"copy{i}", "messages": copy_sample(rng, vocabulary, length)} for i in range(count)]


def rl_rows(worlds: list[World], video_root: str | Path | None = None) -> list[dict]:
    rows = []
    for w in worlds:
        video = Path(w.video).name if video_root else w.video
        for q in w.questions:
            prompt = [{"role": "system", "content": "toy"}, question_message(video, 64, q)]
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

    for r in rows:
        for m in r["messages"]:
            if m["role"] == "assistant" and "<tool_call>" in m["content"]:
                assert all(c.ok for c in parse_tool_calls(m["content"])), r["id"]
            if m["role"] == "assistant" and "<answer>" in m["content"]:
                assert extract_answer(m["content"]) and split_think(m["content"])[0], r["id"]
