"""The train–inference mismatch, the mini-batches and the trust region of the update (issue 57), on real rollouts of
the shipped toy policy where the update is the point and by hand where the arithmetic is: behaviour logprobs
perturbed on chosen tokens truncated or masked as configured (masked tokens out of the loss's denominator too) and
measured; mini-batches by a seeded shuffle, not by length; dual-clip; batch-level advantage normalisation."""

from __future__ import annotations

import math

import pytest
import torch

from paravt_train.data import prompts_from_rl
from paravt_train.rl.config import GRPOConfig
from paravt_train.rl.metrics import merge_shards, merge_stats, mismatch_means
from paravt_train.rl.objective import batch_normalised, policy_loss, rollout_correction, token_scales
from paravt_train.rl.rollout import TokenSequence
from paravt_train.rl.trainer import GRPOTrainer
from paravt_train.rl.update import UpdateItem, mini_batch_assignment, sampled_by_older

LOG10 = math.log(10.0)


@pytest.fixture(scope="module")
def rolled(toy_policy_dir, toy_rl, tmp_path_factory):
    """A trainer on the shipped toy policy (in-process rollouts: behaviour logprobs = the trainer's, to ~1e-6 in
    float32) and one step's real sequences."""
    cfg = GRPOConfig(model=toy_policy_dir, data=toy_rl["data"], video_root=toy_rl["video_root"],
                     output_dir=str(tmp_path_factory.mktemp("mismatch")), steps=1, prompts_per_step=2, group_size=2,
                     max_new_tokens=96, subagent_max_new_tokens=40, temperature=1.2, lr=1e-3, concurrency=2,
                     micro_batch_size=2, bf16="false")
    tr = GRPOTrainer(cfg, progress=False)
    tr.setup()
    groups = tr.rollout(tr.prompts_for(0, prompts_from_rl(toy_rl["data"], toy_rl["video_root"])))
    seqs = [s for g in groups for e in g for s in e.sequences]
    return tr, seqs


def _perturbed(seq: TokenSequence, up: list[int], down: list[int]) -> TokenSequence:
    """``seq`` with its behaviour logprobs lowered by log 10 at the sampled positions ``up`` (w = π_train / π_rollout
    ≈ 10) and raised by log 10 at ``down`` (w ≈ 0.1)."""
    lps = list(seq.logprobs)
    for i in up:
        lps[i] -= LOG10
    for i in down:
        lps[i] += LOG10
    return TokenSequence(role=seq.role, input_ids=seq.input_ids, loss_mask=seq.loss_mask, logprobs=lps,
                         images=seq.images, turn=seq.turn, index=seq.index, episode=seq.episode,
                         image_grid_thw=seq.image_grid_thw)


def _plan(tr, items, **settings):
    cfg = tr.policy_update.cfg
    tr.policy_update.cfg = cfg.model_copy(update=settings)
    try:
        return tr.policy_update.plan(items)[0], tr.policy_update
    finally:
        tr.policy_update.cfg = cfg


def test_perturbed_behaviour_logprobs_are_truncated_or_masked_and_measured(rolled):
    """Three sampled tokens of one sequence whose rollout logprob is off by log 10 (w ≈ 10 > C = 2) and one off the
    other way (w ≈ 0.1): token-truncate holds the three at 2, token-mask takes them out of the loss mask and the
    episode's token count (the denominator), the sequence modes act on the whole row; every other token keeps
    w ≈ 1. The mismatch metrics are ~0 without the perturbation and show it with."""
    tr, seqs = rolled
    target = max(seqs, key=lambda s: s.n_trained)
    sampled = [i for i, m in enumerate(target.loss_mask) if m]
    up, down = sampled[1:4], sampled[5:6]
    bad = _perturbed(target, up, down)
    others = [s for s in seqs if s is not target][:3]
    items = [UpdateItem(sequence=s, advantage=1.0) for s in [bad, *others]]
    clean = [UpdateItem(sequence=s, advantage=1.0) for s in [target, *others]]

    def row_of(batches):
        for b in batches:
            for i, e in enumerate(b.episodes):
                n = len(target.input_ids)
                if e == target.episode and int(b.tensors["attention_mask"][i].sum()) == n and torch.equal(
                        b.tensors["input_ids"][i, :n].cpu(), torch.tensor(target.input_ids)):
                    return b, i
        raise AssertionError("the perturbed sequence is in no micro-batch")

    pos_up = [p - 1 for p in up]  # weights and masks are over positions 1..T (the predicted token)
    pos_down = [p - 1 for p in down]

    # token-truncate (the default): the three at C exactly, the low one at its weight, the rest ≈ 1
    batches, upd = _plan(tr, items)
    b, i = row_of(batches)
    w = b.token_weights[i]
    assert w[pos_up].tolist() == pytest.approx([2.0] * 3)
    assert float(w[pos_down[0]]) == pytest.approx(0.1, rel=1e-3)
    rest = [p - 1 for p in sampled if p not in up + down]
    assert float((w[rest] - 1).abs().max()) < 1e-3
    assert int(b.mask[i].sum()) == target.n_trained - (target.loss_mask[0] or 0)  # nothing rejected
    stats = upd._mismatch_stats(batches)
    n = sum(s.n_trained for s in [target, *others])
    assert stats["mismatch/truncated"] == pytest.approx(3 / n)
    assert stats["mismatch/past_threshold"] == pytest.approx(4 / n)  # w > 2 or w < 1/2
    k3 = 3 * (10 - 1 - LOG10) + (0.1 - 1 + LOG10)  # Σ w − 1 − log w over the perturbed tokens
    assert stats["mismatch/kl_k3"] == pytest.approx(k3 / n, rel=1e-2)
    assert stats["mismatch/kl_k1"] == pytest.approx(-2 * LOG10 / n, abs=1e-3)  # Σ −log w = −3 log 10 + log 10
    assert stats["mismatch/chi2"] == pytest.approx((3 * 99 + (0.01 - 1)) / n, rel=1e-2)
    # PPL_train / PPL_rollout per sequence, then the mean: the perturbed row's is e^{−2 log 10 / its tokens}
    want_ppl = (math.exp(-2 * LOG10 / target.n_trained) + len(others)) / (1 + len(others))
    assert stats["mismatch/ppl_ratio"] == pytest.approx(want_ppl, rel=1e-3) and want_ppl < 1
    assert stats["mismatch/log_ratio_max"] == pytest.approx(LOG10, rel=1e-3)
    clean_stats = upd._mismatch_stats(_plan(tr, clean)[0])
    assert clean_stats["mismatch/kl_k3"] < 1e-8 and clean_stats["mismatch/past_threshold"] == 0.0
    assert abs(clean_stats["mismatch/ppl_ratio"] - 1) < 1e-4 and clean_stats["mismatch/truncated"] == 0.0

    # token-mask: the three leave the loss mask and the denominator (seq-mean: the episode's token count)
    batches, upd = _plan(tr, items, rollout_correction="token-mask")
    b, i = row_of(batches)
    assert b.mask[i][pos_up].tolist() == [0.0, 0.0, 0.0] and float(b.mask[i][pos_down[0]]) == 1.0
    assert float(b.token_weights[i][pos_down[0]]) == pytest.approx(0.1, rel=1e-3)  # rejected above C only
    per_episode: dict[str, int] = {}
    for s in [target, *others]:
        per_episode[s.episode] = per_episode.get(s.episode, 0) + s.n_trained
    kept = dict(per_episode)
    kept[target.episode] -= 3
    want = token_scales([target.episode], [kept[target.episode]], "seq-mean",
                        totals=(len(per_episode), float(sum(kept.values()))))[0]
    assert float(b.scales[i]) == pytest.approx(want)
    unmasked = token_scales([target.episode], [per_episode[target.episode]], "seq-mean",
                            totals=(len(per_episode), float(sum(per_episode.values()))))[0]
    assert want != pytest.approx(unmasked)  # the old denominator would count the rejected tokens
    assert upd._mismatch_stats(batches)["mismatch/rejected"] == pytest.approx(3 / n)
    # token-mean: 1 / (every trained token of the batch minus the rejected ones)
    batches, _ = _plan(tr, items, rollout_correction="token-mask", aggregation="token-mean")
    b, i = row_of(batches)
    assert float(b.scales[i]) == pytest.approx(1.0 / (n - 3))

    # sequence modes, the geometric mean (ms-swift's): the row's weight exp(Σ log w / L) = 10^(2 / L), under C for a
    # row of L > 6 tokens: nothing truncated, nothing rejected; every token weighted by it
    batches, _ = _plan(tr, items, rollout_correction="sequence-truncate")
    b, i = row_of(batches)
    L = int(b.mask[i].sum())
    assert L > 6 and b.token_weights[i][b.mask[i] > 0].tolist() == pytest.approx([10 ** (2 / L)] * L, rel=1e-3)
    batches, _ = _plan(tr, items, rollout_correction="sequence-mask")
    b, i = row_of(batches)
    assert float(b.mask[i].sum()) == L
    # the product (TRL's): Π w = 10³ · 0.1 = 100 > C: truncated to 2 whole, or rejected whole
    batches, _ = _plan(tr, items, rollout_correction="sequence-product-truncate")
    b, i = row_of(batches)
    assert b.token_weights[i][b.mask[i] > 0].tolist() == pytest.approx([2.0] * int(b.mask[i].sum()))
    batches, upd = _plan(tr, items, rollout_correction="sequence-product-mask")
    b, i = row_of(batches)
    assert float(b.mask[i].sum()) == 0.0
    for b2 in batches:  # the other sequences keep all their tokens, at w ≈ 1
        for j in range(len(b2.episodes)):
            if b2 is b and j == i:
                continue
            assert float((b2.token_weights[j][b2.mask[j] > 0] - 1).abs().max()) < 1e-3

    # off: no weights at all, nothing rejected, the mismatch still measured
    batches, upd = _plan(tr, items, rollout_correction="off")
    assert all(b.token_weights is None for b in batches)
    off_stats = upd._mismatch_stats(batches)
    assert off_stats["mismatch/kl_k3"] == pytest.approx(k3 / n, rel=1e-2) and "mismatch/rejected" not in off_stats


def test_rollout_correction_by_hand():
    """The seven modes on two rows (log-ratios 0, log 3, −log 3, 0.1; 0.2, 0.3, 0.4 and one token off the mask):
    the sequence modes by the geometric mean (row means 0.025 and 0.3) and by the product (sums 0.1 and 0.9)."""
    lr = torch.tensor([[0.0, math.log(3), -math.log(3), 0.1], [0.2, 0.3, 0.4, 5.0]])
    m = torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 0]])
    w, out = rollout_correction(lr, m, "token-truncate", 2.0)
    assert w[0].tolist() == pytest.approx([1.0, 2.0, 1 / 3, math.exp(0.1)]) and not out.any()
    w, out = rollout_correction(lr, m, "token-mask", 2.0)
    assert out.tolist() == [[False, True, False, False], [False] * 4] and float(w[0, 1]) == 0.0
    w, out = rollout_correction(lr, m, "sequence-truncate", 2.0)  # geometric: e^0.025 and e^0.3 = 1.35 < 2
    assert w[0].tolist() == pytest.approx([math.exp(0.025)] * 4) and w[1, :3].tolist() == pytest.approx(
        [math.exp(0.3)] * 3) and not out.any()
    assert float(w[1, 3]) == 1.0  # off the mask: neither weighted nor counted in the row's mean
    w, out = rollout_correction(lr, m, "sequence-mask", 1.3)  # e^0.3 > 1.3: the second row whole
    assert out.tolist() == [[False] * 4, [True, True, True, False]]
    w, out = rollout_correction(lr, m, "sequence-product-truncate", 2.0)  # e^0.1 and e^0.9 = 2.46 → 2
    assert w[0].tolist() == pytest.approx([math.exp(0.1)] * 4) and w[1, :3].tolist() == pytest.approx([2.0] * 3)
    w, out = rollout_correction(lr, m, "sequence-product-mask", 2.0)
    assert out.tolist() == [[False] * 4, [True, True, True, False]]
    w, out = rollout_correction(lr, m, "off", 2.0)
    assert bool((w == 1).all()) and not out.any()
    with pytest.raises(ValueError, match="rollout correction"):
        rollout_correction(lr, m, "token", 2.0)


def test_mini_batches_are_a_seeded_shuffle_not_cut_by_length(rolled):
    """Several mini-batches: each one's sequences are a shuffle's draw (not the longest first, then the next
    longest), the same plan for the same seed and step (every rank, a resumed run), another plan the next step;
    longest first inside a mini-batch. One mini-batch: the global longest-first order, as before."""
    tr, seqs = rolled
    seqs = sorted(seqs, key=lambda s: -len(s.input_ids))[:8]
    items = [UpdateItem(sequence=s, advantage=1.0) for s in seqs]
    cfg = tr.policy_update.cfg
    tr.policy_update.cfg = cfg.model_copy(update={"mini_batches": 4, "micro_batch_size": 1})
    try:
        def composition(step):
            batches = tr.policy_update.plan(items, step)[0]
            minis: dict[int, list[int]] = {}
            for b in batches:
                minis.setdefault(b.mini, []).append(int(b.tensors["attention_mask"][0].sum()))
            return [minis[j] for j in sorted(minis)]

        plans = {step: composition(step) for step in (0, 1, 2)}
    finally:
        tr.policy_update.cfg = cfg
    for plan in plans.values():
        assert len(plan) == 4 and sorted(x for m in plan for x in m) == sorted(len(s.input_ids) for s in seqs)
        assert all(m == sorted(m, reverse=True) for m in plan)  # longest first inside a mini-batch
    monotone = [all(min(a) >= max(b) for a, b in zip(plan, plan[1:], strict=False)) for plan in plans.values()]
    assert not all(monotone)  # the old cut: mini-batch j held the j-th longest quarter, every step
    assert plans[0] != plans[1] or plans[1] != plans[2]  # another shuffle each step
    # the assignment is a function of (seed, step) alone: every rank computes the same one
    assert mini_batch_assignment(8, 4, 0, 1) == mini_batch_assignment(8, 4, 0, 1)
    assert mini_batch_assignment(8, 4, 0, 1) != mini_batch_assignment(8, 4, 0, 2)
    assert mini_batch_assignment(8, 4, 0, 1) != mini_batch_assignment(8, 4, 1, 1)
    assert sorted(mini_batch_assignment(10, 4, 0, 3)) == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3]  # sizes differ by ≤ 1
    assert mini_batch_assignment(5, 1, 0, 3) == [0] * 5
    one = tr.policy_update.plan(items)[0]  # one mini-batch: longest first over the whole batch
    lengths = [int(b.tensors["attention_mask"][i].sum()) for b in one for i in range(len(b.episodes))]
    assert lengths == sorted(lengths, reverse=True)


def test_grad_norm_is_the_mean_and_max_over_mini_batches(toy_policy_dir, toy_rl, tmp_path):
    """Two mini-batches: ``grad_norm`` is their mean and ``grad_norm_max`` the larger (before: the last one's);
    ranks merge ``grad_norm_max`` by its maximum."""
    cfg = GRPOConfig(model=toy_policy_dir, data=toy_rl["data"], video_root=toy_rl["video_root"],
                     output_dir=str(tmp_path), steps=1, prompts_per_step=2, group_size=2, max_new_tokens=64,
                     subagent_max_new_tokens=24, temperature=1.2, lr=1e-3, concurrency=2, micro_batch_size=2,
                     mini_batches=2, bf16="false", kl_coef=0.0)
    tr = GRPOTrainer(cfg, progress=False)
    tr.setup()
    groups = tr.rollout(tr.prompts_for(0, prompts_from_rl(toy_rl["data"], toy_rl["video_root"])))
    seqs = [s for g in groups for e in g for s in e.sequences][:6]
    items = [UpdateItem(sequence=s, advantage=(1.0 if k % 2 else -0.7)) for k, s in enumerate(seqs)]
    norms = []
    import paravt_train.rl.update as upd

    clip = upd.clip_grad_norm

    def spy(params, max_norm):
        norms.append(float(clip(params, max_norm)))
        return norms[-1]

    upd.clip_grad_norm = spy
    try:
        stats = tr.policy_update(items, 0)
    finally:
        upd.clip_grad_norm = clip
    assert len(norms) == 2 and norms[0] != pytest.approx(norms[1])
    assert stats["grad_norm"] == pytest.approx(sum(norms) / 2) and stats["grad_norm_max"] == pytest.approx(max(norms))
    merged = merge_stats([{**stats, "grad_norm_max": 1.0}, {**stats, "grad_norm_max": 7.0}])
    assert merged["grad_norm_max"] == 7.0 and merged["grad_norm"] == stats["grad_norm"]


def test_dual_clip_caps_the_loss_of_negative_advantages():
    """A token with A < 0 whose ratio reached 5: PPO's clip leaves its loss at 5|A| (and its gradient); dual-clip
    with c = 3 caps it at 3|A| with no gradient. A > 0 and ratios under c are untouched."""
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[5.0, 2.0, 5.0]])).requires_grad_(True)
    mask = torch.ones(1, 3)
    for adv, want_plain, want_dual in ((-1.0, 5 + 2 + 5, 3 + 2 + 3), (1.0, -(1.2 * 3), -(1.2 * 3))):
        plain = policy_loss(logp, old, torch.tensor([adv]), mask, kl_coef=0.0, scales=torch.tensor([1.0]))
        dual = policy_loss(logp, old, torch.tensor([adv]), mask, kl_coef=0.0, scales=torch.tensor([1.0]),
                           dual_clip=3.0)
        assert float(plain.loss.detach()) == pytest.approx(want_plain, rel=1e-5)
        assert float(dual.loss.detach()) == pytest.approx(want_dual, rel=1e-5)
        if adv < 0:
            (g,) = torch.autograd.grad(dual.loss, logp)
            assert g[0].tolist() == pytest.approx([0.0, 2.0, 0.0], abs=1e-5)  # the capped tokens give none
            assert dual.dual_clip_fraction == pytest.approx(2 / 3)
        else:
            assert dual.dual_clip_fraction == 0.0
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(logp, old, torch.tensor([-1.0]), mask, kl_coef=0.0, dual_clip=1.0)
    assert GRPOConfig(model="m").dual_clip == 3.0 and GRPOConfig(model="m", dual_clip=None).dual_clip is None


def test_batch_level_advantage_normalisation(rolled):
    """``advantage_batch_norm``: minus the mean over the batch's trained tokens, over their (unbiased) std — a
    sequence of n tokens counts n times, as AReaL's adv_norm does under the loss mask; off by default."""
    got = batch_normalised([1.0, -1.0], [3, 1])
    toks = torch.tensor([1.0, 1.0, 1.0, -1.0])
    mean, std = float(toks.mean()), float(toks.std(unbiased=True))
    assert got == pytest.approx([(1 - mean) / std, (-1 - mean) / std], rel=1e-5)
    assert batch_normalised([0.5], [1]) == [0.5]  # one token: nothing to normalise by
    tr, seqs = rolled
    items = [UpdateItem(sequence=s, advantage=a) for s, a in zip(seqs[:3], (1.0, -0.5, 0.25), strict=False)]
    assert not GRPOConfig(model="m").advantage_batch_norm
    plain, _ = _plan(tr, items)
    normed, _ = _plan(tr, items, advantage_batch_norm=True)
    want = batch_normalised([it.advantage for it in items], [it.sequence.n_trained for it in items], 1e-6)
    by_len = sorted(range(len(items)), key=lambda k: (-len(items[k].sequence.input_ids), k))  # the plan's order
    assert torch.cat([b.advantages for b in normed]).tolist() == pytest.approx([want[k] for k in by_len], rel=1e-5)
    assert torch.cat([b.advantages for b in plain]).tolist() == pytest.approx([items[k].advantage for k in by_len])


def test_with_eta_only_rows_of_an_older_version_take_the_behaviour_weight(rolled):
    """η > 0: a row the current weights sampled keeps the configured rollout correction (token-truncate: its
    perturbed tokens held at C = 2); a row of an older version takes decoupled PPO's cap (token-mask at 5: its w = 10
    tokens rejected). Before, every row took the cap under η > 0, fresh ones included. The trainer's rule:
    a reported version other than the step's is older; no version reported is older only under η > 0."""
    tr, seqs = rolled
    target = next(s for s in seqs if s.role == "planner" and s.n_trained >= 8)
    pos = [i for i, m in enumerate(target.loss_mask) if m][1:4]
    fresh, old = _perturbed(target, pos, []), _perturbed(target, pos, [])
    items = [UpdateItem(sequence=fresh, advantage=1.0), UpdateItem(sequence=old, advantage=1.0, stale=True)]
    batches, upd = _plan(tr, items, max_staleness=1, micro_batch_size=2)
    (b,) = batches
    at = [p - 1 for p in pos]  # token t is scored at position t - 1
    w = b.token_weights
    assert w[0][at].tolist() == pytest.approx([2.0] * 3)  # fresh: truncated at C, kept in the loss
    assert float(b.mask[0][at].sum()) == 3.0
    assert float(b.mask[1][at].sum()) == 0.0 and b.behaviour["capped"] == 3.0  # older: past the cap, left out
    assert sampled_by_older([3], 3, 1) is False and sampled_by_older([2, 3], 3, 1) is True
    assert sampled_by_older([], 3, 1) is True and sampled_by_older([], 3, 0) is False


def test_mini_batches_capped_by_the_items_are_said_and_recorded(rolled):
    """4 mini-batches configured, 3 items: 3 optimizer steps (a mini-batch needs an item); the stats record 3 and
    the update says so once."""
    tr, seqs = rolled
    said: list[str] = []
    upd = tr.policy_update
    cfg, log, flag = upd.cfg, upd.log, upd._said_capped
    upd.cfg, upd.log, upd._said_capped = cfg.model_copy(update={"mini_batches": 4, "lr": 1e-9}), said.append, False
    try:
        state = {k: v.clone() for k, v in tr.model.state_dict().items()}
        stats = upd([UpdateItem(sequence=s, advantage=0.5) for s in seqs[:3]], 0)
        upd([UpdateItem(sequence=s, advantage=0.5) for s in seqs[:3]], 1)
        tr.model.load_state_dict(state)
    finally:
        upd.cfg, upd.log, upd._said_capped = cfg, log, flag
    assert stats["mini_batches"] == 3
    assert len(said) == 1 and "mini_batches 4 ran as 3" in said[0]


def test_mismatch_metrics_merge_over_ranks_by_their_own_counts(rolled):
    """Two ranks' shares: one with the perturbed tokens and few trained tokens, one clean with many replayed
    (off-policy) tokens that count as trained but are not on-policy. The merged ``mismatch/kl_k3`` is Σ k3 over
    every on-policy token / their count (closed form), ``ppl_ratio`` the mean over every sequence, not the ranks'
    means weighted by trained tokens."""
    tr, seqs = rolled
    target = next(s for s in seqs if s.role == "planner" and s.n_trained >= 8)
    pos = [i for i, m in enumerate(target.loss_mask) if m][1:4]
    rank_a = [UpdateItem(sequence=_perturbed(target, pos, []), advantage=1.0)]
    rank_b = [UpdateItem(sequence=s, advantage=1.0, off_policy=True) for s in seqs[:6]] + [
        UpdateItem(sequence=seqs[6], advantage=1.0)]

    def shard(items):
        batches, upd = _plan(tr, items, rollout_correction="off")
        sums = upd._mismatch_sums(batches)
        stats = {**mismatch_means(sums), "trained_tokens": sum(it.sequence.n_trained for it in items)}
        return {"zero": 0, "groups": 1, "prompts": [], "stats": stats, "sketches": [], "sums": [sums]}, sums

    (a, sa), (b, sb) = shard(rank_a), shard(rank_b)
    merged = merge_shards([a, b])["stats"]
    n = sa["n"] + sb["n"]
    assert sb["n"] == seqs[6].n_trained  # the replayed rows are not on-policy tokens
    k3 = 3 * (10 - 1 - LOG10)  # the three w = 10 tokens; the clean ones ~0
    assert merged["mismatch/kl_k3"] == pytest.approx((k3 + sb["k3"]) / n, rel=1e-3)
    assert merged["mismatch/ppl_ratio"] == pytest.approx((sa["ppl_ratio"] + sb["ppl_ratio"]) / 2, rel=1e-6)
    weighted = (a["stats"]["mismatch/kl_k3"] * a["stats"]["trained_tokens"] + b["stats"]["mismatch/kl_k3"]
                * b["stats"]["trained_tokens"]) / (a["stats"]["trained_tokens"] + b["stats"]["trained_tokens"])
    assert merged["mismatch/kl_k3"] > 2 * weighted  # the old merge diluted it by the replayed rows' tokens


#: the CPU bf16 run of perf/bench_parity.py (SGLang's CPU engine against the trainer, τ = 1; docs/training.md): per
#: token KL k1 = −E[log w] 1.8e-4 and k3 5.3e-4 (≈ σ²/2 of log w), the largest |log w| 1.25, 0.010 % of tokens past C
BF16_K1, BF16_K3, BF16_MAX, BF16_TAIL = 1.8e-4, 5.3e-4, 1.25, 1 / 5000


def test_sequence_corrections_at_the_bf16_noise_of_the_cpu_engine():
    """1,000 turns each of 500 and 2,000 tokens whose log w are the CPU bf16 run's noise (normal, mean −k1, σ² =
    2·k3; one token in 5,000 a heavy-tail draw of up to ±1.25, which puts ~0.01 % past C as measured): the geometric
    mean (``sequence-mask``) rejects < 1 % of them; the product (``sequence-product-mask``) rejects what the closed
    form P(N(L·μ, L·σ²) > log C) says (~14 % and ~24 %): a product over a long turn is rounding noise compounded."""
    from statistics import NormalDist

    gen = torch.Generator().manual_seed(61)
    sigma = math.sqrt(2 * BF16_K3)
    for length in (500, 2000):
        lr = torch.randn(1000, length, generator=gen) * sigma - BF16_K1
        tail = torch.rand(1000, length, generator=gen) < BF16_TAIL
        lr = torch.where(tail, (torch.rand(1000, length, generator=gen) * 2 - 1) * BF16_MAX, lr)
        mask = torch.ones_like(lr)
        _, geo = rollout_correction(lr, mask, "sequence-mask", 2.0)
        _, prod = rollout_correction(lr, mask, "sequence-product-mask", 2.0)
        geo_rate, prod_rate = float(geo[:, 0].float().mean()), float(prod[:, 0].float().mean())
        assert geo_rate < 0.01, (length, geo_rate)
        # the row's log w is a sum of L terms: its mean and variance, the tail's share included
        mean = length * (1 - BF16_TAIL) * -BF16_K1
        var = length * ((1 - BF16_TAIL) * (sigma ** 2 + BF16_K1 ** 2) + BF16_TAIL * BF16_MAX ** 2 / 3) - (
            mean ** 2 / length)
        want = 1 - NormalDist(mean, math.sqrt(var)).cdf(math.log(2.0))
        assert prod_rate == pytest.approx(want, abs=0.04), (length, prod_rate, want)
        assert prod_rate > 0.1
