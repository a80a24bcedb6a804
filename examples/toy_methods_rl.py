"""RL for the related methods on the toy world: Weaver's GRPO with frozen tools, and VideoChat-M1's multi-agent RL
with and without agent dropout, each from a weak start, before → after on held-out worlds.

    .venv/bin/python examples/toy_methods_rl.py            # the three runs (docs/toy.md has the measured table)
    .venv/bin/python examples/toy_methods_rl.py --steps 4  # a quick look

1. The starts: the toy policy that learned every mode (``checkpoints/toy-modes``) made tool-shy for one method by a
   short SFT (:func:`paravt_train.toy.toolshy.build_toolshy`): Weaver's loop answering from the nearest overview
   frame without a tool call, or VideoChat-M1's agents planning no tool (key info: the nearest frame) and
   answering from it — always on dense overviews (32, 64 frames), three times in four on sparse ones (4, 8, 16).
   Greedy at n = 8 they skip the tool; sampled, some rollouts still use it.
2. RL on colour-at-t questions of 60 worlds no SFT saw, overviews of 8 frames:
   * Weaver: ``paravt-train grpo --set method=weaver``: its tools' model calls frozen (``tool_model_calls:
     freeze``), R = 0.7·R_corr + 0.2·R_format + 0.1·R_tool (R_tool: a tool call that worked and a right answer);
   * VideoChat-M1: ``--set method=videochat-m1`` (τ = 1, KL 1e-5) on the collaborative cpp protocol: each agent's
     turns with its own advantage, R_i = R_res + R_format + R_col + R_tool (the synthesizer's turns by the team's
     reward, the reason summary untrained); without agent dropout (``--set agent.collab.dropout=0``) and with the
     method's 0.25.
3. Held-out: 80 MCQ questions (40 worlds) at n = 8, greedy, with the trainer's scorer, before and after; accuracy
   with bootstrap 95% intervals and the paired difference.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from paravt_train.data import prompts_from_rl, write_parquet
from paravt_train.eval.stats import mean_ci, paired_diff_ci
from paravt_train.rl.config import GRPOConfig
from paravt_train.rl.trainer import GRPOTrainer
from paravt_train.toy.build import TEST_SEED0
from paravt_train.toy.methods import toy_method_config
from paravt_train.toy.quickstart import REPO_CHECKPOINT
from paravt_train.toy.rows import rl_rows
from paravt_train.toy.toolshy import build_toolshy
from paravt_train.toy.world import make_worlds

MODES = REPO_CHECKPOINT.parent / "toy-modes"
TRAIN_SEED0 = 500_000  # RL prompts: worlds no SFT saw
HELD_SEED0 = TEST_SEED0 + 5000

#: run name -> (the start's method, the GRPO method, the run's agent settings: over the method's, as `--set agent.*`)
RUNS = {
    "Weaver GRPO (frozen tools)": ("weaver", "weaver", {}),
    "VideoChat-M1 MARL": ("collab", "videochat-m1", {"collab": {"dropout": 0.0}}),
    "VideoChat-M1 MARL + agent dropout": ("collab", "videochat-m1", {}),  # the method's rate, 0.25
}


def agent_yaml(method: str, path: Path) -> str:
    cfg = toy_method_config(method).override(["frames.n_frames=8"])
    path.write_text(cfg.to_yaml())
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(MODES),
                    help="The toy policy that learned every mode (checkpoints/toy-modes).")
    ap.add_argument("--out", default="runs/toy_methods_rl")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--group", type=int, default=4, help="G rollouts per prompt.")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--start-steps", type=int, default=100, help="SFT steps of each tool-shy start.")
    ap.add_argument("--train-worlds", type=int, default=60)
    ap.add_argument("--eval-worlds", type=int, default=40, help="Held-out worlds (2 MCQ questions each).")
    ap.add_argument("--runs", default=";".join(RUNS), help="Which runs, by name, separated by ';'.")
    ap.add_argument("--seed", type=int, default=HELD_SEED0, help="First seed of the held-out worlds (900000 up).")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: on a few shared cores, several "
                    "threads fighting other jobs are many times slower).")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    out = Path(args.out)
    t0 = time.time()
    vids = out / "videos"
    train_w = make_worlds(range(TRAIN_SEED0, TRAIN_SEED0 + args.train_worlds), vids, mcq=2, oe=1, tvg=0)
    held_w = make_worlds(range(args.seed, args.seed + args.eval_worlds), vids, mcq=2, oe=0, tvg=0)
    train = write_parquet(rl_rows(train_w, vids), out / "rl_train.parquet")
    held = prompts_from_rl(write_parquet(rl_rows(held_w, vids), out / "rl_heldout.parquet"), vids)
    wanted = [r.strip() for r in args.runs.split(";") if r.strip()]
    unknown = [r for r in wanted if r not in RUNS]
    if unknown:
        ap.error(f"unknown runs {unknown}; choose from: {'; '.join(RUNS)}")
    runs = {k: v for k, v in RUNS.items() if k in wanted}
    starts, before, results = {}, {}, {}
    for name, (method, preset, agent_settings) in runs.items():
        t1 = time.time()
        if method not in starts:
            starts[method] = build_toolshy(args.model, out / f"start-{method}", steps=args.start_steps,
                                           method=method, progress=False)
        slug = name.lower().replace(" ", "-").replace("(", "").replace(")", "").replace("+", "plus")
        cfg = GRPOConfig(
            method=preset, model=str(starts[method]), data=str(train), video_root=str(vids),
            agent_config=agent_yaml(method, out / f"{slug}.yaml"), agent=agent_settings, output_dir=str(out / slug),
            steps=args.steps, prompts_per_step=args.prompts_per_step, group_size=args.group, lr=args.lr,
            max_new_tokens=160, subagent_max_new_tokens=32, micro_batch_size=1, save_every=1000,
            concurrency=args.prompts_per_step, seed=0, eval={"n_frames": 8})
        tr = GRPOTrainer(cfg, progress=False)
        tr.setup()
        if method not in before:
            before[method] = tr.evaluate(held)
        tr.run()
        after = tr.evaluate(held)
        recs = [json.loads(x) for x in (out / slug / "metrics.jsonl").read_text().splitlines()]
        k = max(1, len(recs) // 5)
        b, a = before[method]["eval/scores"], after["eval/scores"]
        results[name] = {
            "minutes": (time.time() - t1) / 60, "preset": preset,
            "reward": (sum(r["reward"] for r in recs[:k]) / k, sum(r["reward"] for r in recs[-k:]) / k),
            "kappa": (sum(r["kappa"] for r in recs[:k]) / k, sum(r["kappa"] for r in recs[-k:]) / k),
            "before": mean_ci(b), "after": mean_ci(a), "gain": paired_diff_ci(b, a),
            "calls": (before[method]["eval/tool_calls"], after["eval/tool_calls"]),
            "failed": (before[method].get("eval/failed", 0), after.get("eval/failed", 0)), "n": len(b),
            # the train–inference mismatch the trainer measured every step (means over the run)
            **{key: sum(r.get(key, 0.0) for r in recs) / len(recs)
               for key in ("mismatch/kl_k3", "mismatch/chi2", "mismatch/past_threshold")}}
        print(f"{name}: {results[name]}")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print("\n| run | reward (first → last fifth) | κ | held-out MCQ, n = 8 (95% CI) before → after | gain (paired 95% "
          "CI) | tool calls / question | mismatch KL k3 / χ² / past C | minutes |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        b, a, g = r["before"], r["after"], r["gain"]
        print(f"| {name} | {r['reward'][0]:.2f} → {r['reward'][1]:.2f} | {r['kappa'][0]:.2f} → {r['kappa'][1]:.2f} | "
              f"{b[0]:.2f} [{b[1]:.2f}, {b[2]:.2f}] → {a[0]:.2f} [{a[1]:.2f}, {a[2]:.2f}] | "
              f"{g[0]:+.2f} [{g[1]:+.2f}, {g[2]:+.2f}] | {r['calls'][0]:.1f} → {r['calls'][1]:.1f} | "
              f"{r['mismatch/kl_k3']:.1e} / {r['mismatch/chi2']:.1e} / {100 * r['mismatch/past_threshold']:.2f}% | "
              f"{r['minutes']:.1f} |")
    fails = ", ".join(f"{n} {r['failed'][0]} / {r['failed'][1]}" for n, r in results.items())
    print(f"\n{len(held)} held-out questions (seeds {args.seed}-{args.seed + args.eval_worlds - 1}); errors before / "
          f"after (left out of the scores): {fails}; total {(time.time() - t0) / 60:.1f} min")


if __name__ == "__main__":
    main()
