"""MMVU (validation).

Published layout (Hugging Face ``yale-nlp/MMVU``; the same file is ``data/validation.json`` in the
``yale-nlp/MMVU`` GitHub repository): ``validation.json``, rows ``{"id", "video", "youtube_url",
"question_type" ("multiple-choice" | "open-ended"), "metadata" {"subject", ...}, "question", "choices"
{"A": ..., "E": ...} (all empty strings for open-ended rows), "answer" (a letter, or the answer text)}``.
``video`` is the dataset's download URL, ``.../resolve/main/videos/<Subject>/<n>.mp4``; file names repeat
across subjects (every subject has a ``0.mp4``), so the video is ``videos/<Subject>/<n>.mp4`` under the root.
"""

from __future__ import annotations

import json
from pathlib import Path

from paravt_train.benchmarks.base import BenchmarkError, EvalItem, need

__all__ = ["load_mmvu"]


def _video_path(root: Path, video: str) -> Path:
    """``videos/<Subject>/<n>.mp4``: the part of the URL (or path) from its ``videos/`` folder on."""
    parts = video.split("?")[0].replace("\\", "/").split("/")
    if "videos" in parts:
        rel = parts[len(parts) - 1 - parts[::-1].index("videos"):]
        return root.joinpath(*rel)
    raise BenchmarkError(f"MMVU video {video!r}: expected a URL or path ending in videos/<Subject>/<n>.mp4")


def load_mmvu(root: Path) -> list[EvalItem]:
    data = json.loads(need(root / "validation.json", "MMVU annotations").read_text())
    items = []
    for r in data:
        video = str(_video_path(root, str(r["video"])))
        subject = (r.get("metadata") or {}).get("subject", "")
        choices = {k: v for k, v in (r.get("choices") or {}).items() if str(v).strip()}
        if r.get("question_type") == "open-ended" or not choices:
            items.append(EvalItem(benchmark="mmvu", uid=str(r["id"]), video=video, question=r["question"],
                                  task="oe", answer=str(r["answer"]), options=None, group="open-ended",
                                  extra={"subject": subject}))
            continue
        keys = sorted(choices)
        answer = r["answer"] if r["answer"] in keys else keys[[choices[k] for k in keys].index(r["answer"])]
        items.append(EvalItem(benchmark="mmvu", uid=str(r["id"]), video=video, question=r["question"],
                              task="mcq", answer=answer, options=[f"{k}. {choices[k]}" for k in keys],
                              group="multiple-choice", extra={"subject": subject}))
    return items
