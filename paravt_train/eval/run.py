"""Evaluation: run an agent over benchmark items, score each answer, sum up in a Markdown table.

Items come from the loaders in :mod:`paravt_train.benchmarks` (the paper's six
benchmarks in their published layouts, and the toy benchmark). Items run through
:class:`paravt_agent.Agent` (any backend) with the paper's protocol by default
(64-frame overview at 1 fps, 50176 pixels, <= 16 frames per crop, greedy) or the
protocol a model directory's ``agent_config.yaml`` names; results are appended to
a JSONL file as they finish (resume skips answered items and asks failed ones again: the last line of an
item counts), ``--shard i/k`` splits the
work across machines. Answers are scored by the reward's own accuracy term
(:func:`paravt_train.rewards.accuracy_reward`): RL's held-out evaluation and
``paravt-train eval`` share one scorer.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

from paravt_agent.agent import Agent
from paravt_agent.errors import ParaVTError
from paravt_agent.protocol import parse_span
from paravt_train.benchmarks import BENCHMARKS, BenchmarkError, EvalItem, load_benchmark
from paravt_train.rewards import TASK_METRIC, accuracy_reward

__all__ = ["BENCHMARKS", "BenchmarkError", "EvalItem", "evaluate_items", "load_benchmark", "results_table",
           "run_eval", "score_item"]


def score_item(item: EvalItem, response: str) -> dict[str, float]:
    """``{metric: value}`` of one response: ``correct`` (MCQ letter), ``iou`` (grounding) or ``f1`` (open-ended)."""
    answer = item.answer
    if item.task == "tvg" and isinstance(answer, str):
        answer = list(parse_span(answer) or (0.0, 0.0))
    return {TASK_METRIC[item.task]: accuracy_reward(response, answer, item.task, item.options)}


async def evaluate_items(agent, items: list[EvalItem], concurrency: int = 4, progress: bool = True,
                         on_record=None, reruns: int = 1) -> list[dict]:
    """Answer and score every item; one record per item (its fields, the response, tool calls, latency,
    errors, ``status``, ``failed`` and its metric). ``on_record(record)`` is awaited as each finishes.

    An item the runtime spoiled (a tool call or the run failed: a timeout, an endpoint error) is asked again up
    to ``reruns`` times; if it still fails it is recorded with ``failed: true`` and counted apart (the error rate
    of :func:`results_table`), never scored as the model's answer. An empty or degenerate answer is the model's
    and is scored."""
    from tqdm.auto import tqdm


    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(items), desc="eval", disable=not progress, leave=False)
    grounding = agent.config.layout.grounding_question

    async def attempt(it: EvalItem, question: str) -> dict:
        try:
            ans = await agent.aanswer(it.video, question, it.options)
            return {"response": ans.trace.response, "answer_text": ans.text, "tool_calls": ans.trace.tool_calls,
                    "latency": ans.trace.latency, "errors": ans.trace.errors, "status": ans.trace.status,
                    "failed": not ans.trace.scorable}
        except ParaVTError as exc:
            return {"response": "", "answer_text": "", "tool_calls": 0, "latency": 0.0, "errors": [str(exc)],
                    "status": "failed", "failed": True}

    async def one(it: EvalItem) -> dict:
        async with sem:
            question = it.question
            if grounding and it.task == "tvg" and it.extra.get("query"):  # the protocol's own wording
                question = grounding.format(query=it.extra["query"])
            rec = await attempt(it, question)
            tries = 1
            while rec["failed"] and tries <= reruns:
                rec, tries = await attempt(it, question), tries + 1
            rec = {**asdict(it), **rec, "tries": tries, **score_item(it, rec["response"])}
            if on_record is not None:
                await on_record(rec)
            bar.update(1)
            return rec

    try:
        return list(await asyncio.gather(*(one(it) for it in items)))
    finally:
        bar.close()


def run_eval(agent, items: list[EvalItem], out: str | Path, concurrency: int = 4, shard: tuple[int, int] = (0, 1),
             progress: bool = True, reruns: int = 1) -> list[dict]:
    """Answer every item of this shard not yet answered in ``out`` (JSONL; an item recorded as ``failed`` by the
    runtime is asked again, its new record appended and taken); returns all records of the shard. ``reruns``:
    how many times an item the runtime spoiled is asked again within this run (:func:`evaluate_items`)."""
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
    todo = [it for it in mine if (it.benchmark, it.uid) not in done or done[(it.benchmark, it.uid)].get("failed")]
    lock = asyncio.Lock()

    async def write(rec: dict) -> None:
        async with lock:
            with out.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            done[(rec["benchmark"], rec["uid"])] = rec

    agent.run(evaluate_items(agent, todo, concurrency, progress, on_record=write, reruns=reruns))
    return [done[(it.benchmark, it.uid)] for it in mine]


def results_table(records: list[dict]) -> str:
    """Markdown table: per benchmark and per group (duration / task) — MCQ accuracy, mIoU and R@0.3/0.5/0.7,
    open-ended F1 (each over the items that did not fail), tool calls per question, and the error rate: the
    share of items the runtime spoiled even after their reruns (``failed``), left out of the scores."""
    rows = defaultdict(list)
    for r in records:
        rows[(r["benchmark"], "all")].append(r)
        # a question may belong to several groups (LVBench's categories): it counts in each, as officially
        for g in (r.get("extra") or {}).get("groups") or ([r["group"]] if r.get("group") else []):
            rows[(r["benchmark"], g)].append(r)
    lines = ["| benchmark | group | n | MCQ acc | mIoU | R@0.3 | R@0.5 | R@0.7 | OE F1 | tool calls | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def mean(vals):
        return f"{100 * sum(vals) / len(vals):.1f}" if vals else "-"

    for (bench, group), rs in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1] != "all", kv[0][1])):
        ok = [r for r in rs if not r.get("failed")]
        acc = [r["correct"] for r in ok if "correct" in r]
        ious = [r["iou"] for r in ok if "iou" in r]
        f1 = [r["f1"] for r in ok if "f1" in r]
        recall = [mean([float(i >= t) for i in ious]) for t in (0.3, 0.5, 0.7)]
        calls = sum(r["tool_calls"] for r in ok) / len(ok) if ok else 0.0
        errors = f"{100 * (len(rs) - len(ok)) / len(rs):.1f}%"
        lines.append(f"| {bench} | {group} | {len(rs)} | {mean(acc)} | {mean(ious)} | {' | '.join(recall)} | "
                     f"{mean(f1)} | {calls:.2f} | {errors} |")
    return "\n".join(lines)


def heldout_scores(policy, config, prompts, concurrency: int = 4, progress: bool = False) -> dict:
    """RL's held-out evaluation of RL prompts (``PromptItem``): this module's scorer through an agent of
    ``policy`` and ``config`` (greedy, the trained budgets): the mean metric per task, overall, tool calls per
    question (over the items that did not fail), how many the runtime failed (``eval/failed``, after a rerun),
    and every score (``None`` for a failed item)."""

    agent = Agent(policy=policy, config=config)
    items = [EvalItem(benchmark="heldout", uid=p.id, video=p.video, question=p.question, task=p.task,
                      answer=json.dumps(p.answer) if isinstance(p.answer, list) else str(p.answer),
                      options=p.options, group=p.task)
             for p in prompts]
    every = agent.run(evaluate_items(agent, items, concurrency=concurrency, progress=progress))
    records = [r for r in every if not r.get("failed")]  # the runtime's failures are not the policy's scores
    by: dict[str, list[float]] = {}
    for r in records:
        by.setdefault(r["task"], []).append(r[TASK_METRIC[r["task"]]])

    def mean(xs) -> float:
        xs = list(xs)
        return sum(xs) / len(xs) if xs else 0.0

    out = {f"eval/{t}": sum(v) / len(v) for t, v in sorted(by.items())}
    out["eval/accuracy"] = mean(x for v in by.values() for x in v)
    out["eval/tool_calls"] = mean(float(r["tool_calls"]) for r in records)
    out["eval/n"] = len(records)
    out["eval/failed"] = len(every) - len(records)
    # in item order, None where the runtime failed the item (paired comparisons leave those pairs out)
    out["eval/scores"] = [None if r.get("failed") else r[TASK_METRIC[r["task"]]] for r in every]
    return out
