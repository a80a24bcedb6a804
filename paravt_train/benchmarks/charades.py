"""Charades-STA (test).

Layout: ``charades_sta_test.txt`` ("VID start end##sentence"), videos ``videos/<VID>.mp4``.
"""

from __future__ import annotations

from pathlib import Path

from paravt_train.benchmarks.base import EvalItem, need

__all__ = ["load_charades"]


def load_charades(root: Path) -> list[EvalItem]:
    path = need(root / "charades_sta_test.txt", "Charades-STA test annotations")
    items = []
    for i, line in enumerate(path.read_text().splitlines()):
        if "##" not in line:
            continue
        head, sentence = line.split("##", 1)
        vid, start, end = head.split()
        q = f"When does this happen: \"{sentence.strip().rstrip('.')}\"? Answer [start, end] in seconds."
        items.append(EvalItem("charades", f"{vid}-{i}", str(root / "videos" / f"{vid}.mp4"), q, "tvg",
                              f"[{float(start)}, {float(end)}]", extra={"query": sentence.strip()}))
    return items
