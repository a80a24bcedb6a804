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
mean. A second table gives the trainer's ``mismatch/*`` metrics on the same tokens
(:func:`paravt_train.rl.objective.mismatch_sums`: KL(π_rollout ‖ π_train) by k1 and k3, χ², the share past the
rollout correction's threshold ``--threshold`` (2) or below its inverse, the PPL ratio per sequence).
``--dtype bfloat16`` serves with SGLang's ``--dtype bfloat16`` and scores under the trainer's bf16 autocast
(``bf16: true``, as on a GPU); ``float32`` (default) both in float32. ``--json`` writes the numbers.
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


def stats(diffs, weights, cap: float, sums: list[dict]) -> dict:
    import torch

    d = torch.tensor(diffs, dtype=torch.float64)
    w = torch.tensor(weights, dtype=torch.float64)
    n, rows = sum(x["n"] for x in sums), sum(x["rows"] for x in sums)
    return {"tokens": len(diffs), "max": float(d.max()), "mean": float(d.mean()),
            "p99": float(torch.quantile(d, 0.99)), "capped": float((w > cap).double().mean()),
            "below_1_over_cap": float((w < 1 / cap).double().mean()), "mean_weight": float(w.mean()),
            # the trainer's mismatch/* metrics (the same function), over these tokens
            "kl_k1": sum(x["k1"] for x in sums) / n, "kl_k3": sum(x["k3"] for x in sums) / n,
            "chi2": sum(x["chi2"] for x in sums) / n, "past_threshold": sum(x["past"] for x in sums) / n,
            "ppl_ratio": sum(x["ppl_ratio"] for x in sums) / max(rows, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="The policy (default: the shipped toy policy).")
    ap.add_argument("--endpoint", default=None, help="A running SGLang server of --model (default: start one).")
    ap.add_argument("--worlds", type=int, default=6, help="Toy worlds (3 questions each: MCQ, open, grounding).")
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--cap", type=float, default=5.0)
    ap.add_argument("--threshold", type=float, default=2.0, help="The rollout correction's threshold C.")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="The server's --dtype and the trainer's autocast (bf16: true).")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    from paravt_train.data import prompts_from_rl, write_parquet
    from paravt_train.rl.config import GRPOConfig
    from paravt_train.rl.objective import mismatch_sums
    from paravt_train.rl.scoring import collate, token_logprobs
    from paravt_train.rl.trainer import GRPOTrainer
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
        server = SGLangServer(model, tmp / "logs", extra=["--dtype", args.dtype])
        print(f"SGLang {server.url} ready in {time.time() - t0:.0f} s", flush=True)
        endpoint = server.url
    else:
        endpoint = args.endpoint
    try:
        worlds = make_worlds(range(930_000, 930_000 + args.worlds), tmp / "videos")
        data = write_parquet(rl_rows(worlds, tmp / "videos"), tmp / "rl.parquet")
        cfg = GRPOConfig(model=model, data=str(data), video_root=str(tmp / "videos"), output_dir=str(tmp / "run"),
                         backend="sglang", endpoint=endpoint, sync={"via": "tensor"}, group_size=args.group,
                         temperature=args.temperature, prompts_per_step=1, concurrency=4, gating=False,
                         bf16="true" if args.dtype == "bfloat16" else "false")
        tr = GRPOTrainer(cfg, progress=False, log=lambda *_: None)
        tr.setup()  # pushes the model's weights (version "0"): the server serves exactly what is scored
        prompts = prompts_from_rl(str(data), str(tmp / "videos"))
        t0 = time.time()
        groups = tr.rollout(prompts)
        seqs = [s for g in groups for e in g if not e.failed for s in e.sequences]
        seqs += text_only_turns(tr, prompts, args.group, args.temperature)
        print(f"{len(prompts)} prompts x G = {args.group}: {len(seqs)} sequences in {time.time() - t0:.0f} s",
              flush=True)
        by_kind: dict[str, tuple[list, list, list]] = {}
        everything: tuple[list, list, list] = ([], [], [])
        tr.model.eval()
        for seq in seqs:
            batch = collate([seq], tr.chat)
            with torch.no_grad(), tr.update.autocast():  # scored as the update scores (bf16: under autocast)
                lp, _ = token_logprobs(tr.model, batch, args.temperature)
            mask = batch["loss_mask"][0, 1:] > 0
            trainer = lp[0][mask].double()
            behaviour = batch["behaviour_logp"][0, 1:][mask].double()
            diff = (trainer - behaviour).abs().tolist()
            weight = torch.exp(trainer - behaviour).tolist()
            sums = mismatch_sums((trainer - behaviour)[None].float(), torch.ones(1, len(trainer)), args.threshold)
            for bucket in (by_kind.setdefault(kind_of(seq), ([], [], [])), everything):
                bucket[0].extend(diff)
                bucket[1].extend(weight)
                bucket[2].append(sums)
        rows = {k: stats(d, w, args.cap, m) for k, (d, w, m) in sorted(by_kind.items())}
        rows["all"] = stats(*everything[:2], args.cap, everything[2])
        print(f"\nSGLang 0.5.23 (CPU, {args.dtype}) vs transformers ({args.dtype}), {Path(model).name}, "
              f"τ = {args.temperature}; weight = π_train / π_behav per sampled token, cap {args.cap:g}\n")
        print("| turns | tokens | max | mean | p99 | weight > cap | weight < 1/cap | mean weight |")
        print("|---|---|---|---|---|---|---|---|")
        for k, r in rows.items():
            print(f"| {k} | {r['tokens']} | {r['max']:.2e} | {r['mean']:.2e} | {r['p99']:.2e} | "
                  f"{100 * r['capped']:.2f}% | {100 * r['below_1_over_cap']:.2f}% | {r['mean_weight']:.4f} |")
        print(f"\nThe trainer's mismatch/* metrics on these tokens (threshold C = {args.threshold:g})\n")
        print("| turns | KL k1 | KL k3 | χ² | past C or 1/C | PPL ratio (train / rollout) |")
        print("|---|---|---|---|---|---|")
        for k, r in rows.items():
            print(f"| {k} | {r['kl_k1']:.2e} | {r['kl_k3']:.2e} | {r['chi2']:.2e} | {100 * r['past_threshold']:.3f}% | "
                  f"{r['ppl_ratio']:.6f} |")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    finally:
        if server is not None:
            server.close()


if __name__ == "__main__":
    main()
