"""LVBench.

Published layout (Hugging Face ``THUDM/LVBench``; GitHub ``THUDM/LVBench``): ``video_info.meta.jsonl``, one
video per line ``{"key" (the YouTube id), "type" (the video's genre), "qa": [{"uid", "question" (the stem,
then one "\\n(A) ..." line per option; option text may itself hold parentheses), "answer" (a letter),
"question_type" (a list of the official categories: entity recognition, event understanding, key
information retrieval, temporal grounding, reasoning, summarization), "time_reference"}], "video_info"}``.

Videos: the repository's ``scripts/download.sh`` runs ``video2dataset``, which names files by download
index (``videos/00000/000000000.mp4``) and writes a ``.json`` beside each holding its ``url``; those are
matched to the key through the URL. ``videos/<key>.mp4`` works too. Per-group results follow the official
categories (``scripts/test_acc.py``): a question counts in each of its categories.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from paravt_train.benchmarks.base import BenchmarkError, EvalItem, need

__all__ = ["load_lvbench"]

_OPTION = re.compile(r"\n\s*\(([A-Z])\)\s*")


def _youtube_id(url: str) -> str | None:
    parts = urlsplit(url.strip())
    if parts.hostname and parts.hostname.endswith("youtu.be"):
        return parts.path.strip("/") or None
    return (parse_qs(parts.query).get("v") or [None])[0]


def _downloaded(videos: Path) -> dict[str, Path]:
    """YouTube id → file, from video2dataset's sidecar ``.json`` files (their ``url``)."""
    found: dict[str, Path] = {}
    if not videos.is_dir():
        return found
    for meta in videos.rglob("*.json"):
        try:
            data = json.loads(meta.read_text())
        except (OSError, ValueError):
            continue
        key = _youtube_id(str(data.get("url") or "")) if isinstance(data, dict) else None
        mp4 = meta.with_suffix(".mp4")
        if key and mp4.is_file():
            found[key] = mp4
    return found


def split_question(text: str) -> tuple[str, list[tuple[str, str]]]:
    """The stem and ``[(letter, option text), ...]`` of an LVBench question."""
    pieces = _OPTION.split("\n" + text.strip() if text.lstrip().startswith("(A)") else text)
    stem, rest = pieces[0].strip(), pieces[1:]
    return stem, [(rest[i], rest[i + 1].strip()) for i in range(0, len(rest) - 1, 2)]


def load_lvbench(root: Path) -> list[EvalItem]:
    path = need(root / "video_info.meta.jsonl", "LVBench annotations")
    by_key = _downloaded(root / "videos")
    items = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        v = json.loads(line)
        video = by_key.get(v["key"]) or root / "videos" / f"{v['key']}.mp4"
        for qa in v["qa"]:
            stem, opts = split_question(qa["question"])
            letters = [k for k, _ in opts]
            answer = str(qa["answer"]).strip().strip("()")
            if len(opts) < 2 or answer not in letters:
                raise BenchmarkError(f"LVBench line {n}, uid {qa.get('uid')}: cannot read the options or the answer "
                                     f"{qa['answer']!r} of {qa['question'][:80]!r}")
            cats = qa.get("question_type") or []
            cats = [cats] if isinstance(cats, str) else list(cats)
            items.append(EvalItem(benchmark="lvbench", uid=str(qa["uid"]), video=str(video), question=stem, task="mcq",
                                  answer=answer, options=[f"{k}. {t}" for k, t in opts], group=cats[0] if cats else "",
                                  extra={"groups": cats, "video_type": v.get("type", ""),
                                         "time_reference": qa.get("time_reference", "")}))
    return items
