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
    return [EvalItem(benchmark="longvideobench", uid=str(r.get("id", i)),
                     video=str(root / "videos" / r["video_path"]), question=r["question"], task="mcq",
                     answer=LETTERS[int(r["correct_choice"])], options=labelled(r["candidates"]),
                     group=str(r.get("duration_group", "")))
            for i, r in enumerate(data)]
