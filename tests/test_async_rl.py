"""Asynchronous PARA-GRPO (``max_staleness`` η > 0): the staleness bound both loops use (the online learner's too)
and decoupled PPO's objective, the behaviour-weight quantiles in the step's metrics, the settings η > 0 refuses,
and the queue of unused episodes across a restart. The loop rolling out ahead itself: tests/test_rl.py."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from paravt_agent.errors import ConfigError
from paravt_agent.store import TrajectoryStore
from paravt_agent.trajectory import Trace
from paravt_train.infra.checkpoint import load_rank_blobs
from paravt_train.rewards import RewardBreakdown
from paravt_train.rl.async_loop import AsyncRollouts, within_staleness
from paravt_train.rl.config import GRPOConfig
from paravt_train.rl.metrics import weight_quantiles, weight_sketch
from paravt_train.rl.rollout import Episode, TokenSequence
from paravt_train.rl.trainer import GRPOTrainer
from paravt_train.sync.disk import SGLangWeightSync


def _cfg(model, toy_rl, out, **kw) -> GRPOConfig:
    base = dict(model=model, data=toy_rl["data"], video_root=toy_rl["video_root"], output_dir=str(out), steps=1,
                prompts_per_step=2, group_size=2, max_new_tokens=96, subagent_max_new_tokens=40, temperature=0.7,
                lr=1e-3, save_every=1, concurrency=2)
    base.update(kw)
    return GRPOConfig(**base)


def _episode(prompt: str, sample: int, versions: list[int], answer=None) -> Episode:
    seq = TokenSequence(role="planner", input_ids=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1],
                        logprobs=[0.0, 0.0, -0.5, -0.25], episode=f"{prompt}#{sample}")
    reward = RewardBreakdown(total=1.0, acc=1.0, fmt=1.0, base=0.0, anchor=0.0, tool=0.0)
    return Episode(prompt_id=prompt, task="mcq", sample=sample, n_frames=4, answer=answer,
                   text="<think>\nx</think><answer>A</answer>", sequences=[seq], reward=reward, advantage=0.5,
                   versions=versions)


# --------------------------------------------------------------------------- paravt-train online, η > 0


def test_online_learner_takes_the_staleness_bound_and_the_decoupled_objective(toy_policy_dir, toy_rl, tmp_path,
                                                                              sglang_toy):
    """`paravt-train online` with η = 1 against SGLang itself (0.5.23 on CPU): its updates use decoupled PPO (the
    behaviour weights and their quantiles are logged), and when the served policy lags the trainer by more than
    η versions (the server restarted on the initial weights after two updates) the update drops those groups,
    counts them (``dropped_stale``) and queues their prompt again: the next update, on the weights the dropping
    update pushed, trains it. No feedback is lost to the bound, none is trained twice."""
    from paravt_train.online.learner import OnlineLearner

    store = TrajectoryStore(tmp_path / "traces.db")
    trained_ids = []
    for w in toy_rl["worlds"][:3]:
        q = w.questions[0]  # mcq
        t = Trace(video=w.video, question=q.question, options=q.options)
        store.add(t)
        store.feedback(t.id, answer=q.answer)
        trained_ids.append(t.id)
    stub = sglang_toy
    cfg = _cfg(toy_policy_dir, toy_rl, tmp_path / "online", data=None, backend="sglang", endpoint=stub.url,
               max_staleness=1, prompts_per_step=1, gating_choices=[4], kl_coef=0.0, save_every=100)
    logs: list[str] = []
    learner = OnlineLearner(cfg, store.path, progress=False, log=logs.append)
    tr = learner.trainer
    step = tr.train_step

    def train_step(prompts):
        if tr.step == 2:  # the server restarts on the initial weights ("default": version 0), two versions behind
            SGLangWeightSync(stub.url, tmp_path / "w").serve(toy_policy_dir, version="default")
        return step(prompts)

    tr.train_step = train_step
    assert learner.run(once=True) == 4
    recs = [json.loads(x) for x in (tmp_path / "online" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert [r["dropped_stale"] for r in recs] == [0, 0, 1, 0]
    assert recs[2]["episodes"] == 0 and recs[3]["prompts"] == recs[2]["prompts"]  # the same prompt, trained next
    for r in (recs[0], recs[1], recs[3]):
        assert r["staleness"] == 0 and r["episodes"] == 2 and r["failed_episodes"] == 0, r.get("failures")
        # rows the current weights sampled: the rollout correction (token-truncate), not decoupled PPO's weight
        assert "mismatch/truncated" in r and r["stale_tokens"] == 0 and r["behaviour_weight"] == 1.0
    st = learner.state
    assert st.queue == [] and sorted(st.trained) == sorted(set(st.trained)) and len(st.trained) == 3
    assert any("too stale, queued again" in line for line in logs)


def test_online_learner_refuses_eta_without_a_served_policy(toy_policy_dir, toy_rl, tmp_path):
    """η > 0 on the local backend (it generates with the weights being trained: no versions to bound) is a clear
    error when the learner starts, not at the first feedback row."""
    from paravt_train.online.learner import OnlineLearner

    cfg = _cfg(toy_policy_dir, toy_rl, tmp_path / "local", data=None, max_staleness=1, kl_coef=0.0)
    learner = OnlineLearner(cfg, tmp_path / "traces.db", progress=False, log=lambda *_: None)
    with pytest.raises(ConfigError, match="use backend sglang"):
        learner.run(once=True)


def test_within_staleness_is_the_bound_both_loops_use():
    groups = [[_episode("a", 0, [3]), _episode("a", 1, [2, 3])], [_episode("b", 0, [1]), _episode("b", 1, [3])],
              [_episode("c", 0, [])]]  # a backend that reports no versions: passes
    fresh, stale = within_staleness(groups, version=3, eta=1)
    assert [g[0].prompt_id for g in fresh] == ["a", "c"] and [g[0].prompt_id for g in stale] == ["b"]
    assert within_staleness(groups, version=3, eta=2) == (groups, [])


# --------------------------------------------------------------------------- behaviour-weight distribution


def test_behaviour_weight_quantiles_by_hand():
    """p10 / p50 / p90 of π_prox / π_behav: the nearest-rank quantile over every rank's tokens, from sketches
    that stay small however many tokens a step trains."""
    w = torch.tensor([0.9, 0.1, 0.7, 0.5, 0.3, 1.0, 0.2, 0.8, 0.4, 0.6])  # ten tokens, one rank
    assert weight_quantiles([weight_sketch(w)]) == pytest.approx(
        {"behaviour_weight_p10": 0.1, "behaviour_weight_p50": 0.5, "behaviour_weight_p90": 0.9})
    # two ranks: 10 tokens at 1 and 30 at 2 (the 20th-smallest of 40 is 2, the 4th is 1)
    two = weight_quantiles([weight_sketch(torch.ones(10)), weight_sketch(torch.full((30,), 2.0))])
    assert two == {"behaviour_weight_p10": 1.0, "behaviour_weight_p50": 2.0, "behaviour_weight_p90": 2.0}
    # many tokens: each rank sends 2048 order statistics, the quantiles stay within a sketch step of the exact ones
    gen = torch.Generator().manual_seed(0)
    a = torch.exp(0.3 * torch.randn(50_000, generator=gen))
    b = torch.exp(0.1 * torch.randn(20_000, generator=gen) + 0.2)
    sa, sb = weight_sketch(a), weight_sketch(b)
    assert len(sa["values"]) == 2048 and sa["n"] == 50_000
    got = weight_quantiles([sa, sb])
    exact = torch.sort(torch.cat([a, b])).values
    for q in (0.1, 0.5, 0.9):
        lo, hi = exact[int(q * len(exact)) - 60], exact[int(q * len(exact)) + 60]
        assert lo <= got[f"behaviour_weight_p{round(100 * q)}"] <= hi
    assert weight_quantiles([weight_sketch(torch.zeros(0))]) == {}


def test_the_step_line_carries_the_quantiles_and_not_the_sketch(toy_policy_dir, toy_rl, tmp_path):
    """The update hands step_metrics a sketch of its tokens' weights; the step's line has the quantiles next to
    behaviour_weight (mean, max) and capped_tokens, and nothing that is not a number."""
    from paravt_train.rl.metrics import step_metrics
    from paravt_train.rl.update import behaviour_weights

    behav = torch.log(torch.tensor([[0.5, 0.4, 0.1, 0.5, 0.5]]))
    prox = torch.log(torch.tensor([[0.5, 0.2, 0.6, 0.45, 0.5]]))
    _, bstats = behaviour_weights(prox, behav, torch.ones(1, 5), cap=5.0)  # weights 1, 0.5, 6, 0.9, 1
    stats = {"behaviour_weight": 0.85, "behaviour_weight_max": 6.0, "capped_tokens": 0.2,
             "behaviour_weight_sketch": weight_sketch(bstats["values"]), "trained_tokens": 5, "sequences": 1}
    cfg = _cfg(toy_policy_dir, toy_rl, tmp_path)
    rec = step_metrics(1, [[_episode("a", 0, [0])]], [], [], stats, 0, cfg)
    assert "behaviour_weight_sketch" not in rec and "behaviour_weight_sketch" in stats  # the caller's dict kept
    assert (rec["behaviour_weight_p10"], rec["behaviour_weight_p50"], rec["behaviour_weight_p90"]) == pytest.approx(
        (0.5, 1.0, 6.0), rel=1e-5)
    json.dumps(rec)


# --------------------------------------------------------------------------- settings η > 0 refuses


def test_eta_refuses_settings_the_asynchronous_loop_does_not_handle(toy_policy_dir, toy_rl, tmp_path):
    """η > 0 with fewer weight pushes than updates (the server lags the version the producer throttles on) or a
    pause mode other than retract (in_place: old-weight prefixes never flushed while rollouts run; abort: every
    push throws the requests in flight away) is refused when the config is read."""
    ok = dict(model=toy_policy_dir, backend="sglang", endpoint="http://127.0.0.1:1")
    with pytest.raises(ValidationError, match="needs sync.every 1"):
        GRPOConfig(**ok, max_staleness=1, sync={"every": 2})
    with pytest.raises(ValidationError, match="needs sync.pause_mode retract.*in_place keeps"):
        GRPOConfig(**ok, max_staleness=2, sync={"pause_mode": "in_place"})
    with pytest.raises(ValidationError, match="needs sync.pause_mode retract.*abort ends"):
        GRPOConfig(**ok, max_staleness=1, sync={"pause_mode": "abort"})
    GRPOConfig(**ok, max_staleness=1)  # retract, every update pushed
    GRPOConfig(**ok, sync={"every": 2, "pause_mode": "in_place"})  # the synchronous loop takes both
    path = tmp_path / "grpo.yaml"
    path.write_text(f"model: {toy_policy_dir}\nmax_staleness: 1\n")
    with pytest.raises(ConfigError, match="needs sync.every 1"):
        GRPOConfig.from_yaml(path, ["sync.every=3"])


# --------------------------------------------------------------------------- the queue across a restart


class _FakeTrainer:
    """What AsyncRollouts uses of the trainer: rollouts of a step (recorded), learn (recorded), the step."""

    def __init__(self, steps: int, step: int = 0):
        self.cfg = SimpleNamespace(max_staleness=1, dynamic_sampling=False, steps=steps)
        self.syncer, self.step = object(), step
        self.rolled_out: list[int] = []
        self.learned: list = []

    def prompts_for(self, step, prompts):
        return prompts

    def rollout(self, prompts, step):
        self.rolled_out.append(step)
        return [[_episode(f"s{step}", 0, [step], answer="the answer")]]

    def learn(self, fresh, groups, prompts, timing):
        self.learned.append(fresh)
        self.step += 1
        return {"step": self.step, **timing}


def test_unused_episodes_are_copies_the_run_still_trains_whole():
    """A checkpoint stores the queued groups without their answers; the groups themselves, trained later in the
    same run, keep theirs (unused() used to set ``answer = None`` on the live episodes)."""
    tr = _FakeTrainer(steps=0, step=5)
    live = [[_episode("q", 0, [5], answer="the answer"), _episode("q", 1, [4, 5], answer="another")]]
    prod = AsyncRollouts(tr, [], restored={5: (live, 2.0)})
    try:
        out = prod.unused()
    finally:
        prod.stop()
    (groups, seconds), = out.values()
    assert list(out) == [5] and seconds == 2.0
    assert [e.answer for e in groups[0]] == [None, None]
    assert [e.answer for e in live[0]] == ["the answer", "another"]  # the run's own episodes untouched
    assert [e.versions for e in groups[0]] == [[5], [4, 5]] and groups[0][0].sequences == live[0][0].sequences
    assert prod.done[5][0] is live


def test_a_restart_keeps_or_drops_the_unused_queue(tiny_model, toy_rl, tmp_path):
    """stale_queue_on_resume: a checkpoint written with ``keep`` stores the producer's unused groups and a
    restart with ``keep`` hands them back (``restored_queue``), which the new producer trains instead of rolling
    that step out again; ``drop`` stores none, and a restart with ``drop`` ignores a stored queue."""
    keep = _cfg(tiny_model, toy_rl, tmp_path / "run", kl_coef=0.0, stale_queue_on_resume="keep")
    tr = GRPOTrainer(keep, progress=False, log=lambda *_: None)
    tr.setup()
    queued = [[_episode("q", 0, [3], answer="the answer"), _episode("q", 1, [3], answer="another")]]
    lock = threading.Condition()
    tr.producer = SimpleNamespace(unused=lambda: AsyncRollouts.unused(SimpleNamespace(cv=lock,
                                                                                      done={4: (queued, 1.5)})))
    tr.step = 4
    path = tr.save()
    assert queued[0][0].answer == "the answer"
    assert load_rank_blobs(path, 0)["queue"][4][1] == 1.5

    again = GRPOTrainer(keep, progress=False, log=lambda *_: None)
    again.setup()
    assert again.step == 4 and list(again.restored_queue) == [4]
    groups, seconds = again.restored_queue[4]
    assert seconds == 1.5 and [e.id for e in groups[0]] == [e.id for e in queued[0]]
    assert [e.versions for e in groups[0]] == [[3], [3]] and [e.answer for e in groups[0]] == [None, None]
    assert groups[0][0].sequences == queued[0][0].sequences and groups[0][1].reward == queued[0][1].reward

    dropping = GRPOTrainer(keep.model_copy(update={"stale_queue_on_resume": "drop"}), progress=False,
                           log=lambda *_: None)
    dropping.setup()
    assert dropping.step == 4 and dropping.restored_queue is None
    dropping.producer = tr.producer
    dropping.step = 5
    assert "queue" not in load_rank_blobs(dropping.save(), 0)  # drop: nothing queued is stored

    # the producer a kept queue starts: step 4 trains the restored groups, only step 5 is rolled out
    fake = _FakeTrainer(steps=6, step=4)
    prod = AsyncRollouts(fake, [], restored=again.restored_queue)
    try:
        prod.train_step()
        prod.train_step()
    finally:
        prod.stop()
    assert fake.rolled_out == [5]
    assert fake.learned[0] is groups or fake.learned[0] == groups
    assert [g[0].prompt_id for g in fake.learned[1]] == ["s5"]
