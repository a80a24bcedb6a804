"""A starting policy for RL that leaves room to learn: the toy policy made tool-shy by a short SFT.

The shipped toy policy answers colour-at-t questions by cropping (accuracy ~1 at n = 8) and is nearly
deterministic, so RL has nothing to improve. This fine-tunes it for a few steps on a weaker mix of
colour-at-t traces whose tool use depends on the overview's density, as the paper's starting policies' does:
on dense overviews (n in ``dense``: 32, 64) every trace answers directly from the nearest overview frame
although the tool is offered (right in most cases there: the frames are a second or two apart); on sparse
ones (4, 8, 16) most do (``skip_share``) and the rest crop as before. The result skips the tool on a
64-frame overview and usually at n = 8 (greedy accuracy near the nearest-frame shortcut's), but still crops
in some samples at τ = 0.7 on sparse overviews — the situation the paper's nFrames gating is about: tool-using
rollouts score higher there, and GRPO can move the policy towards them only if it sees sparse overviews.
The worlds use their own seeds, disjoint from the toy's training, RL and held-out worlds.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

from paravt_train.data import write_parquet
from paravt_train.sft import train
from paravt_train.sft.config import SFTConfig
from paravt_train.toy.build import toy_agent_config
from paravt_train.toy.methods import POOL, collab_rows, collab_skip_rows, weaver_skip_trace, weaver_trace
from paravt_train.toy.world import direct_trace, make_worlds, parallel_trace
from tools import ToolRegistry

__all__ = ["TOOLSHY_SEED0", "build_toolshy"]

TOOLSHY_SEED0 = 700_000


def build_toolshy(model: str | Path, out: str | Path, worlds: int = 80, steps: int = 120, skip_share: float = 0.75,
                  lr: float = 5e-4, seed: int = 0, dense: tuple[int, ...] = (32, 64), progress: bool = True,
                  log=print, method: str = "paravt") -> Path:
    """Write the tool-shy policy to ``out`` (cached: an existing model directory is returned as is). ``method``:
    whose traces it skips the tool in: ``paravt`` (the planner answers from the overview), ``weaver`` (Weaver's
    loop answers without calling a tool), ``collab`` (each agent plans no tool and answers from its key info, the
    nearest frame), each at the same rates (toy/methods.py)."""

    out = Path(out)
    if (out / "config.json").is_file():
        log(f"tool-shy start already built: {out}")
        return out
    work = out.with_name(out.name + ".build")
    rng = random.Random(seed)
    ws = make_worlds(range(TOOLSHY_SEED0 + seed, TOOLSHY_SEED0 + seed + worlds), work / "videos", progress,
                     mcq=3, oe=1, tvg=0)
    schema = ToolRegistry.default(entry_points_too=False).subset(["crop_video"]).schemas()
    rows = []
    for w in ws:
        for q in w.questions:
            n = rng.choice((4, 8, 16, *dense))
            skip = n in dense or rng.random() < skip_share
            for i, msgs in enumerate(_traces(method, w, q, n, skip, schema, rng)):
                rows.append({"id": f"{q.qid}-{i}", "messages": msgs})
    data = write_parquet(rows, work / "sft.parquet")
    frames = toy_agent_config().frames
    cfg = SFTConfig(model=str(model), data=str(data), output_dir=str(work / "sft"), frames=frames, lr=lr,
                    batch_size=8, micro_batch_size=1, max_steps=steps, warmup_ratio=0.1, save_every=0, seed=seed,
                    resume=False)
    result = train(cfg, progress=progress)
    final = work / "sft" / "final"  # with the toy's agent_config.yaml (SFT writes the model's own)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(final, out)
    skipped = sum(1 for r in rows if "<tool_call>" not in r["messages"][2]["content"] and "<answer>" in
                  r["messages"][-1]["content"])
    log(f"tool-shy start: {steps} SFT steps on {len(rows)} traces ({skipped} skip the tool: all at n in {dense}, "
        f"{skip_share:.0%} of the rest), final loss {result['losses'][-1]:.3f} -> {out}")
    return out


def _traces(method: str, w, q, n: int, skip: bool, schema, rng) -> list[list[dict]]:
    """One question's traces of the tool-shy mix under ``method``."""
    if method == "paravt":
        return [direct_trace(w, q, w.video, n, schema) if skip else parallel_trace(w, q, w.video, n, schema)]
    if method == "weaver":
        return [weaver_skip_trace(w, q, w.video, n) if skip else weaver_trace(w, q, w.video, n)]
    if method == "collab":
        if skip:
            return [m for name in POOL for m in collab_skip_rows(w, q, w.video, n, name)]
        return collab_rows(w, q, w.video, n, rng)
    raise ValueError(f"unknown method {method!r}; choose paravt, weaver or collab")
