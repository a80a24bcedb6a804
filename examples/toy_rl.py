"""Vanilla GRPO vs PARA-GRPO on the toy world, on CPU, from the shipped toy SFT policy.

    .venv/bin/python examples/toy_rl.py                 # both presets, ~13 min each on 2 cores
    .venv/bin/python examples/toy_rl.py --steps 5       # a quick look

Builds a toy RL split (training worlds) and a held-out split (disjoint seeds),
runs ``vanilla-grpo`` and ``para-grpo`` with the same budget, scores both
policies greedily on the held-out worlds before and after (n = 8 overview
frames, where the tool matters), and prints a table of reward, f_τ, κ and
held-out accuracy; the curves of both runs go to OUT/curves.png.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from paravt_train.data import write_parquet
from paravt_train.grpo_config import GRPOConfig
from paravt_train.grpo_trainer import GRPOTrainer
from paravt_train.plot import plot
from paravt_train.toy.build import TEST_SEED0
from paravt_train.toy.quickstart import REPO_CHECKPOINT
from paravt_train.toy.world import make_worlds, rl_rows

TRAIN_SEED0 = 500_000  # RL prompts: worlds the SFT policy never saw either


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO_CHECKPOINT), help="SFT policy (default: checkpoints/toy).")
    ap.add_argument("--out", default="runs/toy_rl", help="Output folder.")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompts-per-step", type=int, default=2)
    ap.add_argument("--group", type=int, default=8, help="G rollouts per prompt.")
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--train-worlds", type=int, default=40)
    ap.add_argument("--eval-worlds", type=int, default=20)
    ap.add_argument("--presets", default="vanilla-grpo,para-grpo")
    args = ap.parse_args()

    out = Path(args.out)
    vids = out / "videos"
    train_w = make_worlds(range(TRAIN_SEED0, TRAIN_SEED0 + args.train_worlds), vids)
    test_w = make_worlds(range(TEST_SEED0 + 5000, TEST_SEED0 + 5000 + args.eval_worlds), vids)
    train = write_parquet(rl_rows(train_w, vids), out / "rl_train.parquet")
    held = write_parquet(rl_rows(test_w, vids), out / "rl_heldout.parquet")
    results = {}
    for preset in args.presets.split(","):
        t0 = time.time()
        cfg = GRPOConfig(
            preset=preset, model=args.model, data=str(train), eval_data=str(held), eval_n_frames=8,
            video_root=str(vids), output_dir=str(out / preset), steps=args.steps,
            prompts_per_step=args.prompts_per_step, group_size=args.group, lr=args.lr,
            max_new_tokens=448,  # a grounding scan of a 2-minute video is 8 calls (~300 tokens)
            subagent_max_new_tokens=64, micro_batch_size=1, save_every=10, concurrency=args.prompts_per_step,
        )
        summary = GRPOTrainer(cfg).run()
        recs = [json.loads(x) for x in (out / preset / "metrics.jsonl").read_text().splitlines()]
        k = max(1, len(recs) // 5)  # first and last fifth of the run
        first, last = recs[:k], recs[-k:]

        def avg(rs, key):
            return sum(r[key] for r in rs) / len(rs)

        results[preset] = {
            "minutes": (time.time() - t0) / 60,
            **{f"{key}_first": avg(first, key) for key in ("reward", "f_tau", "kappa", "accuracy")},
            **{f"{key}_last": avg(last, key) for key in ("reward", "f_tau", "kappa", "accuracy")},
            "heldout_before": summary["eval_before"]["eval/accuracy"],
            "heldout_after": summary["eval_after"]["eval/accuracy"],
            "heldout_calls_before": summary["eval_before"]["eval/tool_calls"],
            "heldout_calls_after": summary["eval_after"]["eval/tool_calls"],
        }
    png = plot(",".join(str(out / p) for p in results), out / "curves.png")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print("\n| preset | reward (first→last fifth) | f_τ | κ | train acc | held-out acc n=8 (before→after) "
          "| held-out tool calls | minutes |")
    print("|---|---|---|---|---|---|---|---|")
    for p, r in results.items():
        print(f"| {p} | {r['reward_first']:.2f} → {r['reward_last']:.2f} | {r['f_tau_first']:.2f} → "
              f"{r['f_tau_last']:.2f} | {r['kappa_first']:.2f} → {r['kappa_last']:.2f} | "
              f"{r['accuracy_first']:.2f} → {r['accuracy_last']:.2f} | {r['heldout_before']:.3f} → "
              f"{r['heldout_after']:.3f} | {r['heldout_calls_before']:.1f} → {r['heldout_calls_after']:.1f} | "
              f"{r['minutes']:.1f} |")
    print(f"\ncurves: {png}")


if __name__ == "__main__":
    main()
