"""Three families of video agents in one runtime, on the same held-out toy questions.

    python examples/toy_modes.py [--model checkpoints/toy-modes] [--worlds 16] [--n 8] [--seed 900000]

Rows (one toy policy on the local backend, overview n frames):

* **ParaVT, parallel**: the planner dispatches K ``crop_video`` calls in one turn;
* **Weaver**: the ``weaver`` preset on the toy's frames (``paravt_train.toy.methods.toy_method_config``): one call
  per turn, Weaver's six model-backed tools offered, tool outputs as frames in the planner's context (``trim``'s
  frame, ``temporal_grounding``'s grounded clip); the policy itself answers the tools' model calls;
* **sequential, crop_video only**: the paper's sequential baseline (separates the tool set from the dispatch);
* **VideoChat-M1**: the collaborative mode's cpp protocol, two agents (the same policy): plans, one tool step, a
  decision after it, each agent's answer, the consensus with a reason summary.

Columns: MCQ accuracy, open-ended token F1, grounding mIoU, tool calls, model calls and seconds per question (16
questions at a time on one batched local model, after a warm-up), the wall time of all questions, and ``errors``
(the share of questions the runtime failed after a rerun, left out of the scores).

The shipped policy (``checkpoints/toy``) knows ParaVT's protocol only; ``checkpoints/toy-modes`` (its
``COMMAND.txt``: a warm start with ``ToyConfig.methods``) also learned Weaver's and VideoChat-M1's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from paravt_agent.agent import Agent
from paravt_agent.policy.local import LocalPolicy
from paravt_train.toy.build import TEST_SEED0, toy_agent_config
from paravt_train.toy.methods import toy_method_config
from paravt_train.toy.quickstart import EVAL_QUESTIONS, REPO_CHECKPOINT, score_answers
from paravt_train.toy.world import make_worlds

MODES_CHECKPOINT = REPO_CHECKPOINT.parent / "toy-modes"
#: row id -> (the table's name, the toy method's agent config, overrides)
ROWS = {
    "parallel": ("ParaVT, parallel (crop_video)", "paravt", {"mode": "parallel"}),
    "weaver": ("Weaver (weaver preset: tool loop, frames in context)", "weaver", {}),
    "sequential": ("sequential, crop_video only", "paravt", {"mode": "sequential"}),
    "collab": ("VideoChat-M1 (collaborative cpp, 2 agents)", "collab", {}),
}


def evaluate(policy, worlds, n: int, rows: dict, log=print) -> dict:
    items = [(w, q) for w in worlds for q in w.questions]
    out = {}
    warm = Agent(policy=policy, config=toy_agent_config())  # the first row does not pay for loading and warm-up
    warm.answer_many([{"video": w.video, "question": q.question, "options": q.options, "n_frames": n}
                      for w, q in items[:16]], concurrency=16, progress=False)
    for name, method, settings in rows.values():
        cfg = toy_method_config(method).override([f"{k}={json.dumps(v)}" for k, v in settings.items()])
        agent = Agent(policy=policy, config=cfg)
        t0 = time.perf_counter()
        answers = agent.answer_many([{"video": w.video, "question": q.question, "options": q.options, "n_frames": n}
                                     for w, q in items], concurrency=16, progress=False, reruns=1)
        row = score_answers(items, answers)  # over the answers the runtime did not spoil; their share: errors
        row.update(model_calls=sum(len(a.records) for a in answers) / len(answers),
                   latency=sum(a.trace.latency for a in answers) / len(answers),
                   wall=time.perf_counter() - t0)
        out[name] = row
        log(f"  {name}: mcq {row.get('mcq', 0):.2f} oe {row.get('oe', 0):.2f} tvg {row.get('tvg', 0):.2f} "
            f"calls {row['calls']:.1f} model calls {row['model_calls']:.1f} latency {row['latency']:.1f}s "
            f"errors {row['errors']:.0%} (wall {row['wall']:.0f}s)")
    return out


def table(results: dict, n: int, questions: int) -> str:
    lines = [f"| mode (n = {n}, {questions} questions) | MCQ acc | OE F1 | grounding mIoU | tool calls / q | "
             "model calls / q | latency / q (s) | wall, all questions (s) | errors |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r.get('mcq', 0):.2f} | {r.get('oe', 0):.2f} | {r.get('tvg', 0):.2f} | "
                     f"{r['calls']:.1f} | {r['model_calls']:.1f} | {r['latency']:.1f} | {r['wall']:.0f} | "
                     f"{r['errors']:.0%} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(MODES_CHECKPOINT if MODES_CHECKPOINT.is_dir() else REPO_CHECKPOINT),
                    help="Toy policy directory (default: checkpoints/toy-modes, which learned every mode).")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"Which rows, comma-separated ({', '.join(ROWS)}).")
    ap.add_argument("--worlds", type=int, default=16, help="Held-out toy videos (5 questions each).")
    ap.add_argument("--n", type=int, default=8, help="Overview frames.")
    ap.add_argument("--out", default="runs/toy_modes", help="Where the videos and results.json go.")
    ap.add_argument("--seed", type=int, default=TEST_SEED0, help="First seed of the held-out worlds (any range "
                    "from 900000 up is unseen by training).")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    out = Path(args.out)
    worlds = make_worlds(range(args.seed, args.seed + args.worlds), out / "videos", False, **EVAL_QUESTIONS)
    policy = LocalPolicy(args.model, max_batch=16)
    rows = {k: v for k, v in ROWS.items() if k in args.rows.split(",")}
    results = evaluate(policy, worlds, args.n, rows)
    md = table(results, args.n, sum(len(w.questions) for w in worlds))
    print("\n" + md)
    minutes = (time.perf_counter() - t0) / 60
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"n": args.n, "worlds": args.worlds, "results": results,
                                                  "minutes": minutes}, indent=1))
    print(f"\n{minutes:.1f} min; results in {out / 'results.json'}")


if __name__ == "__main__":
    main()
