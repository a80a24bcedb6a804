"""Fair batching on the ``local`` backend: do short questions finish in their normal time while a long (but
legal) one is in the queue?

    .venv/bin/python perf/bench_fairness.py [--model checkpoints/toy] [--long-tokens 4000] [--repeat 3]

Eight short requests (planner prompts of the toy policy: an overview of 4 frames and a question) are sent
alone, then right after one long request (the same prompt with a question of about ``--long-tokens`` tokens).
Printed per batching policy: the short requests' latency (the last one's) with the long one queued, its ratio
to the same eight alone (1.0 = unaffected), and the long request's own latency.

* ``fair``: the defaults (rows of a batch within ``length_ratio`` of each other's length and at most
  ``max_batch_tokens`` padded prompt tokens; short prompts waiting beside a long oldest one go first).
* ``padded``: none of that (the behaviour before it): the long prompt joins the short ones' batch and every
  row is padded to its length.
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
    from paravt_train.toy.build import toy_agent_config
    from paravt_train.toy.quickstart import REPO_CHECKPOINT
    from paravt_train.toy.world import make_worlds

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO_CHECKPOINT))
    ap.add_argument("--long-tokens", type=int, default=4000, help="Length of the long question in tokens.")
    ap.add_argument("--tokens", type=int, default=24, help="Tokens generated per request.")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="paravt-fair-"))
    worlds = make_worlds(range(991_000, 991_008), tmp)
    settings = {"fair": {}, "padded": {"max_batch_tokens": 10**9, "length_ratio": 10**9, "long_prompt_tokens": 10**9}}
    policies = {name: LocalPolicy(args.model, max_batch=9, batch_wait=0.05, **kw) for name, kw in settings.items()}
    base = next(iter(policies.values()))
    agent = Agent(policy=base, config=toy_agent_config().model_copy(update={"max_question_tokens": 10**6}))
    shorts = [agent.prepare(w.video, w.questions[0].question, w.questions[0].options, n_frames=4).messages
              for w in worlds]
    filler = "Describe every colour you can see in this video, second by second, and say when it changes. "
    per = base.count_text_tokens(filler)
    w = worlds[0]
    long_msgs = agent.prepare(w.video, filler * (args.long_tokens // per), w.questions[0].options, n_frames=4).messages
    sampling = Sampling(max_new_tokens=args.tokens)
    for p in policies.values():  # every request generates exactly --tokens tokens
        p.chat.placeholder_ids.append(p.eos_id)
    n_long, n_short = base.count_tokens(long_msgs), base.count_tokens(shorts[0])

    async def timed(policy, msgs, t0):
        await policy.generate(msgs, sampling)
        return time.perf_counter() - t0

    def alone(policy) -> float:
        async def go():
            t0 = time.perf_counter()
            return max(await asyncio.gather(*(timed(policy, m, t0) for m in shorts)))
        return asyncio.run(go())

    def with_long(policy) -> tuple[float, float]:
        async def go():
            t0 = time.perf_counter()
            long = asyncio.ensure_future(timed(policy, long_msgs, t0))
            await asyncio.sleep(0.005)
            short = max(await asyncio.gather(*(timed(policy, m, t0) for m in shorts)))
            return short, await long
        return asyncio.run(go())

    print(f"model {args.model}; 8 short prompts of {n_short} tokens, one long of {n_long}; {args.tokens} new tokens "
          f"each; median of {args.repeat}")
    print("| batching | 8 short alone (s) | 8 short, long queued first (s) | ratio | long request (s) |")
    print("|---|---|---|---|---|")
    for name, policy in policies.items():
        alone(policy), with_long(policy)  # warm-up (vision features cached alike for both)
        a = statistics.median(alone(policy) for _ in range(args.repeat))
        mixed = [with_long(policy) for _ in range(args.repeat)]
        s = statistics.median(m[0] for m in mixed)
        lg = statistics.median(m[1] for m in mixed)
        print(f"| {name} | {a:.2f} | {s:.2f} | {s / a:.2f}x | {lg:.2f} |")


if __name__ == "__main__":
    main()
