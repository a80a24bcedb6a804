"""LongVideoBench.

Layout: ``lvb_val.json`` (video_path, question, candidates, correct_choice, duration_group), videos
``videos/<video_path>``.
"""

from __future__ import annotations

import json
from pathlib import Path

from paravt_agent.protocol import LETTERS
from paravt_train.benchmarks.base import EvalItem, labelled, need

__all__ = ["load_longvideobench"]


def load_longvideobench(root: Path) -> list[EvalItem]:
    data = json.loads(need(root / "lvb_val.json", "LongVideoBench annotations").read_text())
    return [EvalItem("longvideobench", str(r.get("id", i)), str(root / "videos" / r["video_path"]), r["question"], "mcq",
                     LETTERS[int(r["correct_choice"])], labelled(r["candidates"]), str(r.get("duration_group", "")))
            for i, r in enumerate(data)]
