"""Online learning from feedback on the toy: which way the served agent goes follows the users' labels, and a gate
keeps poisoned updates away.

    .venv/bin/python examples/online_loop.py                       # the four runs below (time: docs/toy.md)
    .venv/bin/python examples/online_loop.py --updates 6 --runs honest,wrong     # a quick look
    .venv/bin/python examples/online_loop.py --sglang     # the same four runs served by SGLang itself (CPU engine)

The start is the shipped toy policy made *systematically wrong* by a short SFT: on colour-at-t multiple-choice
questions it crops the video as usual, reads the right colour, and then answers the option after it most of
the time (``--bias``, 70 %). Format, tool use and every other reward term are the same whichever option it
names, so only the users' labels can say which option is right.

Each run starts a fresh trajectory store and learner from that start. Scripted users ask colour-at-t questions
about videos no training saw, the served agent answers, and they give feedback (``Agent.feedback``, each with a
``user``); ``OnlineLearner`` (``paravt-train online``'s loop, in this process; rollouts in-process, or on SGLang
with ``--sglang``) trains on the feedback, one candidate per ``--promote-every`` updates:

* ``honest``: every label is the right option;
* ``wrong``: every label is a wrong option (the control: if the feedback's content did not matter, this would
  gain as much);
* ``adversarial``: two users in three are honest, one gives a wrong option as every label; no gate;
* ``adversarial+gate``: the same stream with the gate on (a pinned evaluation set of other held-out worlds,
  margin ``--margin``): a candidate worse than the served version is kept aside and the learner reverts.

With ``--sglang`` the users' agent and the learner's rollouts go to SGLang 0.5.23's own server (its CPU engine,
``make sglang-cpu``; started once with ``paravt serve``'s launcher, pinned to core 0, the learner on core 1),
backend ``sglang`` as ``paravt-train online`` runs it in production: the server holds the served version (each run
puts its starting weights back on it first), a promotion pushes a version from disk, the learner trains ahead of
it and corrects for the gap with decoupled PPO's behaviour weights. The held-out and gate evaluations stay
in-process (the trainer's transformers model; ``perf/bench_parity.py`` measures how closely SGLang matches it).

After each run the held-out accuracy (greedy, n = 8, worlds of ``--seed`` on, disjoint from the users' and the
gate's) of the version that served after every ``--promote-every`` updates is measured; the table prints
accuracy through the run, the final gain with its paired 95% interval, and the candidates refused.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paravt_agent.agent import Agent  # noqa: E402
from paravt_agent.protocol import LETTERS, option_body  # noqa: E402
from paravt_agent.store import TrajectoryStore  # noqa: E402
from paravt_train.data import write_parquet  # noqa: E402
from paravt_train.eval.stats import mean_ci, paired_diff_ci  # noqa: E402
from paravt_train.online.gate import evaluate_dir  # noqa: E402
from paravt_train.online.learner import OnlineLearner  # noqa: E402
from paravt_train.online.versions import push_version  # noqa: E402
from paravt_train.rl.config import GRPOConfig  # noqa: E402
from paravt_train.sft import train  # noqa: E402
from paravt_train.sft.config import SFTConfig  # noqa: E402
from paravt_train.toy.build import TEST_SEED0, toy_agent_config  # noqa: E402
from paravt_train.toy.quickstart import REPO_CHECKPOINT  # noqa: E402
from paravt_train.toy.rows import rl_rows  # noqa: E402
from paravt_train.toy.world import make_worlds, parallel_trace  # noqa: E402
from tools import ToolRegistry  # noqa: E402

BIASED_SEED0 = 710_000  # the biased start's SFT worlds
USER_SEED0 = 810_000  # the users' videos
GATE_SEED0 = TEST_SEED0 + 8000  # the gate's pinned evaluation set
RUNS = ("honest", "wrong", "adversarial", "adversarial+gate")


def biased_start(model: str, out: Path, bias: float, steps: int = 120, worlds: int = 60) -> Path:
    """The toy policy answering the option after the right one in ``bias`` of its SFT traces (cached)."""
    if (out / "config.json").is_file():
        return out
    work = out.with_name(out.name + ".build")
    rng = random.Random(0)
    ws = make_worlds(range(BIASED_SEED0, BIASED_SEED0 + worlds), work / "videos", False, mcq=3, oe=0, tvg=0)
    schema = ToolRegistry.default(entry_points_too=False).subset(["crop_video"]).schemas()
    rows = []
    for w in ws:
        for q in w.questions:
            msgs = parallel_trace(w, q, w.video, rng.choice((4, 8, 16)), schema)
            if rng.random() < bias:  # the next option's colour instead of the right one
                right = LETTERS.index(q.answer)
                wrong = option_body(q.options[(right + 1) % len(q.options)]).strip()
                text = msgs[-1]["content"]
                msgs[-1] = {**msgs[-1], "content": text[: text.rindex("<answer>")] + f"<answer> {wrong}</answer>"}
            rows.append({"id": q.qid, "messages": msgs})
    data = write_parquet(rows, work / "sft.parquet")
    cfg = SFTConfig(model=model, data=str(data), output_dir=str(work / "sft"), frames=toy_agent_config().frames,
                    lr=5e-4, batch_size=8, micro_batch_size=1, max_steps=steps, warmup_ratio=0.1, save_every=0,
                    seed=0, resume=False)
    train(cfg, progress=False)
    shutil.copytree(work / "sft" / "final", out, dirs_exist_ok=True)
    return out


def prompts_parquet(worlds, path: Path) -> Path:
    return write_parquet(rl_rows(worlds, path.parent), path)


def run(name: str, start: Path, users, out: Path, args, gate_set: Path, vids: Path, endpoint: str | None) -> dict:
    """One online run (rollouts in-process, or on the SGLang server at ``endpoint``); returns the serving version
    after each promotion round and the refusals."""
    d = out / name
    shutil.rmtree(d, ignore_errors=True)
    store = TrajectoryStore(d / "traces.db")
    backend = {"backend": "sglang", "endpoint": endpoint} if endpoint else {}
    served = Agent(model=str(start), config=toy_agent_config().model_copy(
        update={"frames": toy_agent_config().frames.model_copy(update={"n_frames": 8})}), store=store, **backend)
    if endpoint:  # the server holds the start before the users ask (an earlier run left its last version on it)
        push_version(GRPOConfig(model=str(start), backend="sglang", endpoint=endpoint),
                     {"id": "start", "path": str(start), "weight_version": "start"}, lambda *_: None)
    rng = random.Random(name)
    k = 0
    for w in users:
        for q in w.questions:
            ans = served.answer(w.video, q.question, q.options)
            user = f"user{k % 3}"
            honest = name == "honest" or (name.startswith("adversarial") and k % 3 != 2)
            label = q.answer if honest else rng.choice([x for x in LETTERS[: len(q.options)] if x != q.answer])
            served.feedback(ans.trace.id, answer=label, user=user)
            k += 1
    online = {"promote_every": args.promote_every, "max_user_share": 0.5, "rollback": {"enabled": False}}
    if name.endswith("+gate"):
        online["gate"] = {"enabled": True, "eval_set": str(gate_set), "video_root": str(vids), "n_frames": 8,
                          "margin": args.margin}
    cfg = GRPOConfig(model=str(start), output_dir=str(d / "learner"), video_root=str(vids), prompts_per_step=4,
                     group_size=8, temperature=0.7, lr=args.lr, max_new_tokens=256, subagent_max_new_tokens=32,
                     micro_batch_size=1, save_every=100, concurrency=4, gating_choices=[4, 8], resume=False,
                     seed=args.rl_seed, online=online, **backend)
    learner = OnlineLearner(cfg, store.path, progress=False, log=lambda *_: None)
    t0 = time.time()
    learner.run(max_steps=args.updates, once=True)
    served_path = [v["path"] for v in learner.registry.promoted()]  # in the order they served
    return {"versions": learner.registry.versions(), "served": served_path, "minutes": (time.time() - t0) / 60}


def summarise(name: str, r: dict, before: list, heldout) -> dict:
    curve = [mean_ci(heldout(p))[0] for p in r["served"]]
    after = heldout(r["served"][-1])
    refused = [v["id"] for v in r["versions"] if v["status"] == "refused"]
    print(f"{name}: held-out through the run {' → '.join(f'{x:.2f}' for x in curve)}; refused {refused}; "
          f"{r['minutes']:.1f} min", flush=True)
    return {"curve": curve, "gain": paired_diff_ci(before, after), "after": mean_ci(after), "refused": refused,
            "minutes": r["minutes"]}


def serve(start: Path, out: Path, python: str):
    """SGLang's own server with the start, pinned to one core (this process to another): (process, URL)."""
    from paravt_agent.serving.sglang_launch import launch, sglang_command
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    two = len(cores) > 1 and shutil.which("taskset")
    if two:
        os.sched_setaffinity(0, {cores[1]})
        torch.set_num_threads(1)
    else:
        print("note: fewer than 2 cores or no taskset: the server and the learner share the machine unpinned")
    argv, env = sglang_command(str(start), "127.0.0.1", port, device="cpu", python=python, max_total_tokens=32768,
                               extra=["--skip-server-warmup", "--log-level", "warning"], vlm_cache_mb=0)
    env = {**env, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    with (out / "server.log").open("w") as f:
        proc = launch([*(["taskset", "-c", str(cores[0])] if two else []), *argv], env, "127.0.0.1", port,
                      timeout=300, log=f)
    return proc, f"http://127.0.0.1:{port}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO_CHECKPOINT), help="The toy policy (default: checkpoints/toy).")
    ap.add_argument("--out", default="runs/online_loop")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"Which of {', '.join(RUNS)}.")
    ap.add_argument("--bias", type=float, default=0.7, help="Share of the start's SFT answers shifted one option.")
    ap.add_argument("--updates", type=int, default=12, help="Updates per run (4 prompts each).")
    ap.add_argument("--promote-every", type=int, default=3, help="Updates per candidate.")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--margin", type=float, default=0.05, help="The gate's non-inferiority margin.")
    ap.add_argument("--seed", type=int, default=TEST_SEED0 + 7000, help="First seed of the held-out worlds.")
    ap.add_argument("--rl-seed", type=int, default=0, help="The learner's seed (gating, rollout sampling; SGLang's "
                    "CPU engine ignores sampling seeds).")
    ap.add_argument("--eval-worlds", type=int, default=20, help="Held-out worlds (2 MCQ each).")
    ap.add_argument("--sglang", action="store_true", help="Serve and roll out with SGLang itself (its CPU engine).")
    ap.add_argument("--sglang-python", default=str(ROOT / ".venv-sglang" / "bin" / "python"),
                    help="The Python that has SGLang (default: the suite's .venv-sglang, `make sglang-cpu`).")
    args = ap.parse_args()
    if args.sglang and not Path(args.sglang_python).exists():
        raise SystemExit(f"{args.sglang_python} does not exist: `make sglang-cpu` installs SGLang's CPU engine")
    out = Path(args.out)
    t_all = time.time()
    vids = out / "videos"
    start = biased_start(args.model, out / "start", args.bias)
    held = make_worlds(range(args.seed, args.seed + args.eval_worlds), vids, False, mcq=2, oe=0, tvg=0)
    gate_w = make_worlds(range(GATE_SEED0, GATE_SEED0 + 10), vids, False, mcq=2, oe=0, tvg=0)
    users = make_worlds(range(USER_SEED0, USER_SEED0 + args.updates * 2), vids, False, mcq=2, oe=0, tvg=0)
    held_set, gate_set = prompts_parquet(held, vids / "held.parquet"), prompts_parquet(gate_w, vids / "gate.parquet")
    from paravt_train.data import prompts_from_rl

    held_prompts = prompts_from_rl(held_set, vids)
    cfg8 = toy_agent_config().model_copy(
        update={"frames": toy_agent_config().frames.model_copy(update={"n_frames": 8})})
    cache: dict[str, list] = {}

    def heldout(path) -> list:
        if str(path) not in cache:
            cache[str(path)] = evaluate_dir(path, cfg8, held_prompts)
        return cache[str(path)]

    before = heldout(start)
    print(f"start ({args.bias:.0%} biased): held-out {mean_ci(before)[0]:.2f} on {len(before)} questions")
    server, endpoint = (serve(start, out, args.sglang_python) if args.sglang else (None, None))
    results = {}
    try:
        for name in args.runs.split(","):
            results[name] = summarise(name, run(name, start, users, out, args, gate_set, vids, endpoint), before,
                                      heldout)
    finally:
        if server is not None:
            from paravt_agent.serving.sglang_launch import stop

            stop(server)
    print("\n| run | held-out accuracy, each served version | after (95% CI) | gain (paired 95% CI) | "
          "candidates refused | minutes |\n|---|---|---|---|---|---|")
    for name, r in results.items():
        a, g = r["after"], r["gain"]
        print(f"| {name} | {' → '.join(f'{x:.2f}' for x in r['curve'])} | {a[0]:.2f} [{a[1]:.2f}, {a[2]:.2f}] | "
              f"{g[0]:+.2f} [{g[1]:+.2f}, {g[2]:+.2f}] | {len(r['refused'])} | {r['minutes']:.1f} |")
    print(f"\n{len(before)} held-out questions (seeds {args.seed}-{args.seed + args.eval_worlds - 1}); "
          f"{args.updates} updates of 4 prompts, a candidate every {args.promote_every}; "
          f"{'served by SGLang 0.5.23 (CPU engine, core 0), learner on core 1' if args.sglang else 'in-process'}; "
          f"{(time.time() - t_all) / 60:.1f} min in all")
    (out / "results.json").write_text(json.dumps({"before": before, **results}, indent=1, default=str))


if __name__ == "__main__":
    main()
