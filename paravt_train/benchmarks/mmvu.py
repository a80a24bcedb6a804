"""MMVU (validation).

Layout: ``validation.json`` (id, video, question, choices {A: ...}, answer, question_type), videos
``videos/<file name of video>``.
"""

from __future__ import annotations

import json
from pathlib import Path

from paravt_train.benchmarks.base import EvalItem, need

__all__ = ["load_mmvu"]


def load_mmvu(root: Path) -> list[EvalItem]:
    data = json.loads(need(root / "validation.json", "MMVU annotations").read_text())
    items = []
    for r in data:
        video = str(root / "videos" / Path(str(r["video"])).name)
        if r.get("question_type") == "open-ended" or not r.get("choices"):
            items.append(EvalItem("mmvu", str(r["id"]), video, r["question"], "oe", str(r["answer"]), None, "open-ended"))
            continue
        choices = r["choices"]
        keys = sorted(choices)
        answer = r["answer"] if r["answer"] in keys else keys[[choices[k] for k in keys].index(r["answer"])]
        items.append(EvalItem("mmvu", str(r["id"]), video, r["question"], "mcq", answer,
                              [f"{k}. {choices[k]}" for k in keys], "multiple-choice"))
    return items
