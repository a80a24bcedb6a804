"""Charades-STA (test).

Published layout: the annotations ``charades_sta_test.txt`` (from the Charades-STA release, GitHub
``jiyanggao/TALL``), one moment per line ``"VID start end##sentence"``; the videos from Charades'
``Charades_v1_480.zip``, which unpacks to ``Charades_v1_480/<VID>.mp4``. A ``videos/`` folder is accepted too.
"""

from __future__ import annotations

from pathlib import Path

from paravt_train.benchmarks.base import EvalItem, need

__all__ = ["VIDEO_FOLDERS", "load_charades"]

#: Where the videos are looked for, in order: the official archive's folder first.
VIDEO_FOLDERS = ("Charades_v1_480", "videos")


def load_charades(root: Path) -> list[EvalItem]:
    path = need(root / "charades_sta_test.txt", "Charades-STA test annotations")
    folder = next((root / f for f in VIDEO_FOLDERS if (root / f).is_dir()), root / VIDEO_FOLDERS[0])
    items = []
    for i, line in enumerate(path.read_text().splitlines()):
        if "##" not in line:
            continue
        head, sentence = line.split("##", 1)
        vid, start, end = head.split()
        q = f"When does this happen: \"{sentence.strip().rstrip('.')}\"? Answer [start, end] in seconds."
        items.append(EvalItem(benchmark="charades", uid=f"{vid}-{i}", video=str(folder / f"{vid}.mp4"),
                              question=q, task="tvg", answer=f"[{float(start)}, {float(end)}]",
                              extra={"query": sentence.strip()}))
    return items
