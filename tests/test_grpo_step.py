"""One PARA-GRPO step's arithmetic, on real rollouts of the shipped toy policy where one is needed and by hand
where the arithmetic is the point: rollouts of an older policy version corrected (decoupled PPO's behaviour weight),
replayed advantages on the on-policy scale, the replay tiers with tied averages and the buffer filled after the draw,
the same prompt drawn twice as two groups, a method's trust region, equal rewards as exactly zero advantages."""

from __future__ import annotations

import pytest
import torch

from paravt_train.data import prompts_from_rl
from paravt_train.rewards import RewardBreakdown
from paravt_train.rl.config import GRPOConfig
from paravt_train.rl.objective import group_advantages
from paravt_train.rl.replay import ReplayBuffer, ReplayItem
from paravt_train.rl.rollout import Episode, TokenSequence
from paravt_train.rl.step import replay_batch
from paravt_train.rl.trainer import GRPOTrainer
from paravt_train.rl.update import UpdateItem


def _cfg(toy_policy_dir, toy_rl, out, **kw) -> GRPOConfig:
    base = dict(model=toy_policy_dir, data=toy_rl["data"], video_root=toy_rl["video_root"], output_dir=str(out),
                steps=1, prompts_per_step=2, group_size=2, max_new_tokens=96, subagent_max_new_tokens=40,
                temperature=1.2, lr=1e-3, save_every=1, concurrency=2)
    base.update(kw)
    return GRPOConfig(**base)


@pytest.fixture(scope="module")
def rolled(toy_policy_dir, toy_rl, tmp_path_factory):
    """A trainer on the shipped toy policy and one step's real rollouts (two prompts, G = 2)."""
    tr = GRPOTrainer(_cfg(toy_policy_dir, toy_rl, tmp_path_factory.mktemp("grpo_step")), progress=False)
    tr.setup()
    prompts = prompts_from_rl(toy_rl["data"], toy_rl["video_root"])
    groups = tr.rollout(tr.prompts_for(0, prompts))
    return tr, groups, prompts


def test_rollouts_of_an_older_version_are_corrected_not_trained_as_on_policy(rolled):
    """``sync_every`` > 1 at η = 0: the server still serves version 0 while the trainer is at version 1. Those
    rollouts enter the update with decoupled PPO's behaviour weight π_prox / π_behav (the server's logprobs),
    counted as ``stale_tokens``; rollouts of the current version are untouched."""
    tr, groups, _ = rolled
    eps = [e for g in groups for e in g]
    seqs = [s for e in eps for s in e.sequences][:3]
    # the server's behaviour logprobs, as an older policy gave them: lower than this model's by 0.3 per token
    old = [TokenSequence(role=s.role, input_ids=s.input_ids, loss_mask=s.loss_mask,
                         logprobs=[lp - 0.3 * m for lp, m in zip(s.logprobs, s.loss_mask, strict=True)],
                         images=s.images, turn=s.turn, index=s.index, episode=s.episode,
                         image_grid_thw=s.image_grid_thw)
           for s in seqs]
    stale = tr.policy_update.plan([UpdateItem(sequence=s, advantage=1.0, stale=True) for s in old])[0]
    fresh = tr.policy_update.plan([UpdateItem(sequence=s, advantage=1.0) for s in old])[0]
    assert all(b.token_weights is not None and b.behaviour is not None for b in stale)
    w = torch.cat([b.token_weights[b.mask > 0] for b in stale])
    assert float(w.mean()) == pytest.approx(float(torch.exp(torch.tensor(0.3))), rel=0.05)  # ≈ e^0.3, not 1
    # rows of the current version: the rollout correction (default TIS at 2: e^0.3 passes whole), not decoupled PPO
    assert all(b.behaviour is None for b in fresh)
    wf = torch.cat([b.token_weights[b.mask > 0] for b in fresh])
    assert float(wf.mean()) == pytest.approx(float(torch.exp(torch.tensor(0.3))), rel=0.05)
    cfg = tr.policy_update.cfg
    tr.policy_update.cfg = cfg.model_copy(update={"rollout_correction": "off"})
    try:
        assert all(b.token_weights is None for b in tr.policy_update.plan([UpdateItem(sequence=s, advantage=1.0)
                                                                    for s in old])[0])
    finally:
        tr.policy_update.cfg = cfg
    # the trainer marks them by the versions the server reported
    tr.step = 1
    for e in eps:
        e.versions = [0]
    items_stale = [UpdateItem(sequence=s, advantage=e.advantage,
                              stale=any(v != tr.step for v in e.versions)) for e in eps
                   for s in e.sequences]
    assert all(it.stale for it in items_stale)
    stats = tr.policy_update([UpdateItem(sequence=s, advantage=0.5, stale=True) for s in old])
    assert stats["stale_tokens"] > 0 and stats["behaviour_weight"] > 1.0
    tr.step = 0


def _episode(pid, reward, sample=0):
    r = RewardBreakdown(total=reward, acc=0.0, fmt=reward, base=0.0, anchor=0.0, tool=0.0)
    return Episode(prompt_id=pid, task="mcq", sample=sample, n_frames=4, answer=None, text="", sequences=[],
                   reward=r)


def test_replayed_advantages_stay_on_the_on_policy_scale():
    """AVATAR Eq. 11 with σ over the off-policy draws alone: a replayed well-formed wrong MCQ (reward 1.25 against
    R̄ 2.3) divided by the floor 0.1 gave |A| = 10.5 while an on-policy group of 8 gives at most √7 = 2.65.
    σ now spans the step's draws and on-policy rollouts, and |A| is clipped at √(G−1)."""
    cfg = GRPOConfig(model="m", group_size=8, replay={"enabled": True, "per_step": 2})
    buf = ReplayBuffer(capacity=20, seed=0)
    for _ in range(5):
        buf.observe("q", 2.3)
    seq = TokenSequence(role="planner", input_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0.0, -0.5, -0.5],
                        episode="old")
    buf.add("q", [seq], 1.25)
    buf.add("q", [seq], 1.25)
    on_policy = [[_episode("p", r, i) for i, r in enumerate([1.25, 1.25, 2.45, 1.25, 2.45, 1.25, 1.25, 1.25])]]
    from paravt_train.rl.objective import offpolicy_advantages

    before = offpolicy_advantages([1.25, 1.25], [2.3, 2.3], min_std=0.1)  # σ over the draws alone, as before
    assert abs(before[0]) > 10
    items, drawn = replay_batch(buf, cfg, on_policy)
    assert drawn == 2 and len(items) == 2 and all(it.off_policy and it.weight == 0.6 for it in items)
    advs = [it.advantage for it in items]
    assert all(-7 ** 0.5 <= a < -1.0 for a in advs)  # a real negative signal, within an on-policy group's bound
    # with nothing to spread against (equal rewards everywhere) the clip holds the bound
    buf2 = ReplayBuffer(capacity=20, seed=0)
    for _ in range(5):
        buf2.observe("q", 2.3)
    buf2.add("q", [seq], 1.25)
    items, _ = replay_batch(buf2, cfg.model_copy(update={"replay": cfg.replay.model_copy(update={"per_step": 1})}),
                            [[_episode("p", 1.25, i) for i in range(8)]])
    assert items[0].advantage == pytest.approx(-7 ** 0.5)


def test_tied_moving_averages_split_across_the_tiers():
    """Ten rollouts of prompts answered alike so far (one R̄): shared 4 / 4 / 2 by the 40 / 35 / 25 % quantiles,
    not all put in the hard tier."""
    buf = ReplayBuffer(capacity=100, seed=0)
    tiers = []
    for k in range(10):
        buf.observe(f"p{k}", 1.25)
        tiers.append(buf.add(f"p{k}", [], 1.25))
    assert tiers.count("hard") == 4 and tiers.count("medium") == 4 and tiers.count("easy") == 2
    assert {len(v) for v in buf.store.values()} == {4, 2}


def test_the_same_prompt_drawn_twice_in_a_step_is_two_groups(rolled):
    """At an epoch boundary a step may draw one prompt twice: two groups, with ids unique per draw (the loss
    normaliser is keyed by episode id) and their own samples."""
    tr, _, prompts = rolled
    groups = tr.rollout([prompts[0], prompts[0]])
    ids = [e.id for g in groups for e in g]
    assert len(ids) == len(set(ids)) == 2 * tr.cfg.group_size
    assert {s.episode for g in groups for e in g for s in e.sequences} == set(ids)
    tokens = [[tuple(s.input_ids) for s in e.sequences] for g in groups for e in g]
    assert tokens[:2] != tokens[2:]  # the repeat sampled on its own seed


def test_a_method_preset_behaves_as_the_method(rolled):
    """One optimizer step per batch (the paper's released recipe: AReaL ppo_n_minibatches 1) cannot move the
    ratio, so its clip never acts, and the metrics say so; DAPO's preset takes several mini-batches so that its
    clip-higher acts."""
    tr, groups, _ = rolled
    assert GRPOConfig(model="m", method="dapo").mini_batches > 1
    assert (GRPOConfig(model="m").ppo_epochs, GRPOConfig(model="m").mini_batches) == (1, 1)
    eps = [e for g in groups for e in g]
    items = [UpdateItem(sequence=s, advantage=1.0 if i % 2 else -1.0) for i, e in enumerate(eps) for s in e.sequences]
    one = tr.policy_update(items)
    assert one["ratio_dev_max"] < 1e-5 and one["clip_fraction"] == 0.0
    tr.policy_update.cfg = tr.cfg.model_copy(update={"mini_batches": 2, "micro_batch_size": 1})
    try:
        two = tr.policy_update(items)
    finally:
        tr.policy_update.cfg = tr.cfg
    assert two["ratio_dev_max"] > 1e-4  # from the second optimizer step on, the ratio moves and the clip can act


def test_equal_rewards_give_exactly_zero_advantages():
    """A group whose G rewards are alike teaches nothing. In float32 eight rewards of 1.45 (a well-formed wrong
    answer's format score) had a mean off by ~1e-7, divided by the std's eps into advantages of 0.11 each."""
    from paravt_train.rl.objective import episode_advantages

    for value in (1.45, -0.2, 0.7):
        assert float(group_advantages(torch.tensor([value] * 8), group=8).abs().max()) == 0.0
        group = [_episode("p", value, i) for i in range(8)]
        episode_advantages(group)
        assert all(e.advantage == 0.0 for e in group)


def test_replay_batch_uses_the_buffer_after_the_step(rolled):
    """The step's finished episodes go into the buffer after the draw (a rollout is never replayed in its own
    step) and observe their prompt's R̄."""
    tr, groups, _ = rolled
    cfg = tr.cfg.model_copy(update={"replay": tr.cfg.replay.model_copy(update={"enabled": True, "per_step": 4})})
    buf = ReplayBuffer(capacity=20, seed=0)
    items, drawn = replay_batch(buf, cfg, groups)
    assert drawn == 0 and items == [] and len(buf) == sum(len(g) for g in groups)
    assert all(isinstance(it, ReplayItem) for it in buf.items)
