"""Online learning from feedback, end to end on the toy: a served agent gets better from its users' feedback.

    .venv/bin/python examples/online_loop.py            # 7.1 min on 2 cores (measured)
    .venv/bin/python examples/online_loop.py --questions 40 --updates 6 --pace 1    # a quick look

1. A server that speaks SGLang's HTTP API (``tests/sglang_server.py``: the real tiny model on CPU) serves
   the tool-shy toy policy (``paravt_train.toy.toolshy``, the same start as ``examples/toy_rl.py``): a
   policy that usually skips the tool on sparse overviews, so it gets colour-at-t questions wrong often.
2. The served agent (``Agent(backend="sglang", store=...)``) answers the held-out questions: before.
3. A scripted user asks ``--questions`` colour-at-t questions (MCQ, 8-frame overviews) through the served
   agent, one every ``--pace`` seconds, and gives feedback on each (the right option), into the trajectory
   store; how often the server answered the user right is printed per third of the questions.
4. Meanwhile ``paravt-train online`` (its own process) learns from the store: each update rolls out fresh
   groups through the same server, takes a PARA-GRPO step and pushes the weights to the server
   (``/pause_generation`` retract → ``/update_weights_from_disk`` → ``/continue_generation``), while the
   server keeps answering the user.
5. The same server answers the held-out questions again: after. Prints accuracy before → after with 95%
   intervals and the paired gain, and writes OUT/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paravt_agent.agent import Agent  # noqa: E402
from paravt_agent.config import AgentConfig  # noqa: E402
from paravt_agent.store import TrajectoryStore  # noqa: E402
from paravt_train.benchmarks import EvalItem  # noqa: E402
from paravt_train.eval import evaluate_items  # noqa: E402
from paravt_train.eval.stats import mean_ci, paired_diff_ci  # noqa: E402
from paravt_train.toy.build import TEST_SEED0  # noqa: E402
from paravt_train.toy.quickstart import REPO_CHECKPOINT  # noqa: E402
from paravt_train.toy.toolshy import build_toolshy  # noqa: E402
from paravt_train.toy.world import make_worlds  # noqa: E402
from tests.conftest import SGLangStub  # noqa: E402

USER_SEED0 = 800_000  # the user's videos: worlds no training saw
HELD_SEED0 = TEST_SEED0 + 7000


def heldout(agent: Agent, worlds) -> list[float]:
    items = [EvalItem(benchmark="toy", uid=q.qid, video=w.video, question=q.question, task="mcq",
                      answer=q.answer, options=q.options) for w in worlds
             for q in w.questions]
    recs = agent.run(evaluate_items(agent, items, concurrency=8, progress=False))
    return [None if r["failed"] else r["correct"] for r in recs]  # None: the runtime failed it (not scored)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO_CHECKPOINT), help="The toy SFT policy (default: checkpoints/toy).")
    ap.add_argument("--out", default="runs/online_loop")
    ap.add_argument("--start", default="runs/toy_rl/start", help="The tool-shy start (built here when missing; "
                                                                 "examples/toy_rl.py builds the same one).")
    ap.add_argument("--questions", type=int, default=120, help="Questions the scripted user asks.")
    ap.add_argument("--updates", type=int, default=20, help="Updates the online learner makes.")
    ap.add_argument("--pace", type=float, default=3.0, help="Seconds the user waits between questions (so the "
                                                            "asking spans the training).")
    ap.add_argument("--eval-worlds", type=int, default=40, help="Held-out worlds (2 MCQ each).")
    ap.add_argument("--lr", type=float, default=1e-4)
    args = ap.parse_args()

    out = Path(args.out)
    t0 = time.time()
    start = build_toolshy(args.model, args.start)
    held = make_worlds(range(HELD_SEED0, HELD_SEED0 + args.eval_worlds), out / "videos", mcq=2, oe=0, tvg=0)
    user_worlds = make_worlds(range(USER_SEED0, USER_SEED0 + (args.questions + 1) // 2), out / "videos", mcq=2,
                              oe=0, tvg=0)
    store_path = out / "traces.db"
    store_path.unlink(missing_ok=True)
    store = TrajectoryStore(store_path)
    stub = SGLangStub(str(start), threads=1)
    print(f"server up at {stub.url} serving {start} ({(time.time() - t0) / 60:.1f} min)")
    try:
        config = AgentConfig.for_model(start).model_copy(update={"frames": AgentConfig.for_model(start).frames.model_copy(
            update={"n_frames": 8})})
        served = Agent(backend="sglang", endpoint=stub.url, model=str(start), config=config, store=store)
        before = heldout(served, held)
        print(f"held-out before: {mean_ci(before)[0]:.3f} ({len(before)} questions, "
              f"{before.count(None)} failed in the runtime)")
        cfg = {"model": str(start), "output_dir": str(out / "learner"), "backend": "sglang", "endpoint": stub.url,
               "prompts_per_step": 4, "group_size": 8, "temperature": 0.7, "lr": args.lr, "gating_choices": [4, 8],
               "max_new_tokens": 256, "subagent_max_new_tokens": 32, "micro_batch_size": 1, "save_every": 1,
               "resume": False, "sync_pause_mode": "retract"}
        (out / "learner.yaml").write_text(yaml.safe_dump(cfg))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        learner = subprocess.Popen([sys.executable, "-m", "paravt_train.cli", "online", "--store", str(store_path),
                                    "--config", str(out / "learner.yaml"), "--poll", "2",
                                    "--max-steps", str(args.updates)], env=env)
        asked = []

        def user() -> None:  # asks, reads the answer, says what was right
            for w in user_worlds:
                for q in w.questions:
                    if len(asked) >= args.questions:
                        return
                    ans = served.answer(w.video, q.question, q.options)
                    served.feedback(ans.trace.id, answer=q.answer)
                    asked.append(ans.choice == q.answer)
                    time.sleep(args.pace)

        th = threading.Thread(target=user)
        th.start()
        th.join()
        third = max(1, len(asked) // 3)
        thirds = [asked[:third], asked[third:-third], asked[-third:]]
        print(f"the user asked {len(asked)} questions while the learner trained: {sum(asked)} answered right; "
              f"first / middle / last third: " + " / ".join(f"{sum(t) / max(1, len(t)):.2f}" for t in thirds)
              + f" ({(time.time() - t0) / 60:.1f} min)")
        code = learner.wait()
        if code != 0:
            raise SystemExit(f"the online learner exited with {code}")
        after = heldout(served, held)
    finally:
        stub.close()
    b, a, g = mean_ci(before), mean_ci(after), paired_diff_ci(before, after)
    result = {"heldout_before": b, "heldout_after": a, "gain": g, "questions_asked": len(asked),
              "heldout_failed": [before.count(None), after.count(None)],
              "asked_right": sum(asked), "asked_right_by_third": [sum(t) / max(1, len(t)) for t in thirds],
              "updates": args.updates, "minutes": (time.time() - t0) / 60}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    print(f"\nheld-out accuracy (n = 8, {len(before)} questions, greedy, the same server): "
          f"{b[0]:.2f} [{b[1]:.2f}, {b[2]:.2f}] → {a[0]:.2f} [{a[1]:.2f}, {a[2]:.2f}]; gain {g[0]:+.2f} "
          f"[{g[1]:+.2f}, {g[2]:+.2f}]; {result['minutes']:.1f} min")


if __name__ == "__main__":
    main()
