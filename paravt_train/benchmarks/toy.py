"""The toy benchmark written by ``paravt-train toy``.

Layout: ``rl_test.parquet`` (``paravt-train toy`` writes ``OUT/data/rl_test.parquet``) with the videos in
``../videos`` (or in ``videos/`` beside the file); any RL Parquet file of toy questions works.
"""

from __future__ import annotations

from pathlib import Path

from paravt_train.benchmarks.base import EvalItem, need
from paravt_train.data import load_rl, resolve_video

__all__ = ["load_toy"]


def load_toy(root: Path) -> list[EvalItem]:
    path = root / "rl_test.parquet" if root.is_dir() else root
    need(path, "toy benchmark (run `paravt-train toy`)")
    # `paravt-train toy` writes OUT/data/rl_test.parquet and OUT/videos; a file beside its videos works too
    vroot = next((c for c in (path.parent / "videos", path.parent.parent / "videos") if c.is_dir()),
                 path.parent.parent / "videos")
    items = []
    for s in load_rl(path, vroot):
        items.append(EvalItem(benchmark="toy", uid=s.id or "", video=str(resolve_video(s.videos[0], vroot)),
                              question=s.question_text(), task=s.task, answer=s.answer, options=s.options,
                              group=s.task))
    return items
