"""Peak memory: ``answer_many`` over 64 toy questions, and one toy GRPO step (G = 8).

Each runs in its own process (so its peak resident set is its own, ``getrusage`` maxrss), on the
shipped toy policy and real toy mp4s, and prints the peak RSS, the RSS after loading the model
(what the work itself added) and the decoded-frame caches' bytes against their bounds
(``PARAVT_FRAME_CACHE_MB`` for the decoder pool; ``PromptCache.max_bytes`` for GRPO prompts).

    python perf/bench_memory.py [--questions 64] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

ANSWER = r"""
import json, resource, sys, tempfile
from pathlib import Path
from paravt_agent.agent import Agent
from paravt_agent.video import POOL
from paravt_train.toy.quickstart import REPO_CHECKPOINT
from paravt_train.toy.world import make_worlds
n, conc = int(sys.argv[1]), int(sys.argv[2])
tmp = Path(tempfile.mkdtemp())
worlds = make_worlds(range(950_000, 950_000 + n // 4 + 1), tmp, mcq=2, oe=2, tvg=0)
items = [{"video": w.video, "question": q.question, "options": q.options, "n_frames": 16}
         for w in worlds for q in w.questions][:n]
agent = Agent(model=str(REPO_CHECKPOINT))
agent.answer(items[0]["video"], items[0]["question"], items[0]["options"], n_frames=4)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
answers = agent.answer_many(items, concurrency=conc, progress=False)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"peak_mb": peak, "after_load_mb": base, "answered": sum(a.ok for a in answers),
                  "frame_cache_mb": POOL.result_bytes / 2**20, "frame_cache_bound_mb": POOL.max_result_bytes / 2**20}))
"""

GRPO = r"""
import json, resource, sys, tempfile
from pathlib import Path
from paravt_train.data import write_parquet
from paravt_train.rl.config import GRPOConfig
from paravt_train.rl.trainer import GRPOTrainer
from paravt_train.toy.quickstart import REPO_CHECKPOINT
from paravt_train.toy.rows import rl_rows
from paravt_train.toy.world import make_worlds
from paravt_agent.video import POOL
tmp = Path(tempfile.mkdtemp())
worlds = make_worlds(range(960_000, 960_004), tmp / "videos")
data = write_parquet(rl_rows(worlds, tmp / "videos"), tmp / "rl.parquet")
cfg = GRPOConfig(model=str(REPO_CHECKPOINT), data=str(data), video_root=str(tmp / "videos"),
                 output_dir=str(tmp / "out"), steps=1, prompts_per_step=2, group_size=8, max_new_tokens=96,
                 subagent_max_new_tokens=40, temperature=0.7, concurrency=8)
tr = GRPOTrainer(cfg, progress=False, log=lambda *a: None)
tr.setup()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
tr.run()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"peak_mb": peak, "after_load_mb": base, "frame_cache_mb": POOL.result_bytes / 2**20,
                  "prompt_cache_mb": tr.cache.bytes / 2**20, "prompt_cache_bound_mb": tr.cache.max_bytes / 2**20}))
"""


def run(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=tempfile.gettempdir())
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    a = run(ANSWER, str(args.questions), str(args.concurrency))
    print(f"answer_many, {args.questions} toy questions (16-frame overviews, concurrency {args.concurrency}): "
          f"peak RSS {a['peak_mb']:.0f} MiB ({a['after_load_mb']:.0f} after loading the model, "
          f"+{a['peak_mb'] - a['after_load_mb']:.0f} for the work); {a['answered']} answered; frame cache "
          f"{a['frame_cache_mb']:.1f} of {a['frame_cache_bound_mb']:.0f} MiB")
    g = run(GRPO)
    print(f"one toy GRPO step (2 prompts x G = 8): peak RSS {g['peak_mb']:.0f} MiB ({g['after_load_mb']:.0f} after "
          f"setup, +{g['peak_mb'] - g['after_load_mb']:.0f} for the step); frame cache {g['frame_cache_mb']:.1f} MiB, "
          f"prompt cache {g['prompt_cache_mb']:.1f} of {g['prompt_cache_bound_mb']:.0f} MiB")


if __name__ == "__main__":
    main()
