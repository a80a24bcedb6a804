"""Synchronous vs asynchronous PARA-GRPO on the toy world: the same updates, with rollouts that wait for the
update (η = 0) or run ahead of it (η = 1, 2), on two CPU cores standing in for the paper's disaggregated GPUs.

    .venv/bin/python examples/toy_async.py                      # η = 0, 1, 2, 16 updates each
    .venv/bin/python examples/toy_async.py --steps 8            # 5.9 min on 2 cores (measured, SGLang on CPU)
    .venv/bin/python examples/toy_async.py --steps 6 --etas 0,1 # a quick look

* The rollout server is SGLang itself (0.5.23's CPU engine, ``make sglang-cpu``: started with ``paravt serve``'s
  launcher, ``--device cpu``) pinned to core 0 (``taskset -c 0``); the trainer (``paravt-train grpo``, backend
  ``sglang``, weights pushed from disk after every update) is pinned to core 1 — the paper's layout (one GPU
  serves, the others train) in miniature. SGLang's CPU engine cannot honour sampling seeds (its deterministic
  inference needs GPU attention kernels): the settings see different samples, which the intervals absorb.
* Start: the tool-shy toy policy of ``examples/toy_rl.py`` (room to learn). Each setting starts a fresh
  server from it, trains ``--steps`` PARA-GRPO updates on the same prompts with the same seeds, and evaluates
  the same held-out questions greedily through the server before and after (n = 8).
* Per setting: wall time of the updates (first to last update, evaluations excluded), updates per hour and
  the ratio to synchronous, held-out accuracy before → after with the paired 95% bootstrap interval, mean
  staleness (versions between a token's sampling policy and its update), the share of capped tokens, and
  the trainer's time waiting for rollouts (what bounds the speed-up). Writes OUT/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paravt_train.data import write_parquet  # noqa: E402
from paravt_train.eval.stats import mean_ci, paired_diff_ci  # noqa: E402
from paravt_train.toy.build import TEST_SEED0  # noqa: E402
from paravt_train.toy.quickstart import REPO_CHECKPOINT  # noqa: E402
from paravt_train.toy.rows import rl_rows  # noqa: E402
from paravt_train.toy.toolshy import build_toolshy  # noqa: E402
from paravt_train.toy.world import make_worlds  # noqa: E402

TRAIN_SEED0 = 500_000
HELD_SEED0 = TEST_SEED0 + 5000


def pinned(core: str) -> list[str]:
    """``taskset`` to the first ("0") or second ("1") of the cores this process may use (none with fewer)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return ["taskset", "-c", str(cores[int(core)])] if shutil.which("taskset") and len(cores) > 1 else []


def start_server(model: str, port: int, log: Path, python: str) -> subprocess.Popen:
    from paravt_agent.serving.sglang_launch import launch, sglang_command

    # no vision-feature cache: every weight, the vision tower's too, is trained and pushed, and SGLang keeps cached
    # features across weight updates (the held-out "after" would reuse the start's features of the same frames)
    argv, env = sglang_command(model, "127.0.0.1", port, device="cpu", python=python, max_total_tokens=32768,
                               extra=["--skip-server-warmup", "--log-level", "warning"], vlm_cache_mb=0)
    env = {**env, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    with log.open("w") as f:
        return launch([*pinned("0"), *argv], env, "127.0.0.1", port, timeout=300, log=f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/toy_async")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--train-worlds", type=int, default=60)
    ap.add_argument("--eval-worlds", type=int, default=30, help="Held-out worlds (2 MCQ questions each).")
    ap.add_argument("--etas", default="0,1,2")
    ap.add_argument("--sglang-python", default=str(ROOT / ".venv-sglang" / "bin" / "python"),
                    help="The Python that has SGLang (default: the suite's .venv-sglang, `make sglang-cpu`).")
    args = ap.parse_args()
    if not Path(args.sglang_python).exists():
        raise SystemExit(f"{args.sglang_python} does not exist: `make sglang-cpu` installs SGLang's CPU engine")
    if (os.cpu_count() or 1) < 2 or not shutil.which("taskset"):
        print("note: fewer than 2 cores or no taskset: the server and the trainer share the machine unpinned")
    out = Path(args.out)
    t_all = time.time()
    start = build_toolshy(str(REPO_CHECKPOINT), out / "start")
    vids = out / "videos"
    train_w = make_worlds(range(TRAIN_SEED0, TRAIN_SEED0 + args.train_worlds), vids, mcq=2, oe=1, tvg=0)
    held_w = make_worlds(range(HELD_SEED0, HELD_SEED0 + args.eval_worlds), vids, mcq=2, oe=0, tvg=0)
    train = write_parquet(rl_rows(train_w, vids), out / "rl_train.parquet")
    held = write_parquet(rl_rows(held_w, vids), out / "rl_heldout.parquet")
    from paravt_agent.serving.sglang_launch import stop

    results = {}
    for eta in (int(x) for x in args.etas.split(",")):
        run = out / f"eta{eta}"
        shutil.rmtree(run, ignore_errors=True)
        run.mkdir(parents=True)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        server = start_server(str(start), port, run / "server.log", args.sglang_python)
        cfg = dict(method="para-grpo", model=str(start), data=str(train), eval={"data": str(held), "n_frames": 8},
                   video_root=str(vids), output_dir=str(run), backend="sglang", endpoint=f"http://127.0.0.1:{port}",
                   steps=args.steps, prompts_per_step=args.prompts_per_step, group_size=args.group, lr=args.lr,
                   temperature=0.7, max_new_tokens=256, subagent_max_new_tokens=32, micro_batch_size=1,
                   save_every=1000, concurrency=args.prompts_per_step, seed=0, max_staleness=eta,
                   gating_choices=[4, 8, 16, 32, 64])
        (run / "config.yaml").write_text(yaml.safe_dump(cfg))
        t0 = time.time()
        try:
            proc = subprocess.run([*pinned("1"), sys.executable, "-m", "paravt_train.cli", "grpo", "--config",
                                   str(run / "config.yaml")], env={**os.environ, "OMP_NUM_THREADS": "1"},
                                  capture_output=True, text=True)
        finally:
            stop(server)
        (run / "trainer.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise SystemExit(f"η = {eta} failed:\n{proc.stderr[-3000:]}")
        recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((run / "summary.json").read_text())
        before, after = summary["eval_before"]["eval/scores"], summary["eval_after"]["eval/scores"]
        r0 = recs[0]  # the first step began when the trainer started rolling out (η = 0) or waiting (η > 0)
        first_start = r0["time"] - r0["update_seconds"] - r0["sync_seconds"] - r0.get(
            "wait_seconds", r0.get("rollout_seconds", 0.0))
        wall = recs[-1]["time"] - first_start
        results[eta] = {
            "wall_s": wall, "updates_per_hour": 3600 * len(recs) / wall, "total_s": time.time() - t0,
            "before": mean_ci(before), "after": mean_ci(after), "gain": paired_diff_ci(before, after),
            "staleness": sum(r.get("staleness", 0.0) for r in recs) / len(recs),
            "capped": sum(r.get("capped_tokens", 0.0) for r in recs) / len(recs),
            "wait_s": sum(r.get("wait_seconds", r.get("rollout_seconds", 0.0)) for r in recs),
            "update_s": sum(r["update_seconds"] + r["sync_seconds"] for r in recs),
            "reward_first_last": (recs[0]["reward"], recs[-1]["reward"]),
        }
        print(f"η = {eta}: {wall / 60:.1f} min for {len(recs)} updates", flush=True)
    base = results.get(0, next(iter(results.values())))
    print(f"\n{args.steps} updates of {args.prompts_per_step} prompts x G = {args.group}; server on core 0, "
          f"trainer on core 1; {time.time() - t_all:.0f} s in all\n")
    print("| η | wall (updates) | updates/hour | vs sync | held-out before → after | gain (paired 95% CI) | "
          "mean staleness | capped tokens | trainer waiting for rollouts |")
    print("|---|---|---|---|---|---|---|---|---|")
    for eta, r in results.items():
        b, a, g = r["before"], r["after"], r["gain"]
        print(f"| {eta} | {r['wall_s'] / 60:.1f} min | {r['updates_per_hour']:.0f} | "
              f"{r['updates_per_hour'] / base['updates_per_hour']:.2f}x | {b[0]:.2f} → {a[0]:.2f} | "
              f"{g[0]:+.2f} [{g[1]:+.2f}, {g[2]:+.2f}] | {r['staleness']:.2f} | {100 * r['capped']:.1f}% | "
              f"{r['wait_s'] / 60:.1f} min (update + sync {r['update_s'] / 60:.1f} min) |")
    (out / "results.json").write_text(json.dumps({str(k): v for k, v in results.items()}, indent=1))


if __name__ == "__main__":
    main()
