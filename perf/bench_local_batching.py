"""Throughput of the ``local`` backend when concurrent calls are batched.

The agent fans out K sub-agents at once and RL rolls out G episodes at once; the
``local`` policy batches the calls that arrive together. This script sends B
identical-shape requests concurrently (toy planner prompts: system prompt + an
overview of n frames + a question; and sub-agent prompts: 2-16 frames) and prints
generated tokens per second for B = 1, 4, 8, 16, and the ratio to B = 1.

Then (unless ``--no-profile``) where a decoding step's time goes at B = 1 and 8: milliseconds per step, the
share spent inside the model's forward (on a GPU: the host's time to launch it, the kernels run behind), the
rest (``generate``'s bookkeeping, the sampler, waiting at host syncs), and per step the ATen operations, the host
syncs (reads of a device value on the host: free on a CPU, a stall of the whole GPU on one) and, on a GPU, the
kernels launched and the GPU's busy time. A step's figures are the difference between a run of ``--tokens``
tokens and a run of one token, divided by the extra steps, so the prefill is not counted.

    .venv/bin/python perf/bench_local_batching.py [--model checkpoints/toy] [--tokens 48] [--device cuda]
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
    ap.add_argument("--device", default="auto",
                    help="The local backend's device: auto (a GPU only for models of 64 MiB of weights or more), cpu, "
                         "cuda.")
    ap.add_argument("--dtype", default="auto", help="auto (bfloat16 on a GPU, float32 on the CPU), float32, bfloat16.")
    ap.add_argument("--sizes", default="1,4,8,16", help="The batch sizes B, comma-separated.")
    ap.add_argument("--no-profile", action="store_true", help="Skip the per-step breakdown.")
    args = ap.parse_args()

    import torch

    tmp = Path(tempfile.mkdtemp(prefix="paravt-bench-"))
    worlds = make_worlds(range(990_000, 990_016), tmp)
    policy = LocalPolicy(args.model, max_batch=16, batch_wait=0.02, device=args.device, dtype=args.dtype)
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
    model = policy.model
    print(f"model {args.model} on {model.device} in {model.dtype}, {args.tokens} tokens per request, "
          f"median of {args.repeat}")
    print("| requests | planner prompt tok/s | ratio | sub-agent prompt tok/s | ratio |")
    print("|---|---|---|---|---|")
    base = {}
    sizes = [int(b) for b in args.sizes.split(",")]
    for B in sizes:
        row = []
        for name, prompts in (("planner", planner), ("sub", subs)):
            run(prompts, B)  # warm-up
            rate = statistics.median(run(prompts, B) for _ in range(args.repeat))
            base.setdefault(name, rate)
            row += [f"{rate:.0f}", f"{rate / base[name]:.2f}x"]
        print(f"| {B} | " + " | ".join(row) + " |")
    if not args.no_profile:
        print()
        print_step_profile(policy, planner, [b for b in (1, 8) if b <= len(planner)], args.tokens)


def print_step_profile(policy, prompts, sizes, tokens) -> None:
    """Where one decoding step's time goes (see the module docstring)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from paravt_agent.policy.base import Sampling

    model = policy.model
    cuda = model.device.type == "cuda"
    forward_s: list[float] = []

    def pre(*_):  # no synchronize: on a GPU the host's share is what is measured, the kernels run behind
        forward_s.append(-time.perf_counter())

    def post(*_):
        forward_s[-1] += time.perf_counter()

    hooks = [model.register_forward_pre_hook(pre), model.register_forward_hook(post)]

    def run(B, n):
        forward_s.clear()
        reqs = [(m, Sampling(max_new_tokens=n), "") for m in prompts[:B]]
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        policy.generate_batch(reqs)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0, sum(forward_s)

    def counts(B, n):
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            run(B, n)
        c = {"aten": 0, "syncs": 0, "kernels": 0, "gpu_us": 0.0}
        for e in prof.key_averages():
            if e.key.startswith("aten::"):
                c["aten"] += e.count
            if e.key == "aten::_local_scalar_dense" or e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize"):
                c["syncs"] += e.count
            if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"):
                c["kernels"] += e.count
            if cuda and e.device_type == DeviceType.CUDA:  # a kernel (or copy) on the GPU: its own duration
                c["gpu_us"] += e.self_device_time_total
        return c

    print("Per decoding step (a run of N tokens minus a run of 1, divided by N - 1; planner prompts):")
    print("| B | ms/step | model forward | rest (generate, sampler, syncs) | ATen ops | host syncs | kernels "
          "| GPU busy |")
    print("|---|---|---|---|---|---|---|---|")
    for B in sizes:
        run(B, tokens)  # warm-up
        (t1, f1), (tn, fn) = run(B, 1), run(B, tokens)
        steps = tokens - 1
        step, fwd = (tn - t1) / steps, (fn - f1) / steps
        c1, cn = counts(B, 1), counts(B, tokens)
        per = {k: (cn[k] - c1[k]) / steps for k in cn}
        busy = f"{per['gpu_us'] / 1e3 / step:.0%}" if cuda else "-"
        kernels = f"{per['kernels']:.0f}" if cuda else "-"
        print(f"| {B} | {step * 1e3:.2f} | {fwd * 1e3:.2f} ms ({fwd / step:.0%}) | {(step - fwd) * 1e3:.2f} ms "
              f"| {per['aten']:.0f} | {per['syncs']:.1f} | {kernels} | {busy} |")
    for h in hooks:
        h.remove()


if __name__ == "__main__":
    main()
