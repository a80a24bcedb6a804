"""What the HTTP layer costs: ``paravt api`` against in-process ``Agent.answer``, on the toy policy.

Both sides answer the same toy questions (real mp4s, the shipped toy policy, local backend, 8-frame
overviews) one at a time, interleaved (question i in-process with ``Agent.answer``, then over HTTP
through ``paravt api``: a subprocess on 127.0.0.1, the official ``openai`` client), so drift of the
machine hits both alike. Prints p50/p95 latency of each and of the per-question difference (the API
layer's cost: JSON, video path checks, the reply, the client).
Then throughput (questions per second) with 1, 8 and 32 concurrent clients against the API, where the
local backend batches concurrent questions' model calls.

    python perf/bench_api.py [--questions 100] [--throughput 32] [--port 8765]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=100)
    ap.add_argument("--throughput", type=int, default=32, help="Questions per concurrency level.")
    ap.add_argument("--port", type=int, default=8765)
    args = ap.parse_args()

    from openai import AsyncOpenAI, OpenAI

    from paravt_agent.agent import Agent
    from paravt_train.toy.quickstart import REPO_CHECKPOINT
    from paravt_train.toy.world import make_worlds

    tmp = Path(tempfile.mkdtemp(prefix="paravt-bench-api-"))
    worlds = make_worlds(range(930_000, 930_000 + max(4, args.questions // 4)), tmp / "videos", mcq=2, oe=2, tvg=0)
    items = [(w, q) for w in worlds for q in w.questions][: args.questions]
    print(f"{len(items)} toy questions on {len(worlds)} videos; toy policy {REPO_CHECKPOINT}", flush=True)

    agent = Agent(model=str(REPO_CHECKPOINT))
    agent.answer(items[0][0].video, items[0][1].question, items[0][1].options, n_frames=8)  # load, warm

    proc = subprocess.Popen([sys.executable, "-m", "paravt_agent.cli", "api", "--port", str(args.port),
                             "--video-root", str(tmp / "videos"), "--max-concurrent", "32"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{args.port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"paravt api did not start: {proc.stderr.read()[-2000:]}")
            time.sleep(0.3)
        client = OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="x", timeout=600)

        def ask(c, w, q):
            return c.chat.completions.create(
                model="paravt", extra_body={"options": q.options, "n_frames": 8},
                messages=[{"role": "user", "content": [{"type": "video_url", "video_url": {"url": Path(w.video).name}},
                                                       {"type": "text", "text": q.question}]}])

        ask(client, *items[0])  # load, warm
        direct, api = [], []
        for w, q in items:
            t0 = time.perf_counter()
            agent.answer(w.video, q.question, q.options, n_frames=8)
            direct.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ask(client, w, q)
            api.append(time.perf_counter() - t0)
        diff = [a - d for a, d in zip(api, direct, strict=True)]
        print("\n| path | p50 (s) | p95 (s) | mean (s) |\n|---|---|---|---|")
        for name, xs in (("in-process Agent.answer", direct), ("paravt api (HTTP)", api),
                         ("difference per question", diff)):
            print(f"| {name} | {pct(xs, 0.5):.3f} | {pct(xs, 0.95):.3f} | {statistics.mean(xs):.3f} |")
        print(f"API layer p50 ratio: {pct(api, 0.5) / pct(direct, 0.5):.3f}x in-process")

        async def burst(concurrency: int) -> float:
            aclient = AsyncOpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="x", timeout=600)
            sem = asyncio.Semaphore(concurrency)
            batch = [items[i % len(items)] for i in range(args.throughput)]

            async def one(w, q):
                async with sem:
                    return await aclient.chat.completions.create(
                        model="paravt", extra_body={"options": q.options, "n_frames": 8},
                        messages=[{"role": "user", "content": [
                            {"type": "video_url", "video_url": {"url": Path(w.video).name}},
                            {"type": "text", "text": q.question}]}])

            t0 = time.perf_counter()
            out = await asyncio.gather(*(one(w, q) for w, q in batch))
            took = time.perf_counter() - t0
            await aclient.close()
            assert all(r.choices[0].message.content is not None for r in out)
            return len(batch) / took

        print("\n| concurrent clients | questions/s | vs 1 client |\n|---|---|---|")
        base = None
        for c in (1, 8, 32):
            qps = asyncio.run(burst(c))
            base = base or qps
            print(f"| {c} | {qps:.2f} | {qps / base:.2f}x |", flush=True)
    finally:
        proc.terminate()
        proc.wait(20)


if __name__ == "__main__":
    main()
