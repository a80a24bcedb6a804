"""The metrics of one GRPO step, gathered over every rank: one line of ``metrics.jsonl``.

Rewards and their terms, f_τ (format reward / its maximum), κ (tool calls per rollout), per-tag closure
rates and accuracy per task (paper, Tables 2 and 5), nFrames, zero-variance and failed counts, the update's
statistics (KL, clip fraction, dual-clip fraction, entropy, ``grad_norm`` as the mean over the optimizer steps and
``grad_norm_max``, tokens) and the train–inference mismatch on every on-policy token (``logprob_mismatch``, and
``mismatch/kl_k1``, ``kl_k3``, ``chi2``, ``past_threshold``, ``ppl_ratio``, ``log_ratio_max``, ``uncertainty`` (the
sampled tokens' mean 1 − p: how far logit rounding can move their logprobs), with what the
rollout correction did: ``mismatch/truncated``, ``mismatch/rejected``: each the sum over every rank's tokens over
every rank's count of what it is a mean of (the on-policy tokens, the sequences, the corrected tokens), maxima by
their maximum) and ``mini_batches``, the optimizer steps a pass took. Episodes that failed for
the infrastructure's reasons (an endpoint down, a lost tool slot, an unreadable video) are counted in
``failed_episodes`` and kept out of the model-behaviour metrics (reward, f_τ, κ, closure, accuracy): an outage
must not read as format drift.
"""

from __future__ import annotations

import torch

from paravt_train.rewards import rollout_metrics

__all__ = ["episode_record", "merge_mismatch_sums", "merge_shards", "merge_stats", "mismatch_means", "staleness",
           "step_metrics", "weight_quantiles", "weight_sketch"]

SKETCH_POINTS = 2048  # order statistics a rank keeps of its behaviour weights: quantiles within 1/2048 in rank
QUANTILES = (0.1, 0.5, 0.9)


def episode_record(e) -> dict:
    """What the step's metrics need of one episode (small and picklable: gathered over the ranks)."""
    return {"prompt": e.prompt_id, "task": e.task, "text": e.text, "reward": e.reward.total,
            "terms": e.reward.terms(), "degenerate": e.reward.degenerate, "n_frames": e.n_frames or 0,
            "failed": e.failed is not None, "failure": e.failed, "subagent_errors": e.subagent_errors,
            "retokenized": e.retokenized_turns, "round_trip": e.round_trip_turns, "versions": e.versions,
            "tool_calls": valid_calls(e)}


def valid_calls(e) -> int:
    """The valid tool calls an episode made, from its trace (every turn and collaborating agent; a call the model
    wrote wrong is not one, a call the runtime failed is)."""
    if e.answer is None:
        return 0
    return sum(1 for c in e.answer.trace.all_calls() if not (c.error and not c.runtime_error))


def step_metrics(step: int, groups, all_groups, prompts, stats: dict, replayed: int, cfg, world: int = 1) -> dict:
    """The step's metrics over every rank's episodes (every rank must call it: it gathers)."""
    mine = [episode_record(e) for g in groups for e in g]
    zero = sum(1 for g in all_groups if len({round(e.reward.total, 9) for e in g}) == 1)
    eps = mine
    stats = dict(stats)
    sketch = stats.pop("behaviour_weight_sketch", None)  # decoupled PPO: the weights' distribution
    sums = stats.pop("mismatch_sums", None)  # the mismatch's sums: means over every rank's own counts
    shared = {"zero": zero, "groups": len(all_groups), "stats": stats, "prompts": [p.id for p in prompts],
              "sketches": [sketch] if sketch is not None else [], "sums": [sums] if sums is not None else []}
    if world > 1:
        import torch.distributed as dist

        gathered: list = [None] * world
        dist.all_gather_object(gathered, (mine, shared))
        eps = [e for m, _ in gathered for e in m]
        shared = merge_shards([s for _, s in gathered])
    ok = [e for e in eps if not e["failed"]]  # what the model did; the infrastructure's failures apart
    n = max(len(ok), 1)
    m = rollout_metrics([e["text"] for e in ok], [e["task"] for e in ok], [e["terms"]["acc"] for e in ok], cfg.reward,
                        tool_calls=[e["tool_calls"] for e in ok])
    rewards = torch.tensor([e["reward"] for e in ok]) if ok else torch.zeros(1)
    terms = {f"reward/{k}": sum(e["terms"].get(k, 0.0) for e in ok) / n for k in (ok[0]["terms"] if ok else {})}
    return {
        "step": step,
        "prompts": shared["prompts"],
        "reward": float(rewards.mean()),
        "reward_std": float(rewards.std(unbiased=False)),
        **terms,
        "degenerate": sum(e["degenerate"] for e in ok) / n,
        "f_tau": m.get("format_reward", 0.0),
        "kappa": m.get("tool_calls_per_rollout", 0.0),
        **{k: v for k, v in m.items() if k.startswith(("closure/", "accuracy", "tool_call_rate"))},
        "n_frames": sum(e["n_frames"] for e in ok) / n,
        "zero_std_groups": shared["zero"],
        "groups": shared["groups"],
        "episodes": len(eps),
        "failed_episodes": len(eps) - len(ok),
        "failures": sorted({e["failure"] for e in eps if e["failed"]})[:5],  # why (the first few, by text)
        "subagent_errors": sum(e["subagent_errors"] for e in eps),
        "retokenized_turns": sum(e["retokenized"] for e in eps),
        # model calls whose prompt ids the server did not report (emulated round trip: SGLang < 0.5.19)
        "round_trip_turns": sum(e["round_trip"] for e in eps),
        **staleness(ok, step - 1),
        "replayed": replayed,
        **shared["stats"],
        **(weight_quantiles(shared["sketches"]) if shared["sketches"] else {}),
    }


def merge_shards(shards: list[dict]) -> dict:
    """What every rank shares of its step (group counts, prompts, update statistics, sketches, mismatch sums) as one:
    the update statistics by :func:`merge_stats`, then the mismatch's means from the summed sums (each over its own
    count: on-policy tokens, sequences, corrected tokens — not over the ranks' trained tokens)."""
    out = {"zero": sum(s["zero"] for s in shards), "groups": sum(s["groups"] for s in shards),
           "prompts": [p for s in shards for p in s["prompts"]], "stats": merge_stats([s["stats"] for s in shards]),
           "sketches": [k for s in shards for k in s["sketches"]], "sums": [k for s in shards for k in s["sums"]]}
    if out["sums"]:
        out["stats"].update(mismatch_means(merge_mismatch_sums(out["sums"])))
    return out


def merge_stats(stats: list[dict]) -> dict:
    """Update statistics of every rank: sums of counts, token-weighted means of the rest."""
    out = {}
    keys = list(dict.fromkeys(k for s in stats for k in s))  # a rank without stale rows has no behaviour keys
    for key in keys:
        have = [s for s in stats if key in s]
        if isinstance(have[0][key], dict):  # sketches and sums: merged by their own rule (merge_shards)
            continue
        if key in ("sequences", "trained_tokens", "stale_tokens"):
            out[key] = sum(s[key] for s in have)
        elif key == "mini_batches":  # the same on every rank (planned from the busiest rank's items)
            out[key] = max(s[key] for s in have)
        elif key in ("grad_norm", "loss"):
            out[key] = have[0][key] if key == "grad_norm" else sum(s[key] for s in have)
        elif key.endswith("_max"):
            out[key] = max(s[key] for s in have)
        else:
            out[key] = sum(s[key] * s.get("trained_tokens", 0) for s in have) / (
                sum(s.get("trained_tokens", 0) for s in have) or 1)
    return out


def staleness(eps: list[dict], version: int) -> dict:
    """How many policy versions behind the update (at ``version``) each episode's oldest token was: the
    histogram, the mean and the partial rollouts (an update landed mid-episode); empty for backends that report
    no versions."""
    gaps = [version - min(e["versions"]) for e in eps if e.get("versions")]
    if not gaps:
        return {}
    hist: dict[str, int] = {}
    for g in gaps:
        hist[str(g)] = hist.get(str(g), 0) + 1
    return {"staleness": sum(gaps) / len(gaps), "staleness_hist": dict(sorted(hist.items())),
            "partial_rollouts": sum(len(e["versions"]) > 1 for e in eps if e.get("versions"))}


def weight_sketch(values: torch.Tensor, points: int = SKETCH_POINTS) -> dict:
    """What a rank sends of its tokens' behaviour weights (π_prox / π_behav): all of them, sorted, when there are
    at most ``points``; else ``points`` evenly spaced order statistics (each the middle of an equal share of the
    tokens). Small to gather, and quantiles of the merged sketches are within 1/``points`` in rank."""
    v = torch.sort(values.detach().flatten().float().cpu()).values
    n = len(v)
    if n > points:
        v = v[((torch.arange(points, dtype=torch.float64) + 0.5) * n / points).long().clamp(max=n - 1)]
    return {"values": v.tolist(), "n": n}


def weight_quantiles(sketches: list[dict], qs: tuple[float, ...] = QUANTILES) -> dict:
    """``behaviour_weight_p10``/``p50``/``p90`` of every rank's tokens, from their sketches: the nearest-rank
    quantile (the smallest weight with at least a share q of the tokens at or below it), each sketched value
    standing for its share of its rank's tokens. Empty when no token was weighted."""
    pairs = sorted((x, s["n"] / len(s["values"])) for s in sketches if s["values"] for x in s["values"])
    total = sum(c for _, c in pairs)
    if not pairs:
        return {}
    out = {}
    for q in qs:
        acc, pick = 0.0, pairs[-1][0]
        for x, c in pairs:
            acc += c
            if acc >= q * total - 1e-9 * total:
                pick = x
                break
        out[f"behaviour_weight_p{round(100 * q):02d}"] = pick
    return out


def merge_mismatch_sums(parts: list[dict]) -> dict:
    """Every rank's mismatch sums (``PolicyUpdate._mismatch_sums``) as one: sums added, the maximum kept."""
    out: dict = {}
    for part in parts:
        for key, value in part.items():
            out[key] = max(out.get(key, 0.0), value) if key == "abs_max" else out.get(key, 0.0) + value
    return out


def mismatch_means(sums: dict) -> dict:
    """``logprob_mismatch`` (mean |Δ logprob| over the on-policy tokens) and ``mismatch/*`` from their sums: KL k1,
    k3, χ² and the share past the threshold over the on-policy tokens, the PPL ratio over the sequences, what the
    rollout correction did over the tokens it applied to. Empty of ``mismatch/*`` when no token was on-policy."""
    out = {"logprob_mismatch": sums.get("abs_diff", 0.0) / max(sums.get("on_n", 0.0), 1.0)}
    n = sums.get("n", 0.0)
    if not n:
        return out
    out.update({"mismatch/kl_k1": sums["k1"] / n, "mismatch/kl_k3": sums["k3"] / n, "mismatch/chi2": sums["chi2"] / n,
                "mismatch/past_threshold": sums["past"] / n,
                "mismatch/ppl_ratio": sums["ppl_ratio"] / max(sums["rows"], 1.0),
                "mismatch/log_ratio_max": sums["abs_max"], "mismatch/uncertainty": sums.get("uncertainty", 0.0) / n})
    if sums.get("corrections"):  # the rollout correction acted on some rows of the current version
        m = max(sums["corrected_n"], 1.0)
        out["mismatch/rejected"] = sums["rejected"] / m
        out["mismatch/truncated"] = sums["truncated"] / m
    return out
