"""Evaluation harness: the paper's six benchmarks (local copies, published layouts) and the toy benchmark.

Every benchmark is loaded into the same :class:`EvalItem` list; items run through
:class:`paravt_agent.Agent` (any backend) with the paper's protocol by default
(64-frame overview at 1 fps, 50176 pixels, <= 16 frames per crop, greedy);
results are appended to a JSONL file as they finish (resume skips done items),
``--shard i/k`` splits the work across machines, and a Markdown table sums up.

Expected layouts (the published ones; ``root`` is the benchmark folder):

===============  ==========================================================================
videomme         ``videomme/test-*.parquet`` (video_id, videoID, duration, question_id, question,
                 options, answer), videos ``data/<videoID>.mp4``, subtitles ``subtitle/<videoID>.srt``
longvideobench   ``lvb_val.json`` (video_path, question, candidates, correct_choice,
                 duration_group), videos ``videos/<video_path>``
lvbench          ``video_info.meta.jsonl`` (key, qa[uid, question with "(A) ..." options, answer]),
                 videos ``videos/<key>.mp4``
mlvu             ``json/*.json`` (video, question, candidates, answer text, question_type),
                 videos ``video/<task folder>/<video>``
mmvu             ``validation.json`` (id, video, question, choices {A: ...}, answer, question_type),
                 videos ``videos/<file name of video>``
charades         ``charades_sta_test.txt`` ("VID start end##sentence"), videos ``videos/<VID>.mp4``
toy              ``rl_test.parquet`` written by ``paravt-train toy`` (videos beside it in ``../videos``)
===============  ==========================================================================
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from paravt_agent.errors import ParaVTError

__all__ = ["BENCHMARKS", "EvalItem", "load_benchmark", "run_eval", "summarize"]

LETTERS = "ABCDEFGHIJ"


class BenchmarkError(ParaVTError):
    """A benchmark folder, file or video is missing or malformed."""


@dataclass
class EvalItem:
    benchmark: str
    uid: str
    video: str
    question: str
    task: str  # mcq | tvg | oe
    answer: str  # letter, "[start, end]" or text
    options: list[str] | None = None
    group: str = ""  # per-duration (or per-task) breakdown key
    extra: dict = field(default_factory=dict)


def _need(path: Path, what: str) -> Path:
    if not path.exists():
        raise BenchmarkError(f"{what} not found: expected {path}")
    return path


def _opts(cands: list[str]) -> list[str]:
    return [c if re.match(r"^\(?[A-J][.)]", c) else f"{LETTERS[i]}. {c}" for i, c in enumerate(cands)]


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
                    from tools.builtin import read_subtitles

                    text = " ".join(t for _, _, t in read_subtitles(srt))
                    q = f"Subtitles: {text[:4000]}\n{q}"
            items.append(EvalItem(name, str(r["question_id"]), str(root / "data" / f"{vid}.mp4"), q, "mcq",
                                  r["answer"], _opts(list(r["options"])), str(r.get("duration", ""))))
    return items


def load_longvideobench(root: Path) -> list[EvalItem]:
    data = json.loads(_need(root / "lvb_val.json", "LongVideoBench annotations").read_text())
    return [EvalItem("longvideobench", str(r.get("id", i)), str(root / "videos" / r["video_path"]), r["question"], "mcq",
                     LETTERS[int(r["correct_choice"])], _opts(r["candidates"]), str(r.get("duration_group", "")))
            for i, r in enumerate(data)]


def load_lvbench(root: Path) -> list[EvalItem]:
    path = _need(root / "video_info.meta.jsonl", "LVBench annotations")
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


def load_mlvu(root: Path) -> list[EvalItem]:
    files = sorted(_need(root / "json", "MLVU annotations folder").glob("*.json"))
    items = []
    for f in files:
        task_dir = f.stem
        for i, r in enumerate(json.loads(f.read_text())):
            cands = r["candidates"]
            items.append(EvalItem("mlvu", f"{task_dir}-{i}", str(root / "video" / task_dir / r["video"]), r["question"],
                                  "mcq", LETTERS[cands.index(r["answer"])], _opts(cands), r.get("question_type", task_dir)))
    return items


def load_mmvu(root: Path) -> list[EvalItem]:
    data = json.loads(_need(root / "validation.json", "MMVU annotations").read_text())
    items = []
    for r in data:
        video = str(root / "videos" / Path(str(r["video"])).name)
        if r.get("question_type") == "open-ended" or not r.get("choices"):
            items.append(EvalItem("mmvu", str(r["id"]), video, r["question"], "oe", str(r["answer"]), None, "open-ended"))
            continue
        choices = r["choices"]
        keys = sorted(choices)
        answer = r["answer"] if r["answer"] in keys else keys[[choices[k] for k in keys].index(r["answer"])]
        items.append(EvalItem("mmvu", str(r["id"]), video, r["question"], "mcq", answer,
                              [f"{k}. {choices[k]}" for k in keys], "multiple-choice"))
    return items


def load_charades(root: Path) -> list[EvalItem]:
    path = _need(root / "charades_sta_test.txt", "Charades-STA test annotations")
    items = []
    for i, line in enumerate(path.read_text().splitlines()):
        if "##" not in line:
            continue
        head, sentence = line.split("##", 1)
        vid, start, end = head.split()
        q = f"When does this happen: \"{sentence.strip().rstrip('.')}\"? Answer [start, end] in seconds."
        items.append(EvalItem("charades", f"{vid}-{i}", str(root / "videos" / f"{vid}.mp4"), q, "tvg",
                              f"[{float(start)}, {float(end)}]"))
    return items


def load_toy(root: Path) -> list[EvalItem]:
    from paravt_train.data import load_rl, resolve_video

    path = root / "rl_test.parquet" if root.is_dir() else root
    _need(path, "toy benchmark (run `paravt-train toy`)")
    vroot = path.parent.parent / "videos"
    items = []
    for s in load_rl(path, vroot):
        items.append(EvalItem("toy", s.id or "", str(resolve_video(s.videos[0], vroot)), s.question_text(),
                              s.question_type, s.answer, s.options, s.question_type))
    return items


BENCHMARKS = {
    "videomme": load_videomme,
    "videomme_sub": lambda root: load_videomme(root, subtitles=True),
    "longvideobench": load_longvideobench,
    "lvbench": load_lvbench,
    "mlvu": load_mlvu,
    "mmvu": load_mmvu,
    "charades": load_charades,
    "toy": load_toy,
}


def load_benchmark(name: str, root: str | Path, check_videos: bool = True) -> list[EvalItem]:
    if name not in BENCHMARKS:
        raise BenchmarkError(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}")
    root = Path(root)
    if not root.exists():
        raise BenchmarkError(f"{name}: benchmark folder not found: expected {root}")
    items = BENCHMARKS[name](root)
    if check_videos:
        missing = [it.video for it in items if not Path(it.video).is_file()]
        if missing:
            raise BenchmarkError(f"{name}: {len(missing)} of {len(items)} videos missing, e.g. expected {missing[0]}")
    return items


# --------------------------------------------------------------------------- running


def _score(item: EvalItem, response: str) -> dict:
    from paravt_agent.protocol import extract_answer, extract_choice, parse_span
    from paravt_train.rewards import temporal_iou, token_f1

    pred = extract_answer(response)
    if item.task == "mcq":
        return {"correct": float(extract_choice(pred, item.options) == item.answer)}
    if item.task == "tvg":
        gt = parse_span(item.answer)
        return {"iou": temporal_iou(parse_span(pred), gt)}
    return {"f1": token_f1(pred, item.answer)}


def run_eval(agent, items: list[EvalItem], out: str | Path, concurrency: int = 4, shard: tuple[int, int] = (0, 1),
             progress: bool = True) -> list[dict]:
    """Answer every item of this shard not yet in ``out`` (JSONL); returns all records of the shard."""
    import asyncio

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {}
    if out.is_file():
        for line in out.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a crash is redone
            done[(rec["benchmark"], rec["uid"])] = rec
    index, count = shard
    mine = [it for k, it in enumerate(items) if k % count == index]
    todo = [it for it in mine if (it.benchmark, it.uid) not in done]

    async def go():
        from tqdm.auto import tqdm

        sem = asyncio.Semaphore(concurrency)
        lock = asyncio.Lock()
        bar = tqdm(total=len(todo), desc="eval", disable=not progress)

        async def one(it: EvalItem):
            async with sem:
                try:
                    ans = await agent.aanswer(it.video, it.question, it.options)
                    rec = {"response": ans.trace.response, "answer_text": ans.text, "tool_calls": ans.trace.tool_calls,
                           "latency": ans.trace.latency, "errors": ans.trace.errors}
                except ParaVTError as exc:
                    rec = {"response": "", "answer_text": "", "tool_calls": 0, "latency": 0.0, "errors": [str(exc)]}
                rec = {**asdict(it), **rec, **_score(it, rec["response"])}
                async with lock:
                    with out.open("a") as f:
                        f.write(json.dumps(rec) + "\n")
                    done[(it.benchmark, it.uid)] = rec
                bar.update(1)

        await asyncio.gather(*(one(it) for it in todo))
        bar.close()

    agent.run(go())
    return [done[(it.benchmark, it.uid)] for it in mine]


def summarize(records: list[dict]) -> str:
    """Markdown table: per benchmark and per group (duration / task) — MCQ accuracy, mIoU and R@0.3/0.5/0.7,
    open-ended F1, tool calls per question."""
    rows = defaultdict(list)
    for r in records:
        rows[(r["benchmark"], "all")].append(r)
        if r.get("group"):
            rows[(r["benchmark"], r["group"])].append(r)
    lines = ["| benchmark | group | n | MCQ acc | mIoU | R@0.3 | R@0.5 | R@0.7 | OE F1 | tool calls |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def mean(vals):
        return f"{100 * sum(vals) / len(vals):.1f}" if vals else "-"

    for (bench, group), rs in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1] != "all", kv[0][1])):
        acc = [r["correct"] for r in rs if "correct" in r]
        ious = [r["iou"] for r in rs if "iou" in r]
        f1 = [r["f1"] for r in rs if "f1" in r]
        recall = [mean([float(i >= t) for i in ious]) for t in (0.3, 0.5, 0.7)]
        calls = sum(r["tool_calls"] for r in rs) / len(rs)
        lines.append(f"| {bench} | {group} | {len(rs)} | {mean(acc)} | {mean(ious)} | {' | '.join(recall)} | "
                     f"{mean(f1)} | {calls:.2f} |")
    return "\n".join(lines)
