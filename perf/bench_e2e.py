"""End to end, where the time goes: p50/p95 per phase over toy questions (``Trace.breakdown``).

Two runs over the same toy questions (real mp4s, 8-frame overviews, one question at a time):

- ``local``: the shipped toy policy in-process (the ``local`` backend: planner prefill and decode are
  measured inside the model call);
- ``endpoint``: the ``openai`` backend against an OpenAI-compatible server on 127.0.0.1 that answers every
  request after ``--delay`` seconds (a benchmark harness: the planner dispatches ``--k`` crops, each
  sub-agent answers, the planner answers), so what is left is the agent's own overhead.

    python perf/bench_e2e.py [--questions 50] [--delay 0.25] [--k 4]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def table(name: str, traces) -> None:
    keys = list(traces[0].breakdown())
    rows = {k: [t.breakdown()[k] for t in traces] for k in keys}
    total = [t.latency for t in traces]
    print(f"\n{name}: {len(traces)} questions")
    print("| phase | p50 (s) | p95 (s) | share of mean total |\n|---|---|---|---|")
    mean_total = sum(total) / len(total)
    for k in keys:
        share = "" if "(sum)" in k else f"{100 * sum(rows[k]) / len(rows[k]) / mean_total:.1f}%"
        print(f"| {k} | {pct(rows[k], 0.5):.3f} | {pct(rows[k], 0.95):.3f} | {share} |")
    print(f"| total | {pct(total, 0.5):.3f} | {pct(total, 0.95):.3f} | 100% |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=50)
    ap.add_argument("--delay", type=float, default=0.25)
    ap.add_argument("--k", type=int, default=4)
    args = ap.parse_args()

    from bench_fanout import make_server

    from paravt_agent.agent import Agent
    from paravt_agent.config import AgentConfig
    from paravt_train.toy.quickstart import REPO_CHECKPOINT
    from paravt_train.toy.world import make_worlds

    tmp = Path(tempfile.mkdtemp(prefix="paravt-bench-e2e-"))
    worlds = make_worlds(range(940_000, 940_000 + max(2, (args.questions + 3) // 4)), tmp / "videos",
                         mcq=2, oe=2, tvg=0)
    items = [(w, q) for w in worlds for q in w.questions][: args.questions]

    agent = Agent(model=str(REPO_CHECKPOINT))
    agent.answer(items[0][0].video, items[0][1].question, items[0][1].options, n_frames=8)  # load the model
    traces = [agent.answer(w.video, q.question, q.options, n_frames=8).trace for w, q in items]
    table("local backend, toy policy", traces)

    srv = make_server(args.delay)
    url = f"http://127.0.0.1:{srv.server_address[1]}/v1"
    cfg = AgentConfig(max_turns=2, frames={"n_frames": 8, "crop_max_frames": 4})
    remote = Agent(backend="openai", endpoint=url, model=f"fanout-{args.k}-parallel", config=cfg)
    remote.answer(items[0][0].video, "warm-up")
    traces = [remote.answer(w.video, q.question, q.options).trace for w, q in items]
    table(f"openai backend, server with a fixed {args.delay:g}s delay, K = {args.k}", traces)
    ideal = 3 * args.delay
    walls = [t.latency for t in traces]
    print(f"\nendpoint run: p50 {pct(walls, 0.5):.3f}s against an ideal of {ideal:.3f}s (3 delays): "
          f"{pct(walls, 0.5) / ideal:.3f}x")
    srv.shutdown()


if __name__ == "__main__":
    main()
