"""MLVU (dev).

Published layout (Hugging Face ``MLVU/MVLU``, folder ``MLVU/``): ``json/<n>_<task>.json``, one file per
task, rows ``{"video", "duration", "question", "candidates", "answer" (the option text), "question_type"}``;
videos in ``video/<n>_<task>/<video>``.

Seven tasks are multiple choice. Two are generation tasks without ``candidates``:
``8_sub_scene.json`` (``question_type`` ``subPlot``, with ``scoring_points``) and ``9_summary.json``
(``summary``). MLVU scores those with a GPT judge, which this harness does not run: ``mlvu`` (the
paper's M-Avg) skips them; ``mlvu_generation`` loads them as open-ended questions scored by token F1
against the reference answer, a proxy that is not comparable with MLVU's leaderboard.
"""

from __future__ import annotations

import json
from pathlib import Path

from paravt_agent.protocol import LETTERS
from paravt_train.benchmarks.base import BenchmarkError, EvalItem, labelled, need

__all__ = ["load_mlvu", "load_mlvu_generation"]


def _rows(root: Path):
    files = sorted(need(root / "json", "MLVU annotations folder").glob("*.json"))
    if not files:
        raise BenchmarkError(f"MLVU annotations not found: expected {root / 'json' / '1_plotQA.json'} and the rest")
    for f in files:
        for i, r in enumerate(json.loads(f.read_text())):
            yield f.stem, i, r


def load_mlvu(root: Path) -> list[EvalItem]:
    """The multiple-choice tasks (rows with ``candidates``)."""
    items = []
    for task_dir, i, r in _rows(root):
        cands = r.get("candidates")
        if not cands:
            continue  # a generation task: mlvu_generation
        if r["answer"] not in cands:
            raise BenchmarkError(f"MLVU {task_dir} row {i}: the answer {r['answer']!r} is not one of its candidates")
        items.append(EvalItem(benchmark="mlvu", uid=f"{task_dir}-{i}",
                              video=str(root / "video" / task_dir / r["video"]), question=r["question"],
                              task="mcq", answer=LETTERS[cands.index(r["answer"])], options=labelled(cands),
                              group=r.get("question_type", task_dir)))
    return items


def load_mlvu_generation(root: Path) -> list[EvalItem]:
    """The generation tasks (sub-scene captioning, summary) as open-ended questions (token F1, a proxy)."""
    items = []
    for task_dir, i, r in _rows(root):
        if r.get("candidates"):
            continue
        items.append(EvalItem(benchmark="mlvu_generation", uid=f"{task_dir}-{i}",
                              video=str(root / "video" / task_dir / r["video"]), question=r["question"],
                              task="oe", answer=str(r["answer"]), options=None,
                              group=r.get("question_type", task_dir),
                              extra={"scoring_points": r.get("scoring_points") or []}))
    return items
