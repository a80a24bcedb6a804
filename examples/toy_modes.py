"""Three families of video agents in one runtime, on the same held-out toy questions.

    python examples/toy_modes.py [--model checkpoints/toy] [--worlds 16] [--n 8] [--out runs/toy_modes]

Rows (all with the shipped toy policy on the local backend, overview n frames):

* **ParaVT, parallel**: the planner dispatches K ``crop_video`` calls in one turn (what the policy was trained for);
* **Weaver-style, sequential**: one call per turn, with Weaver's model-backed tools offered beside ``crop_video``
  (``temporal_grounding``, ``frame_selection``, ``trim``; the policy itself answers their model calls);
* **sequential, crop_video only**: the paper's sequential baseline (separates the tool set from the dispatch);
* **VideoChat-M1-style, collaborative**: two agents (the same policy) plan, call ``crop_video`` and share a memory
  for two rounds; a synthesizer answers from the memory.

Columns: MCQ accuracy, open-ended token F1, grounding mIoU, tool calls, model calls and seconds per question (16
questions at a time on one batched local model, after a warm-up), and the wall time of all questions.
The toy policy was trained only on ParaVT's protocol; the other rows show what each mode does with a policy
that never saw its prompts (training them is the GRPO path, `paravt-train grpo` with the mode's agent config).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from paravt_agent.agent import Agent
from paravt_agent.policy.local import LocalPolicy
from paravt_train.toy.build import TEST_SEED0, toy_agent_config
from paravt_train.toy.quickstart import EVAL_QUESTIONS, REPO_CHECKPOINT, score_answers
from paravt_train.toy.world import make_worlds

WEAVER_TOOLS = ["crop_video", "temporal_grounding", "frame_selection", "trim"]
ROWS = {
    "ParaVT, parallel (crop_video)": {"mode": "parallel"},
    "Weaver-style, sequential (+ model-backed tools)": {"mode": "sequential", "tools": WEAVER_TOOLS},
    "sequential, crop_video only": {"mode": "sequential"},
    "VideoChat-M1-style, collaborative (2 agents x 2 rounds)": {
        "mode": "collaborative", "collab": {"agents": [{"name": "scout"}, {"name": "checker"}], "turns": 2,
                                            "agent_sampling": {"max_new_tokens": 256}}},
}


def evaluate(policy, worlds, n: int, rows: dict, log=print) -> dict:
    items = [(w, q) for w in worlds for q in w.questions]
    out = {}
    warm = Agent(policy=policy, config=toy_agent_config())  # the first row does not pay for loading and warm-up
    warm.answer_many([{"video": w.video, "question": q.question, "options": q.options, "n_frames": n}
                      for w, q in items[:16]], concurrency=16, progress=False)
    for name, settings in rows.items():
        cfg = toy_agent_config().override(
            [f"{k}={json.dumps(v)}" for k, v in settings.items()])
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
    ap.add_argument("--model", default=str(REPO_CHECKPOINT), help="Toy policy directory (default: the shipped one).")
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
    results = evaluate(policy, worlds, args.n, ROWS)
    md = table(results, args.n, sum(len(w.questions) for w in worlds))
    print("\n" + md)
    minutes = (time.perf_counter() - t0) / 60
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"n": args.n, "worlds": args.worlds, "results": results,
                                                  "minutes": minutes}, indent=1))
    print(f"\n{minutes:.1f} min; results in {out / 'results.json'}")


if __name__ == "__main__":
    main()
