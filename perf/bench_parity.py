"""Train/serve parity across implementations: SGLang's own Qwen3-VL (its vision tower, mRoPE positions, sampler)
against the trainer's transformers model, on the same rollouts.

    .venv/bin/python perf/bench_parity.py                          # starts SGLang 0.5.23 on CPU (make sglang-cpu)
    .venv/bin/python perf/bench_parity.py --endpoint http://127.0.0.1:30000 --model DIR

Rolls out toy-world questions (multiple choice, open, grounding) through the trainer's own rollout path
(``GRPOTrainer.rollout``, backend ``sglang``: the planner's turns, the sub-agents' crops), then scores every sampled
token with the trainer's model exactly as the update does (``paravt_train.rl.update.token_logprobs`` on the
collated sequence, at the sampling temperature). Prints, per kind of turn (text-only / with images, planner /
sub-agent, first / later planner turn), the per-token |logprob difference| (max, mean, p99), and the share of the
behaviour-policy correction: the weight π_train / π_behav = exp(trainer − SGLang) per token, the fraction of tokens
it would cap at ``--cap`` (decoupled PPO's ``behaviour_weight_cap``, 5 in the paper config) or below 1/cap, and its
mean. ``--json`` writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def kind_of(seq) -> str:
    if seq.role == "text":
        return "text-only turn (the question without its video)"
    return {"planner": "planner, every turn (overview frames, then the sub-agents' summaries)",
            "subagent": "sub-agent (a crop's frames)"}.get(seq.role, seq.role)


def text_only_turns(tr, prompts, group: int, temperature: float) -> list:
    """Text-only turns through the same server: each question without its video, ``group`` samples."""
    import asyncio

    from paravt_agent.types import Sampling
    from paravt_train.rl.rollout import TokenSequence

    policy = tr.agent.policy

    async def one(question: str, seed: int):
        msgs = [{"role": "user", "content": question}]
        return await policy.generate(msgs, Sampling(temperature=temperature, max_new_tokens=96, seed=seed),
                                     prefix="<think>\n")

    async def all_():
        return await asyncio.gather(*(one(p.question, k) for p in prompts for k in range(group)))

    out = []
    for gen in asyncio.run(all_()):
        head = [*gen.prompt_ids, *gen.prefix_ids]
        out.append(TokenSequence(role="text", input_ids=head + list(gen.output_ids),
                                 loss_mask=[0] * len(head) + [1] * len(gen.output_ids),
                                 logprobs=[0.0] * len(head) + list(gen.logprobs)))
    return out


def stats(diffs, weights, cap: float) -> dict:
    import torch

    d = torch.tensor(diffs, dtype=torch.float64)
    w = torch.tensor(weights, dtype=torch.float64)
    return {"tokens": len(diffs), "max": float(d.max()), "mean": float(d.mean()),
            "p99": float(torch.quantile(d, 0.99)), "capped": float((w > cap).double().mean()),
            "below_1_over_cap": float((w < 1 / cap).double().mean()), "mean_weight": float(w.mean())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="The policy (default: the shipped toy policy).")
    ap.add_argument("--endpoint", default=None, help="A running SGLang server of --model (default: start one).")
    ap.add_argument("--worlds", type=int, default=6, help="Toy worlds (3 questions each: MCQ, open, grounding).")
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--cap", type=float, default=5.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    from paravt_train.data import prompts_from_rl, write_parquet
    from paravt_train.rl.config import GRPOConfig
    from paravt_train.rl.trainer import GRPOTrainer
    from paravt_train.rl.update import collate, token_logprobs
    from paravt_train.toy.quickstart import REPO_CHECKPOINT
    from paravt_train.toy.rows import rl_rows
    from paravt_train.toy.world import make_worlds

    model = args.model or str(REPO_CHECKPOINT)
    tmp = Path(tempfile.mkdtemp(prefix="parity-"))
    server = None
    if args.endpoint is None:
        from tests.sglang_cpu.server import SGLangServer, unavailable

        reason = unavailable()
        if reason:
            raise SystemExit(reason)
        t0 = time.time()
        server = SGLangServer(model, tmp / "logs")
        print(f"SGLang {server.url} ready in {time.time() - t0:.0f} s", flush=True)
        endpoint = server.url
    else:
        endpoint = args.endpoint
    try:
        worlds = make_worlds(range(930_000, 930_000 + args.worlds), tmp / "videos")
        data = write_parquet(rl_rows(worlds, tmp / "videos"), tmp / "rl.parquet")
        cfg = GRPOConfig(model=model, data=str(data), video_root=str(tmp / "videos"), output_dir=str(tmp / "run"),
                         backend="sglang", endpoint=endpoint, weight_sync="tensor", group_size=args.group,
                         temperature=args.temperature, prompts_per_step=1, concurrency=4, gating=False)
        tr = GRPOTrainer(cfg, progress=False, log=lambda *_: None)
        tr.setup()  # pushes the model's weights (version "0"): the server serves exactly what is scored
        prompts = prompts_from_rl(str(data), str(tmp / "videos"))
        t0 = time.time()
        groups = tr.rollout(prompts)
        seqs = [s for g in groups for e in g if not e.failed for s in e.sequences]
        seqs += text_only_turns(tr, prompts, args.group, args.temperature)
        print(f"{len(prompts)} prompts x G = {args.group}: {len(seqs)} sequences in {time.time() - t0:.0f} s",
              flush=True)
        by_kind: dict[str, tuple[list, list]] = {}
        everything: tuple[list, list] = ([], [])
        tr.model.eval()
        for seq in seqs:
            batch = collate([seq], tr.chat)
            with torch.no_grad():
                lp, _ = token_logprobs(tr.model, batch, args.temperature)
            mask = batch["loss_mask"][0, 1:] > 0
            trainer = lp[0][mask].double()
            behaviour = batch["behaviour_logp"][0, 1:][mask].double()
            diff = (trainer - behaviour).abs().tolist()
            weight = torch.exp(trainer - behaviour).tolist()
            for bucket in (by_kind.setdefault(kind_of(seq), ([], [])), everything):
                bucket[0].extend(diff)
                bucket[1].extend(weight)
        rows = {k: stats(d, w, args.cap) for k, (d, w) in sorted(by_kind.items())}
        rows["all"] = stats(*everything, args.cap)
        print(f"\nSGLang 0.5.23 (CPU, float32) vs transformers, {Path(model).name}, τ = {args.temperature}; weight = "
              f"π_train / π_behav per sampled token, cap {args.cap:g}\n")
        print("| turns | tokens | max | mean | p99 | weight > cap | weight < 1/cap | mean weight |")
        print("|---|---|---|---|---|---|---|---|")
        for k, r in rows.items():
            print(f"| {k} | {r['tokens']} | {r['max']:.2e} | {r['mean']:.2e} | {r['p99']:.2e} | "
                  f"{100 * r['capped']:.2f}% | {100 * r['below_1_over_cap']:.2f}% | {r['mean_weight']:.4f} |")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    finally:
        if server is not None:
            server.close()


if __name__ == "__main__":
    main()
