"""MLVU (dev).

Layout: ``json/*.json`` (video, question, candidates, answer text, question_type), videos
``video/<task folder>/<video>``.
"""

from __future__ import annotations

import json
from pathlib import Path

from paravt_agent.protocol import LETTERS
from paravt_train.benchmarks.base import EvalItem, labelled, need

__all__ = ["load_mlvu"]


def load_mlvu(root: Path) -> list[EvalItem]:
    files = sorted(need(root / "json", "MLVU annotations folder").glob("*.json"))
    items = []
    for f in files:
        task_dir = f.stem
        for i, r in enumerate(json.loads(f.read_text())):
            cands = r["candidates"]
            items.append(EvalItem("mlvu", f"{task_dir}-{i}", str(root / "video" / task_dir / r["video"]), r["question"],
                                  "mcq", LETTERS[cands.index(r["answer"])], labelled(cands), r.get("question_type", task_dir)))
    return items
