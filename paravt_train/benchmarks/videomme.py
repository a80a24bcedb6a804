"""VideoMME (with and without subtitles).

Published layout (Hugging Face ``lmms-lab/Video-MME``): ``videomme/test-*.parquet`` (video_id, duration,
domain, sub_category, url, videoID, question_id, task_type, question, options ["A. ...", ...], answer),
videos ``data/<videoID>.mp4`` (from ``videos_chunked_*.zip``), subtitles ``subtitle/<videoID>.srt`` (from
``subtitle.zip``). With subtitles, the whole subtitle text goes before the question (long videos have
long subtitles: nothing is cut, so the question never loses the part a question is about).
"""

from __future__ import annotations

from pathlib import Path

from paravt_train.benchmarks.base import BenchmarkError, EvalItem, labelled
from tools.builtin import read_subtitles

__all__ = ["load_videomme"]


def load_videomme(root: Path, subtitles: bool = False) -> list[EvalItem]:
    import pyarrow.parquet as pq

    files = sorted((root / "videomme").glob("*.parquet")) or sorted(root.glob("*.parquet"))
    if not files:
        raise BenchmarkError(f"VideoMME annotations not found: expected {root / 'videomme' / 'test-*.parquet'}")
    items = []
    name = "videomme_sub" if subtitles else "videomme"
    for f in files:
        for r in pq.read_table(f).to_pylist():
            vid = r.get("videoID") or r["video_id"]
            q = r["question"]
            if subtitles:
                srt = root / "subtitle" / f"{vid}.srt"
                if srt.is_file():
                    text = " ".join(t for _, _, t in read_subtitles(srt))
                    q = f"Subtitles: {text}\n{q}"
            items.append(EvalItem(benchmark=name, uid=str(r["question_id"]),
                                  video=str(root / "data" / f"{vid}.mp4"), question=q, task="mcq",
                                  answer=r["answer"], options=labelled(list(r["options"])),
                                  group=str(r.get("duration", ""))))
    return items
