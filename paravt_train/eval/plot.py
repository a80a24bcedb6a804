"""``paravt-train plot``: the curves of one or several RL runs' ``metrics.jsonl`` as one PNG."""

from __future__ import annotations

import json
import math
from pathlib import Path

from paravt_agent.errors import ConfigError

__all__ = ["plot"]


def plot(run: str | Path, out: str | Path | None = None) -> Path:
    """Curves of a run's metrics.jsonl (reward, f_τ, κ, accuracy, KL, entropy, clip fraction) as one PNG.

    Several runs can be overlaid: pass a folder holding runs, or a comma-separated list of runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for r in str(run).split(","):
        p = Path(r)
        if (p / "metrics.jsonl").is_file():
            runs.append(p)
        elif p.is_dir():
            runs.extend(sorted(q.parent for q in p.glob("*/metrics.jsonl")))
    if not runs:
        raise ConfigError(f"no metrics.jsonl under {run}")
    keys = [("reward", "reward"), ("f_tau", "f_τ (format)"), ("kappa", "κ (tool calls / rollout)"),
            ("accuracy", "accuracy"), ("kl", "KL to reference"), ("entropy", "entropy"),
            ("clip_fraction", "clip fraction"), ("reward/tool", "R_tool")]
    fig, axes = plt.subplots(2, 4, figsize=(16, 7))
    for r in runs:
        recs = [json.loads(ln) for ln in (r / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        steps = [x["step"] for x in recs]
        for ax, (k, title) in zip(axes.flat, keys, strict=True):
            ax.plot(steps, [x.get(k, math.nan) for x in recs], label=r.name)
            ax.set_title(title)
            ax.set_xlabel("step")
    axes.flat[0].legend()
    fig.tight_layout()
    out = Path(out) if out else (runs[0] if len(runs) == 1 else Path(run.split(",")[0]) if "," in str(run)
                                 else Path(run)) / "curves.png"
    if out.is_dir():
        out = out / "curves.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
