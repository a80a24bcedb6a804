"""Throughput of the ``local`` backend when concurrent calls are batched.

The agent fans out K sub-agents at once and RL rolls out G episodes at once; the
``local`` policy batches the calls that arrive together. This script sends B
identical-shape requests concurrently (toy planner prompts: system prompt + an
overview of n frames + a question; and sub-agent prompts: 2-16 frames) and prints
generated tokens per second for B = 1, 4, 8, 16, and the ratio to B = 1.

    .venv/bin/python perf/bench_local_batching.py [--model checkpoints/toy] [--tokens 48]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    from paravt_agent.agent import Agent
    from paravt_agent.policy.base import Sampling
    from paravt_agent.policy.local import LocalPolicy
    from paravt_agent.prompts import subagent_messages
    from paravt_train.toy.build import toy_agent_config
    from paravt_train.toy.quickstart import REPO_CHECKPOINT
    from paravt_train.toy.world import make_worlds

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO_CHECKPOINT))
    ap.add_argument("--tokens", type=int, default=48, help="Tokens generated per request (min = max).")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    import torch

    tmp = Path(tempfile.mkdtemp(prefix="paravt-bench-"))
    worlds = make_worlds(range(990_000, 990_016), tmp)
    policy = LocalPolicy(args.model, max_batch=16, batch_wait=0.02)
    agent = Agent(policy=policy, config=toy_agent_config())
    planner = [agent.prepare(w.video, w.questions[0].question, w.questions[0].options, n_frames=16).messages
               for w in worlds]
    subs = []
    for w in worlds:
        from paravt_agent.video import VideoReader

        clip = VideoReader(w.video).crop(10, 20, crop_fps=1.0, max_pixels=1024)
        subs.append(subagent_messages(clip.frames, clip.timestamps, (10, 20), w.questions[0].question))

    # every request generates exactly --tokens tokens: the model never samples its end of turn
    policy.chat.placeholder_ids.append(policy.eos_id)

    def run(prompts, B):
        sampling = Sampling(max_new_tokens=args.tokens)

        async def go():
            return await asyncio.gather(*(policy.generate(p, sampling) for p in prompts[:B]))

        t0 = time.perf_counter()
        outs = asyncio.run(go())
        dt = time.perf_counter() - t0
        assert all(o.batch_size == B for o in outs), [o.batch_size for o in outs]
        return sum(o.completion_tokens for o in outs) / dt

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    print(f"model {args.model}, {args.tokens} tokens per request, median of {args.repeat}")
    print("| requests | planner prompt tok/s | ratio | sub-agent prompt tok/s | ratio |")
    print("|---|---|---|---|---|")
    base = {}
    for B in (1, 4, 8, 16):
        row = []
        for name, prompts in (("planner", planner), ("sub", subs)):
            run(prompts, B)  # warm-up
            rate = statistics.median(run(prompts, B) for _ in range(args.repeat))
            base.setdefault(name, rate)
            row += [f"{rate:.0f}", f"{rate / base[name]:.2f}x"]
        print(f"| {B} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
