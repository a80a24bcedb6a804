"""Shared prompt work in the ``local`` backend: with and without it, side by side in one run.

    .venv/bin/python perf/bench_reuse.py            # ~4 min on 2 cores
    .venv/bin/python perf/bench_reuse.py --repeats 5

1. The rollout phase of one toy GRPO step (the shipped toy policy, 2 prompts x G = 8 at tau = 0.7, the
   trainer's own ``rollout``): ``reuse=False`` (every row prefills its prompt and runs the vision tower on
   its frames) against ``reuse=True`` (vision features per distinct frame, each distinct prompt prefilled
   once, the answer turn continuing its stored sequence). Same seeds: the episodes' token ids must match.
2. The planner's answer turn (turn 2) after a 64-frame overview and its tool turn, alone.

Runs alternate (off, on, off, on, ...) so machine noise hits both; prints medians, their ratio, the
per-phase split of the local backend (encode / prefill / decode) and the caches' hit counts.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def rollout_bench(repeats: int) -> None:
    from paravt_train.data import prompts_from_rl, write_parquet
    from paravt_train.rl.config import GRPOConfig
    from paravt_train.rl.trainer import GRPOTrainer
    from paravt_train.toy.quickstart import REPO_CHECKPOINT
    from paravt_train.toy.rows import rl_rows
    from paravt_train.toy.world import make_worlds

    tmp = Path(tempfile.mkdtemp())
    worlds = make_worlds(range(960_000, 960_002), tmp / "videos", mcq=1, oe=0, tvg=0)
    data = write_parquet(rl_rows(worlds, tmp / "videos"), tmp / "rl.parquet")
    cfg = GRPOConfig(model=str(REPO_CHECKPOINT), data=str(data), video_root=str(tmp / "videos"),
                     output_dir=str(tmp / "out"), steps=1, prompts_per_step=2, group_size=8, max_new_tokens=96,
                     subagent_max_new_tokens=40, temperature=0.7, concurrency=8, gating=False)
    tr = GRPOTrainer(cfg, progress=False, log=lambda *a: None)
    tr.setup()
    prompts = prompts_from_rl(data, tmp / "videos")[:2]
    policy = tr.agent.policy
    times: dict[bool, list[float]] = {False: [], True: []}
    tokens: dict[bool, list] = {}
    tr.rollout(prompts)  # warm: imports, first-call allocations
    for _ in range(repeats):
        for reuse in (False, True):
            policy.reuse = reuse
            policy.vision_cache.clear()
            policy.prefix_cache.clear()
            t = time.perf_counter()
            groups = tr.rollout(prompts)
            times[reuse].append(time.perf_counter() - t)
            tokens[reuse] = [[r.generation.output_ids for r in e.answer.records] if e.answer else e.failed
                             for g in groups for e in g]
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"rollout phase, one toy GRPO step (2 prompts x G = 8, tau = 0.7), median of {repeats}:")
    print(f"  without reuse {off:.2f} s, with reuse {on:.2f} s: {off / on:.2f}x faster")
    print(f"  same token ids with and without reuse: {tokens[False] == tokens[True]}")
    print(f"  vision cache: {policy.vision_cache.hits} hits, {policy.vision_cache.misses} misses; prefix cache: "
          f"{policy.prefix_cache.hits} hits, {policy.prefix_cache.reused_tokens} tokens reused (last run)")


def turn2_bench(repeats: int) -> None:
    from paravt_agent.agent import Agent
    from paravt_agent.policy.local import LocalPolicy
    from paravt_agent.prompts import tool_response_message
    from paravt_agent.types import Continuation, Sampling
    from paravt_train.toy.build import toy_agent_config
    from paravt_train.toy.quickstart import REPO_CHECKPOINT
    from paravt_train.toy.world import call_label, make_worlds, windows_for

    tmp = Path(tempfile.mkdtemp())
    w = make_worlds([960_010], tmp / "videos", mcq=1, oe=0, tvg=0)[0]
    q = w.questions[0]
    policy = LocalPolicy(REPO_CHECKPOINT)
    agent = Agent(policy=policy, config=toy_agent_config())
    inp = agent.prepare(w.video, q.question, q.options, 64)
    greedy = Sampling(temperature=0.0, max_new_tokens=96)
    tool = tool_response_message([(call_label(w, a, b), w.report(q, a, b)) for a, b in windows_for(w, q)])
    times: dict[bool, list[float]] = {False: [], True: []}
    phases: dict[bool, dict] = {}
    texts: dict[bool, str] = {}
    for _ in range(repeats + 1):
        for reuse in (False, True):
            policy.reuse = reuse
            policy.vision_cache.clear()
            policy.prefix_cache.clear()
            g1 = policy.generate_sync(inp.messages, greedy, "<think>\n")
            msgs = [*inp.messages, {"role": "assistant", "content": g1.text}, tool]
            t = time.perf_counter()
            g2 = policy.generate_sync(msgs, greedy, "<think>\n", Continuation(len(inp.messages), g1))
            times[reuse].append(time.perf_counter() - t)
            phases[reuse], texts[reuse] = g2.timings, g2.text
    off, on = statistics.median(times[False][1:]), statistics.median(times[True][1:])  # the first run warms
    print(f"planner turn 2 after a 64-frame overview ({g2.prompt_tokens} prompt tokens), median of {repeats}:")
    print(f"  without reuse {off * 1000:.0f} ms, with reuse {on * 1000:.0f} ms: {off / on:.2f}x lower")
    print(f"  phases without: {phases[False]}; with: {phases[True]}")
    print(f"  same answer with and without reuse: {texts[False] == texts[True]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", choices=["rollout", "turn2"])
    args = ap.parse_args()
    if args.only != "rollout":
        turn2_bench(args.repeats)
    if args.only != "turn2":
        rollout_bench(args.repeats)


if __name__ == "__main__":
    main()
