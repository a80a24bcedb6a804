"""A benchmark loader: ``questions.jsonl`` (video, question, options, answer) with the videos beside it."""

import json
from pathlib import Path

from paravt_train.benchmarks.base import EvalItem, labelled, need


def load_jsonl(root: Path) -> list[EvalItem]:
    path = need(Path(root) / "questions.jsonl", "questions file")
    items = []
    for i, line in enumerate(path.read_text().splitlines()):
        r = json.loads(line)
        opts = r.get("options")
        items.append(EvalItem(benchmark="jsonl", uid=str(i), video=str(Path(root) / r["video"]),
                              question=r["question"], task="mcq" if opts else "oe", answer=r["answer"],
                              options=labelled(opts) if opts else None))
    return items
