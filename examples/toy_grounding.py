"""Toy grounding: how well the toy policy localises a colour's segment, with the tool and without it.

    .venv/bin/python examples/toy_grounding.py            # 2.7 min on 2 cores (measured)
    .venv/bin/python examples/toy_grounding.py --worlds 8 # a quick look

Held-out toy videos (seeds disjoint from training): for each, "When is the segment of colour <c> shown?"
(a colour shown once; answer: its [start, end]) plus the MCQ / open-ended colour-at-t questions.
The real agent (LangGraph graph, local backend) answers in parallel mode (K sub-agents scan the video in
16-second windows, each listing the colour per second and reporting where the asked colour starts and
ends in its window; the answer step copies those seconds), in no-tool mode (overview frames only) and
against the nearest-overview-frame shortcut, at n = 4, 8 and 64 overview frames. Prints the table and the
per-role accuracies, writes OUT/grounding.png (mIoU per n and mode) and OUT/results.json. Pass --model to
measure another policy.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from paravt_train.toy.build import TEST_SEED0
from paravt_train.toy.quickstart import REPO_CHECKPOINT, run


def plot(results: dict, shortcut: dict, ns, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, task, title in ((axes[0], "tvg", "grounding mIoU"), (axes[1], "mcq", "MCQ accuracy")):
        width = 0.8 / 3
        rows = [(m, {n: results[(m, n)].get(task, 0.0) for n in ns}) for m in ("parallel", "none")]
        rows.append(("nearest frame", {n: shortcut[n].get(task, 0.0) for n in ns}))
        for i, (name, vals) in enumerate(rows):
            ax.bar([k + (i - 1) * width for k in range(len(ns))], [vals[n] for n in ns], width, label=name)
        ax.set_xticks(range(len(ns)), [f"n = {n}" for n in ns])
        ax.set_ylim(0, 1.05)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO_CHECKPOINT), help="Toy policy directory (default: checkpoints/toy).")
    ap.add_argument("--out", default="runs/toy_grounding")
    ap.add_argument("--worlds", type=int, default=32, help="Held-out videos (1 grounding + 4 colour questions each).")
    ap.add_argument("--n", type=int, nargs="+", default=[4, 8, 64])
    ap.add_argument("--seed", type=int, default=TEST_SEED0, help="First seed of the held-out worlds (any range "
                    "from 900000 up is unseen by training).")
    args = ap.parse_args()
    t0 = time.time()
    out = Path(args.out)
    res = run(args.model, out=out, worlds=args.worlds, modes=("parallel", "none"), ns=tuple(args.n), roles=8,
              seed=args.seed)
    png = plot(res["results"], res["shortcut"], args.n, out / "grounding.png")
    summary = json.loads((out / "results.json").read_text())
    summary["minutes"] = (time.time() - t0) / 60
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    print(f"\nplot: {png}; {summary['minutes']:.1f} min in all")


if __name__ == "__main__":
    main()
