"""LVBench.

Layout: ``video_info.meta.jsonl`` (key, qa[uid, question with "(A) ..." options, answer]), videos
``videos/<key>.mp4``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from paravt_train.benchmarks.base import EvalItem, need

__all__ = ["load_lvbench"]


def load_lvbench(root: Path) -> list[EvalItem]:
    path = need(root / "video_info.meta.jsonl", "LVBench annotations")
    items = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        v = json.loads(line)
        for qa in v["qa"]:
            text = qa["question"]
            opts = re.findall(r"\(([A-D])\)\s*([^\n(]+)", text)
            stem = re.split(r"\n?\([A-D]\)", text)[0].strip()
            items.append(EvalItem("lvbench", str(qa["uid"]), str(root / "videos" / f"{v['key']}.mp4"), stem, "mcq",
                                  qa["answer"].strip("()"), [f"{k}. {t.strip()}" for k, t in opts],
                                  v.get("type", "")))
    return items
