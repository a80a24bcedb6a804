"""The GRPO objective and AVATAR's replay buffer: hand-computed values."""

import pytest
import torch

from paravt_train.rl.objective import (
    group_advantages,
    kl_penalty,
    offpolicy_advantages,
    policy_loss,
    temporal_weights,
    token_scales,
)
from paravt_train.rl.replay import ReplayBuffer, ReplayItem


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    a = group_advantages(r, group=4)
    assert a[:4].tolist() == pytest.approx([1, -1, -1, 1], abs=1e-4)  # mean 0.5, std 0.5
    assert a[4:].tolist() == [0, 0, 0, 0]  # a unanimous group has no signal
    assert group_advantages(r, 4, scale="none")[:4].tolist() == [0.5, -0.5, -0.5, 0.5]


def test_policy_loss_on_policy_is_the_policy_gradient():
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([1.0, -2.0])
    out = policy_loss(logp, logp.detach(), adv, mask, kl_coef=0.0)
    # ratio = 1: per-token -A; each row its own episode, seq-mean: (-1 + 2) / 2
    assert float(out.loss.detach()) == pytest.approx(0.5)
    out.loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.5, -0.5, 0.0], [2 / 3, 2 / 3, 2 / 3]]) / 2)


def test_episodes_weigh_the_same_whatever_their_tool_calls():
    """seq-mean weighs episodes: a planner sequence + 3 sub-agent sequences count as one rollout."""
    # episode a: planner 4 tokens + three sub-agents of 2 tokens (10 tokens); episode b: planner 5 tokens
    episodes, tokens = ["a", "a", "a", "a", "b"], [4, 2, 2, 2, 5]
    scales = token_scales(episodes, tokens, "seq-mean")
    assert scales == pytest.approx([1 / 20] * 4 + [1 / 10])
    # each episode's tokens sum to a weight of 1/2
    assert sum(s * n for s, n, e in zip(scales, tokens, episodes, strict=True) if e == "a") == pytest.approx(0.5)
    assert scales[4] * 5 == pytest.approx(0.5)
    assert token_scales(episodes, tokens, "token-mean") == pytest.approx([1 / 15] * 5)
    assert token_scales(episodes, tokens, "constant", constant=10) == pytest.approx([1 / 20] * 5)
    # global totals (all micro-batches, all ranks) decide the normaliser
    assert token_scales(["a"], [4], "token-mean", totals=(2, 8.0)) == [1 / 8]
    with pytest.raises(ValueError):
        token_scales(episodes, tokens, "median")
    # the loss: per-token -A with A = +1 for a, -1 for b, on-policy
    logp = torch.zeros(5, 5)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0, -1.0])
    out = policy_loss(logp, logp, adv, mask, kl_coef=0.0, scales=torch.tensor(scales))
    assert float(out.loss) == pytest.approx(-0.5 + 0.5, abs=1e-7)


def test_clipping_and_clip_higher():
    old = torch.zeros(1, 2)
    logp = torch.tensor([[0.25, -0.05]], requires_grad=True)  # ratios e^0.25 = 1.28 and 0.95
    out = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2), clip=0.2, kl_coef=0.0)
    assert out.clip_fraction == pytest.approx(0.5)
    out.loss.backward()
    assert logp.grad[0, 0] == 0  # a positive advantage beyond 1+ε gets no gradient
    assert logp.grad[0, 1] != 0
    # DAPO's clip-higher: with ε_high = 0.28 the same token (1.28 < 1.28...) is inside the bound
    logp2 = torch.tensor([[0.24, -0.05]], requires_grad=True)
    out2 = policy_loss(logp2, old, torch.tensor([1.0]), torch.ones(1, 2), clip=0.2, clip_high=0.28, kl_coef=0.0)
    out2.loss.backward()
    assert out2.clip_fraction == 0.0 and logp2.grad[0, 0] != 0
    # the lower bound stays at 1 - ε_low for negative advantages
    low = torch.tensor([[-0.5]], requires_grad=True)
    out3 = policy_loss(low, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), clip=0.2, clip_high=0.28,
                       kl_coef=0.0)
    out3.loss.backward()
    assert out3.clip_fraction == 1.0 and low.grad[0, 0] == 0


def test_kl_estimators():
    a, b = torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -1.0])
    assert kl_penalty(a, a, "k3").tolist() == [0, 0]
    assert (kl_penalty(a, b, "k3") >= 0).all()
    assert kl_penalty(a, b, "k1").tolist() == [0, -1] and kl_penalty(a, b, "k2").tolist() == [0, 0.5]
    logp = torch.zeros(1, 2)
    out = policy_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 2), ref_logp=torch.full((1, 2), -1.0),
                      kl_coef=0.01)
    assert float(out.loss) == pytest.approx(0.01 * (torch.exp(torch.tensor(-1.0)) - (-1) - 1).item())


def test_temporal_weights_by_hand():
    [w] = temporal_weights([5], lam=0.3)
    # t/(L-1) = 0, .25, .5, .75, 1 -> (2x-1)^2 = 1, .25, 0, .25, 1
    assert w.tolist() == pytest.approx([1.3, 1.075, 1.0, 1.075, 1.3])
    assert temporal_weights([4], lam=0.0)[0].tolist() == [1, 1, 1, 1]


def test_tas_shapes_the_gradient_by_position():
    """TAS (AVATAR Eq. 6): the first and last tokens of a sequence get (1 + λ)× the gradient of the middle."""
    logp = torch.zeros(1, 5, requires_grad=True)
    w = temporal_weights([5], lam=0.5)[0][None]
    out = policy_loss(logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 5), kl_coef=0.0, token_weights=w)
    out.loss.backward()
    g = logp.grad[0].abs()
    assert g[0] / g[2] == pytest.approx(1.5) and g[4] / g[2] == pytest.approx(1.5)
    assert g[1] / g[2] == pytest.approx(1 + 0.5 * 0.25)


def test_offpolicy_advantage_is_avatar_eq11():
    # A_off = (R - R̄(q)) / σ of the off-policy batch's rewards
    rewards, baselines = [1.0, 0.0, 0.5], [0.5, 0.25, 0.5]
    sigma = torch.tensor(rewards).std(unbiased=False).item()  # 0.4082
    got = offpolicy_advantages(rewards, baselines)
    assert got == pytest.approx([0.5 / sigma, -0.25 / sigma, 0.0], rel=1e-4)


def test_offpolicy_advantage_never_divides_by_no_spread():
    """Every well-formed wrong MCQ scores exactly 1.35: drawn rewards without spread (or a single draw) would be
    divided by eps alone (advantages of ~1e5). σ is floored, and may come from every rank's draws."""
    tied = offpolicy_advantages([1.35, 1.35, 1.35], [1.0, 1.0, 1.35], min_std=0.1)
    assert tied == pytest.approx([3.5, 3.5, 0.0], rel=1e-4)
    assert offpolicy_advantages([1.35], [1.0], min_std=0.1) == pytest.approx([3.5], rel=1e-4)
    assert max(abs(a) for a in offpolicy_advantages([1.35, 1.35], [1.0, 1.0])) > 1e4  # what the guard prevents
    # σ of the whole off-policy batch (other ranks' draws included), not of this rank's share
    assert offpolicy_advantages([1.0], [0.5], sigma=0.25, min_std=0.1) == pytest.approx([2.0], rel=1e-4)


def test_replay_tiers_by_quantiles_with_fixed_capacities():
    buf = ReplayBuffer(capacity=20, seed=1)  # tiers: hard 8, medium 7, easy 5
    assert buf.tier_capacity == {"hard": 8, "medium": 7, "easy": 5}
    # ten prompts with moving-average rewards 0.0, 0.1, ..., 0.9 (one rollout each)
    for p in range(10):
        buf.observe(f"p{p}", p / 10)
    tiers = [buf.add(f"p{p}", [f"seq{p}"], p / 10) for p in range(10)]
    # each rollout is placed against the R̄ of the rollouts already stored plus itself (its rank = the share
    # with a lower R̄): in an ascending stream the first is Hard, then Medium, then the top quantile
    assert tiers == ["hard", "medium", "medium"] + ["easy"] * 7
    # the Easy tier holds 5: the two oldest easy rollouts (R̄ 0.3, 0.4) were evicted, the others stay
    assert sorted(buf.baseline(it.prompt_id) for it in buf.items) == pytest.approx([0, .1, .2, .5, .6, .7, .8, .9])
    # a low-R̄ prompt arriving now is Hard: bottom 40 % of the buffer's R̄
    buf.observe("hard-one", 0.0)
    assert buf.tier_for("hard-one") == "hard"
    # 0.55 is above 4 of the 9 values (44 %) → Medium; 0.95 above 8 of 9 → Easy
    buf.observe("mid", 0.55)
    assert buf.tier_for("mid") == "medium"
    buf.observe("top", 0.95)
    assert buf.tier_for("top") == "easy"


def test_hard_rollouts_are_kept_when_easy_ones_flood_in():
    buf = ReplayBuffer(capacity=10, seed=0)  # hard 4, medium 4 (3.5 -> 3 + remainder), easy 2
    for p in range(4):
        buf.observe(f"hard{p}", 0.0)
    for p in range(4):
        buf.add(f"hard{p}", [f"h{p}"], 0.0)
    for k in range(30):  # many easy rollouts
        buf.observe(f"easy{k}", 1.0)
        buf.add(f"easy{k}", [f"e{k}"], 1.0)
    # the four tied hard rollouts were shared among the tiers (ties split as the quantiles say), and the easy flood
    # never evicted one of them: a full tier evicts its oldest rollout at least as easy as the newcomer
    kept = sorted(it.prompt_id for it in buf.items if it.prompt_id.startswith("hard"))
    assert kept == [f"hard{p}" for p in range(4)]
    assert len(buf) <= 10 and all(len(buf.store[t]) <= buf.tier_capacity[t] for t in buf.store)


def test_replay_draws_forty_thirty_five_twenty_five():
    buf = ReplayBuffer(capacity=60, seed=3)
    for tier, n in (("hard", 24), ("medium", 21), ("easy", 15)):
        for k in range(n):
            buf.store[tier].append(_item(f"{tier}{k}"))
    drawn = buf.sample(20)
    counts = {t: sum(1 for it in drawn if it.prompt_id.startswith(t)) for t in ("hard", "medium", "easy")}
    assert counts == {"hard": 8, "medium": 7, "easy": 5}
    assert ReplayBuffer().sample(8) == []


def _item(pid):
    return ReplayItem(prompt_id=pid, sequences=[], reward=0.0)


def test_baseline_window_is_per_rollout():
    buf = ReplayBuffer(baseline_window=20)
    for r in range(25):
        buf.observe("p0", float(r))  # one call per on-policy rollout, however many sequences it has
    assert buf.baseline("p0") == pytest.approx(sum(range(5, 25)) / 20)  # the last 20 rollouts


def test_decoupled_objective_by_hand():
    """AReaL's decoupled PPO on four tokens: the ratio to π_prox clipped at ε, each token weighted by
    π_prox / π_behav, the token above the cap left out."""
    from paravt_train.rl.update import behaviour_weights

    behav = torch.log(torch.tensor([[0.5, 0.4, 0.1, 0.5]]))  # the policy that sampled (the server's version)
    prox = torch.log(torch.tensor([[0.5, 0.2, 0.6, 0.45]]))  # this model at the start of the update
    theta = torch.log(torch.tensor([[0.7, 0.2, 0.6, 0.45]]))  # after a first optimizer step
    mask = torch.ones(1, 4)
    w, stats = behaviour_weights(prox, behav, mask, cap=5.0)
    # weights 1, 0.5, 6 (over the cap: out), 0.9
    assert w.tolist()[0] == pytest.approx([1.0, 0.5, 0.0, 0.9], rel=1e-5)
    assert stats["capped"] == 1 and stats["max"] == pytest.approx(6.0, rel=1e-5)
    out = policy_loss(theta, prox, torch.tensor([1.0]), mask, clip=0.2, kl_coef=0.0, token_weights=w,
                      scales=torch.tensor([1.0]))
    # token 1: ratio 0.7/0.5 = 1.4 clipped to 1.2 (A > 0) -> -1.2 x 1; token 2: ratio 1 -> -1 x 0.5;
    # token 3: left out; token 4: ratio 1 -> -1 x 0.9
    assert float(out.loss) == pytest.approx(-(1.2 * 1.0 + 1.0 * 0.5 + 0.0 + 1.0 * 0.9), rel=1e-5)
    assert out.clip_fraction == pytest.approx(0.25)  # the first token's ratio is clipped
