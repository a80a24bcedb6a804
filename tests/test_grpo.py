"""The GRPO objective: hand-computed values, and the AVATAR options reducing to plain GRPO."""

import pytest
import torch

from paravt_train.grpo import ReplayBuffer, group_advantages, kl_penalty, policy_loss, temporal_weights


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
    # ratio = 1: per-token -A; seq-mean: (-1 + 2) / 2
    assert float(out.loss.detach()) == pytest.approx(0.5)
    out.loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.5, -0.5, 0.0], [2 / 3, 2 / 3, 2 / 3]]) / 2)


def test_aggregations():
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([1.0, -2.0])
    assert float(policy_loss(logp, logp, adv, mask, aggregation="token-mean").loss) == pytest.approx((-2 + 6) / 5)
    assert float(policy_loss(logp, logp, adv, mask, aggregation="constant", constant=10).loss) == pytest.approx(
        (-2 + 6) / 20)
    with pytest.raises(ValueError):
        policy_loss(logp, logp, adv, mask, aggregation="median")


def test_clipping():
    old = torch.zeros(1, 2)
    logp = torch.tensor([[0.5, -0.05]], requires_grad=True)  # ratios e^0.5 = 1.65 (clipped), 0.95
    out = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2), clip=0.2, kl_coef=0.0)
    assert out.clip_fraction == pytest.approx(0.5)
    out.loss.backward()
    assert logp.grad[0, 0] == 0  # a positive advantage beyond 1+ε gets no gradient
    assert logp.grad[0, 1] != 0


def test_kl_estimators():
    a, b = torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -1.0])
    assert kl_penalty(a, a, "k3").tolist() == [0, 0]
    assert (kl_penalty(a, b, "k3") >= 0).all()
    assert kl_penalty(a, b, "k1").tolist() == [0, -1] and kl_penalty(a, b, "k2").tolist() == [0, 0.5]
    logp = torch.zeros(1, 2)
    out = policy_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 2), ref_logp=torch.full((1, 2), -1.0),
                      kl_coef=0.01)
    assert float(out.loss) == pytest.approx(0.01 * (torch.exp(torch.tensor(-1.0)) - (-1) - 1).item())


def test_tas_and_empty_buffer_reduce_to_plain_grpo():
    torch.manual_seed(0)
    logp = torch.randn(4, 6)
    old = logp + 0.1 * torch.randn(4, 6)
    adv = torch.randn(4)
    mask = (torch.rand(4, 6) > 0.2).int()
    ref = logp + 0.05
    plain = policy_loss(logp, old, adv, mask, ref_logp=ref)
    w = torch.nn.utils.rnn.pad_sequence(temporal_weights([6] * 4, lam=0.0), batch_first=True)
    shaped = policy_loss(logp, old, adv, mask, ref_logp=ref, token_weights=w, sample_weights=torch.ones(4))
    assert torch.equal(plain.loss, shaped.loss)
    assert ReplayBuffer().sample(8) == []


def test_temporal_weights_by_hand():
    [w] = temporal_weights([5], lam=0.3)
    # t/(L-1) = 0, .25, .5, .75, 1 -> (2x-1)^2 = 1, .25, 0, .25, 1
    assert w.tolist() == pytest.approx([1.3, 1.075, 1.0, 1.075, 1.3])


def test_replay_buffer_tiers_and_baseline():
    buf = ReplayBuffer(capacity=60, seed=1)
    for p in range(30):
        for k in range(2):
            buf.add(f"p{p}", (p, k), reward=p / 30)
    assert len(buf) == 60
    tiers = buf.tier_of()
    assert tiers["p0"] == "hard" and tiers["p15"] == "medium" and tiers["p29"] == "easy"
    drawn = buf.sample(20)
    counts = {"hard": 0, "medium": 0, "easy": 0}
    for pid, _, _ in drawn:
        counts[tiers[pid]] += 1
    assert counts == {"hard": 8, "medium": 7, "easy": 5}
    for r in range(25):
        buf.add("p0", ("x", r), reward=float(r))
    assert buf.baseline("p0") == pytest.approx(sum(range(5, 25)) / 20)  # the last 20 rewards
    assert len(buf) == 60  # capacity holds
