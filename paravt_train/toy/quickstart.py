"""The quick start: the real agent (LangGraph graph, local backend) on held-out toy videos.

Prints one full trace, the accuracy of each role in isolation (planner,
sub-agent, answer step) at n = 8, then a table per dispatch mode (parallel /
sequential / none) and overview size n: MCQ accuracy, open-ended accuracy
(token F1), grounding mIoU and tool calls per question, next to the
nearest-overview-frame shortcut. Results also go to ``OUT/results.json``.

The default is the quick look (4 held-out videos: the first answer within a minute, the whole run a few minutes on
a busy 2-core machine); ``full=True`` (``--full``) is the docs' table (16 videos). An estimate of the whole run is
printed up front, and each table row's progress bar says which row it is ("row 3 of 9: parallel, n = 64").
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from paravt_agent.agent import Agent
from paravt_agent.defaults import paravt_home
from paravt_agent.policy.local import LocalPolicy
from paravt_train.toy.build import TEST_SEED0, toy_agent_config
from paravt_train.toy.roles import role_accuracy, score
from paravt_train.toy.world import make_worlds, nearest_frame_answer

__all__ = ["evaluate", "run", "shortcut", "table"]

REPO_CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoints" / "toy"
#: Questions per held-out video: colour-at-t MCQ / open-ended, grounding.
EVAL_QUESTIONS = {"mcq": 3, "oe": 1, "tvg": 1}
#: held-out videos (and videos of the per-role check) of the quick look and of the full table (``--full``)
QUICK, FULL = {"worlds": 4, "roles": 4}, {"worlds": 16, "roles": 8}
#: seconds of one answer in the table's rows (16 at a time, the toy policy batched), measured on an idle 2-core AMD
#: EPYC (the full table: 720 answers and the per-role check in 2.2 min); the estimate scales it by the machine's load
SECONDS_PER_ANSWER = 0.16


def evaluate(policy, worlds, modes, ns, concurrency: int = 16, progress: bool = True, log=print,
             reruns: int = 1):
    """``{(mode, n): {"mcq": acc, "oe": f1, "tvg": miou, "calls": mean, "errors": rate, "seconds": s}}`` and the
    answers. An answer the runtime spoiled (a sub-agent timed out, a model call failed: not
    ``trace.scorable``) is asked again up to ``reruns`` times; if it still fails it counts in ``errors`` (the
    share of questions) and not in the scores."""
    items = [(w, q) for w in worlds for q in w.questions]
    results, answers_by = {}, {}
    rows = len(modes) * len(ns)
    started = time.perf_counter()
    for k, mode in enumerate(modes):
        agent = Agent(policy=policy, config=toy_agent_config(mode=mode))
        for j, n in enumerate(ns):
            t0 = time.perf_counter()
            answers = agent.answer_many(
                [{"video": w.video, "question": q.question, "options": q.options, "n_frames": n} for w, q in items],
                concurrency=concurrency, progress=progress, reruns=reruns,
                desc=f"row {k * len(ns) + j + 1} of {rows}: {mode}, n = {n}",
            )
            row = score_answers(items, answers)
            row["seconds"] = time.perf_counter() - t0
            results[(mode, n)] = row
            answers_by[(mode, n)] = answers
            done = k * len(ns) + j + 1
            left = (time.perf_counter() - started) / done * (rows - done)
            log(f"  {mode:10s} n={n:<3d} mcq {row.get('mcq', 0):.2f}  oe {row.get('oe', 0):.2f}  "
                f"tvg mIoU {row.get('tvg', 0):.2f}  calls {row['calls']:.1f}  errors {row['errors']:.0%}  "
                f"({row['seconds']:.0f}s{f'; about {left / 60:.1f} min left' if done < rows else ''})")
    return results, answers_by


def score_answers(items, answers) -> dict:
    """The mean score per task over the answers the runtime did not spoil, tool calls per such question, and
    ``errors``: the share of questions it did spoil (left out of the scores)."""
    by: dict[str, list[float]] = {}
    ok = [((w, q), a) for (w, q), a in zip(items, answers, strict=True) if a.trace.scorable]
    for (_, q), a in ok:
        by.setdefault(q.task, []).append(score(a.trace.response, q))
    row = {task: sum(v) / len(v) for task, v in by.items()}
    row["calls"] = sum(a.trace.tool_calls for _, a in ok) / len(ok) if ok else 0.0
    row["errors"] = 1 - len(ok) / len(answers) if answers else 0.0
    return row


def shortcut(worlds, ns) -> dict:
    """The nearest-overview-frame shortcut's scores per n."""
    out = {}
    for n in ns:
        by: dict[str, list[float]] = {}
        for w in worlds:
            for q in w.questions:
                by.setdefault(q.task, []).append(score(f"<answer>{nearest_frame_answer(w, q, n)}</answer>", q))
        out[n] = {task: sum(v) / len(v) for task, v in by.items()}
    return out


def table(results: dict, base: dict, ns) -> str:
    lines = ["| mode | n | MCQ acc | OE acc (F1) | grounding mIoU | tool calls / question | errors |",
             "|---|---|---|---|---|---|---|"]
    for (mode, n), r in results.items():
        lines.append(f"| {mode} | {n} | {r.get('mcq', 0):.2f} | {r.get('oe', 0):.2f} | {r.get('tvg', 0):.2f} | "
                     f"{r['calls']:.1f} | {r.get('errors', 0):.0%} |")
    for n in ns:
        b = base[n]
        lines.append(f"| nearest-frame shortcut | {n} | {b.get('mcq', 0):.2f} | {b.get('oe', 0):.2f} | "
                     f"{b.get('tvg', 0):.2f} | 0 | - |")
    return "\n".join(lines)


def role_table(roles: dict) -> str:
    tasks = ("mcq", "oe", "tvg")
    lines = ["| role (n = 8, correct inputs) | MCQ | OE | grounding |", "|---|---|---|---|"]
    for role in dict.fromkeys(r for r, _ in roles):
        cells = [f"{roles[(role, t)]:.2f}" if (role, t) in roles else "" for t in tasks]
        lines.append(f"| {role} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def estimate(answers: int, load: float | None = None, cores: int | None = None, contention: float = 1.0) -> float:
    """Seconds ``answers`` table answers take here: :data:`SECONDS_PER_ANSWER` (an idle 2-core machine's) times how
    much busier this machine is: its 1-minute load per core, or ``contention`` (a measured answer's wall time over
    its CPU time) where that is larger, at least 1."""
    cores = cores or os.cpu_count() or 1
    load = os.getloadavg()[0] if load is None else load
    return answers * SECONDS_PER_ANSWER * max(1.0, load / cores, contention) * max(1.0, 2 / cores)


def run(model_dir: str | Path | None = None, out: str | Path | None = None, worlds: int | None = None,
        modes=("parallel", "sequential", "none"), ns=(4, 8, 64), progress: bool = True, log=print,
        roles: int | None = None, seed: int = TEST_SEED0, full: bool = False) -> dict:
    """One trace, per-role accuracy on the first ``roles`` held-out videos (0 = skip), the mode x n table, on
    the toy worlds of seeds ``seed`` .. ``seed + worlds - 1`` (the default range is the one training never
    uses; any other range is as held-out, since training uses seeds below 900,000). ``worlds`` and ``roles``
    default to the quick look's (:data:`QUICK`), or with ``full`` to the docs' table's (:data:`FULL`)."""

    t_start = time.perf_counter()
    model_dir = Path(model_dir or REPO_CHECKPOINT)
    out = Path(out or paravt_home() / "quickstart")
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"no toy policy at {model_dir}; build one with `paravt-train toy`")
    size = FULL if full else QUICK
    worlds = size["worlds"] if worlds is None else worlds
    roles = min(size["roles"], worlds) if roles is None else roles
    log(f"toy policy: {model_dir}")
    test = make_worlds(range(seed, seed + worlds), out / "videos", progress, **EVAL_QUESTIONS)
    questions = sum(len(w.questions) for w in test)
    rows = len(modes) * len(ns)
    answers = rows * questions + roles * sum(EVAL_QUESTIONS.values()) * 3  # the table, and each role's turns
    log(f"{len(test)} held-out videos (seeds {seed}-{seed + worlds - 1}, {min(w.duration for w in test)}-"
        f"{max(w.duration for w in test)} s), {questions} questions; {rows} table rows of {questions} answers")
    log(f"estimate: about {estimate(answers) / 60:.1f} min for the whole run ({answers} answers at "
        f"{SECONDS_PER_ANSWER:g} s each on an idle 2-core AMD EPYC, scaled by this machine's load; "
        f"{'the full table' if full else 'the quick look: --full for the docs table, 16 videos'})")
    import torch  # the model's own library (the policy loads it anyway): its threads, below

    threads, cores = torch.get_num_threads(), os.cpu_count() or 1
    if os.getloadavg()[0] >= cores:  # other work holds the cores: one torch thread (two fight it 10-20x slower)
        torch.set_num_threads(1)
        log(f"the machine is busy (load {os.getloadavg()[0]:.1f} on {cores} cores): one torch thread")
    try:
        return _answer(model_dir, out, test, modes, ns, progress, log, roles, seed, worlds, answers, t_start)
    finally:
        torch.set_num_threads(threads)


def _answer(model_dir, out, test, modes, ns, progress, log, roles, seed, worlds, answers, t_start) -> dict:
    """The run after its plan: the first answer and its trace, each role alone, the table."""
    log("answering the first question (the model loads first) ...")
    policy = LocalPolicy(model_dir, max_batch=16)
    example_agent = Agent(policy=policy, config=toy_agent_config(mode="parallel"))
    w, q = test[0], test[0].questions[0]
    wall, cpu = time.perf_counter(), time.process_time()
    ans = example_agent.answer(w.video, q.question, q.options, n_frames=8)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    log("\n=== one full trace (parallel, n = 8) ===")
    log(ans.trace.render())
    log(f"(ground truth: {q.answer}, {q.colour})")
    contention = wall / max(cpu, 1e-3)
    log(f"the first answer took {wall:.0f}s of wall time for {cpu:.0f}s of CPU: the rest, about "
        f"{estimate(answers, contention=contention) / 60:.1f} min\n")
    summary: dict = {"model": str(model_dir), "worlds": len(test), "seeds": [seed, seed + worlds - 1]}
    if roles:
        log("=== each role alone (held-out, n = 8; the other roles' outputs are the correct ones) ===")
        r = role_accuracy(example_agent, test[:roles], n=8, concurrency=16, progress=progress)
        log(role_table(r) + "\n")
        summary["roles"] = {f"{k[0]}/{k[1]}": v for k, v in r.items()}
    log("=== held-out evaluation ===")
    results, _ = evaluate(policy, test, modes, ns, progress=progress, log=log)
    base = shortcut(test, ns)
    md = table(results, base, ns)
    log("\n" + md)
    summary.update(results={f"{m}/{n}": v for (m, n), v in results.items()},
                   shortcut={str(n): v for n, v in base.items()}, minutes=(time.perf_counter() - t_start) / 60)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    log(f"\n{summary['minutes']:.1f} min; results in {out / 'results.json'}")
    return {"results": results, "shortcut": base, "table": md, "roles": summary.get("roles")}
