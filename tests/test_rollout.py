"""Rollouts through the agent graph: exact tokens, masks, the pinned prefix, nFrames gating, the prompt cache."""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from paravt_agent.agent import Agent
from paravt_agent.policy.local import LocalPolicy
from paravt_agent.protocol import parse_tool_calls
from paravt_train.rewards import RewardConfig, base_format_reward
from paravt_train.rl.rollout import (
    PromptCache,
    PromptItem,
    RolloutError,
    RolloutSettings,
    assemble,
    episode_transcript,
    gate_frames,
    run_group,
)
from paravt_train.toy.build import toy_agent_config


@pytest.fixture(scope="module")
def toy(toy_policy_dir):
    policy = LocalPolicy(toy_policy_dir)
    cfg = toy_agent_config(**{"planner_sampling.temperature": 0.3, "subagent_sampling.temperature": 0.3,
                              "planner_sampling.max_new_tokens": 96, "subagent_sampling.max_new_tokens": 40})
    return Agent(policy=policy, config=cfg)


def _group(agent, world, q, n, G=2, seed=0, subagents=True):
    answer = [int(x) for x in q.span] if q.task == "tvg" else q.answer
    prompt = PromptItem(id=q.qid, video=world.video, question=q.question, options=q.options, answer=answer, task=q.task)
    settings = RolloutSettings(group=G, n_frames=n, reward=RewardConfig(), seed=seed, subagents=subagents)
    return agent.run(run_group(agent, PromptCache(agent), prompt, settings, agent.policy.eos_id))


def _vision_starts(tok, ids):
    return ids.count(tok.convert_tokens_to_ids("<|vision_start|>"))


def test_gate_frames_is_seeded_per_prompt():
    choices = [4, 8, 16, 32, 64]
    assert gate_frames(0, "p1", choices) == gate_frames(0, "p1", choices)  # stable: every rollout, every rank
    draws = Counter(gate_frames(0, f"p{i}", choices) for i in range(500))
    assert set(draws) == set(choices) and min(draws.values()) > 60  # uniform-ish over the set
    assert ([gate_frames(1, f"p{i}", choices) for i in range(20)]
            != [gate_frames(0, f"p{i}", choices) for i in range(20)])
    with pytest.raises(ValueError):
        gate_frames(0, "p", [])


def test_a_graph_that_raises_fails_its_episodes_and_the_group_goes_on(toy_rl):
    """A rollout whose graph raises before any planner turn (the server went away) is an episode failed with the
    reason and nothing to train on, one per sample; the group comes back whole (it raised a TypeError before)."""
    from paravt_agent.policy.scripted import ScriptedPolicy

    def script(role, messages):
        raise RuntimeError("the server went away")

    agent = Agent(policy=ScriptedPolicy(script), config=toy_agent_config())
    w = toy_rl["worlds"][0]
    q = next(q for q in w.questions if q.task == "mcq")
    prompt = PromptItem(id=q.qid, video=w.video, question=q.question, options=q.options, answer=q.answer, task=q.task)
    settings = RolloutSettings(group=3, n_frames=4, reward=RewardConfig(), seed=0)
    episodes = agent.run(run_group(agent, PromptCache(agent), prompt, settings, eos_id=0))
    assert [e.sample for e in episodes] == [0, 1, 2]
    assert all(e.failed == "RuntimeError: the server went away" and e.sequences == [] for e in episodes)
    assert all(e.reward.total == RewardConfig().min_total for e in episodes)


def test_planner_tokens_are_exact_and_tool_responses_masked(toy, toy_rl):
    w = toy_rl["worlds"][0]
    q = next(q for q in w.questions if q.task == "mcq")
    episodes = _group(toy, w, q, n=8)
    tok = toy.policy.processor.tokenizer
    with_tools = [e for e in episodes if e.tool_calls]
    assert with_tools, "the toy policy should call crop_video at n = 8"
    for ep in with_tools:
        planner = ep.sequences[0]
        gens = [(r.turn, r.generation) for r in ep.answer.planner_records()]
        assert len(gens) >= 2
        ids, mask = planner.input_ids, planner.loss_mask
        # every planner turn's sampled ids sit verbatim at their position; nothing else is trained
        trained = [i for i, m in enumerate(mask) if m]
        expect = []
        for _, g in gens:
            start = len(g.prompt_ids) + len(g.prefix_ids)
            assert ids[start : start + len(g.output_ids)] == g.output_ids
            assert ids[start - len(g.prefix_ids) : start] == g.prefix_ids  # the pinned prefix: context only
            assert all(mask[j] == 0 for j in range(start - len(g.prefix_ids), start))
            expect.extend(range(start, start + len(g.output_ids)))
        assert trained == expect
        # the K summaries enter once per tool turn, as ONE <tool_response> turn, outside the loss
        after_first = len(gens[0][1].prompt_ids)  # (the system prompt itself mentions the tag)
        assert tok.decode(ids[after_first:]).count("<tool_response>") == len(gens) - 1
        for (_, g), (_, nxt) in zip(gens, gens[1:], strict=False):
            end = len(g.prompt_ids) + len(g.prefix_ids) + len(g.output_ids)
            between = ids[end : len(nxt.prompt_ids)]
            assert tok.decode(between).count("<tool_response>") == 1
            assert all(mask[j] == 0 for j in range(end, len(nxt.prompt_ids)))
        # later turns continue from the earlier turn's ids: turn 2's prompt starts with turn 1's tokens
        g0, g1 = gens[0][1], gens[1][1]
        head = g0.prompt_ids + g0.prefix_ids + g0.output_ids
        assert g1.prompt_ids[: len(head)] == head
        # sub-agent sequences: their own prompt + the summary they sampled
        subs = [s for s in ep.sequences if s.role == "subagent"]
        assert len(subs) == ep.tool_calls
        for s in subs:
            assert s.n_trained == sum(s.loss_mask) > 0 and s.images


def test_behaviour_logprobs_match_a_training_forward(toy, toy_rl):
    """Recording is token-exact: re-scoring the assembled sequence gives the logprobs sampled with."""
    from paravt_train.rl.trainer import collate, token_logprobs

    w = toy_rl["worlds"][1]
    q = next(q for q in w.questions if q.task == "oe")
    ep = next(e for e in _group(toy, w, q, n=4) if e.tool_calls)
    batch = collate(ep.sequences, toy.policy.chat)
    with torch.no_grad():
        lp, _ = token_logprobs(toy.policy.model, batch, temperature=0.3)
    mask = batch["loss_mask"][:, 1:]
    diff = ((lp - batch["behaviour_logp"][:, 1:]).abs() * mask).max()
    assert float(mask.sum()) > 20 and float(diff) < 1e-3


def test_reward_sees_the_pinned_prefix(toy, toy_rl):
    w = toy_rl["worlds"][2]
    q = next(q for q in w.questions if q.task == "mcq")
    ep = _group(toy, w, q, n=8, G=2)[0]
    tok = toy.policy.processor.tokenizer
    planner = ep.sequences[0]
    sampled = tok.decode([t for t, m in zip(planner.input_ids, planner.loss_mask, strict=True) if m])
    first_gen = ep.answer.planner_records()[0].generation
    # the model never sampled the opening tag, yet the transcript the reward scores starts with it
    assert not tok.decode(first_gen.output_ids).startswith("<think>")
    assert ep.text.startswith("<think>\n") and "<think>" not in sampled.split("</think>")[0]
    assert ep.reward.base == pytest.approx(base_format_reward(ep.text))
    assert base_format_reward(ep.text) > base_format_reward(ep.text[len("<think>\n"):])


def test_all_rollouts_of_a_prompt_see_exactly_n_frames(toy, toy_rl):
    w = toy_rl["worlds"][0]
    q = next(q for q in w.questions if q.task == "tvg")
    tok = toy.policy.processor.tokenizer
    first_images = {}
    for n in (4, 16):
        eps = _group(toy, w, q, n=n, G=2)
        for ep in eps:
            first = ep.answer.planner_records()[0]
            assert _vision_starts(tok, first.generation.prompt_ids) == n  # n frames reached the model
            assert len(first.images) == n and len(ep.answer.trace.overview_timestamps) == n
            assert ep.n_frames == n
        first_images[n] = eps[0].answer.planner_records()[0].images
    # different n: frames from different moments (the research code's gating never changed them)
    t4 = toy.prepare(w.video, q.question, None, 4).trace.overview_timestamps
    t16 = toy.prepare(w.video, q.question, None, 16).trace.overview_timestamps
    assert len(first_images[4]) == 4 and len(first_images[16]) == 16 and not set(t4) >= set(t16)


def test_prompt_cache_is_keyed_by_video_question_and_n(toy, toy_rl, tmp_path):
    w = toy_rl["worlds"][3]
    video = tmp_path / "v.mp4"
    video.write_bytes(Path(w.video).read_bytes())
    cache = PromptCache(toy)
    a = cache.get(str(video), "What colour is shown at second 5?", None, 8)
    b = cache.get(str(video), "What colour is shown at second 5?", None, 8)
    assert a is b and (cache.hits, cache.misses) == (1, 1)
    c = cache.get(str(video), "What colour is shown at second 9?", None, 8)
    assert c is not a and "second 9" in c.messages[-1]["content"][-1]["text"]
    d = cache.get(str(video), "What colour is shown at second 5?", None, 16)
    assert d is not a and len(d.trace.overview_timestamps) == 16 and d.n_frames == 16
    e = cache.get(str(video), "What colour is shown at second 5?", ["A. red", "B. blue"], 8)
    assert e is not a
    time.sleep(0.01)
    os.utime(video)  # the file changed: its old prompts are not reused
    f = cache.get(str(video), "What colour is shown at second 5?", None, 8)
    assert f is not a and cache.misses == 5


def test_prompt_cache_is_bounded_by_bytes(toy, toy_rl):
    w = toy_rl["worlds"][1]
    one = PromptCache(toy).get(w.video, "What colour is shown at second 3?", None, 8)
    size = sum(p["image"].nbytes for m in one.messages if isinstance(m["content"], list)
               for p in m["content"] if p.get("type") == "image")
    cache = PromptCache(toy, capacity=100, max_bytes=int(2.5 * size))
    for t in range(3, 8):
        cache.get(w.video, f"What colour is shown at second {t}?", None, 8)
        assert cache.bytes <= cache.max_bytes
    assert len(cache._items) == 2 and cache.bytes == 2 * size  # the two most recent; frames bound it
    cache.get(w.video, "What colour is shown at second 7?", None, 8)
    assert cache.hits == 1


def test_prompt_cache_prepares_once_under_concurrent_use(toy, toy_rl):
    from concurrent.futures import ThreadPoolExecutor

    w = toy_rl["worlds"][2]
    cache = PromptCache(toy)
    calls = []
    real = toy.prepare

    def counting(*a, **kw):
        calls.append(1)
        time.sleep(0.05)  # long enough for every thread to arrive while the first prepares
        return real(*a, **kw)

    toy.prepare = counting
    try:
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda _: cache.get(w.video, "What colour is shown at second 7?", None, 4), range(8)))
    finally:
        del toy.prepare
    assert len(calls) == 1 and all(g is got[0] for g in got) and (cache.hits, cache.misses) == (7, 1)


def test_retokenised_turns_train_against_their_own_prompts(toy, toy_rl):
    """When a turn's prompt does not hold the earlier turn verbatim (a server that re-tokenises), each planner
    turn becomes its own sequence, its sampled ids scored against the prompt it really had."""
    w = toy_rl["worlds"][0]
    q = next(q for q in w.questions if q.task == "mcq")
    ep = next(e for e in _group(toy, w, q, n=8) if e.tool_calls)
    eos = toy.policy.eos_id
    merged, split = assemble(ep.answer, eos)
    assert split == 0 and [s.role for s in merged].count("planner") == 1
    last = ep.answer.planner_records()[-1].generation
    last.retokenized = True  # what the sglang backend records when the round trip changed the ids
    seqs, split = assemble(ep.answer, eos)
    planner = [s for s in seqs if s.role == "planner"]
    assert split == 1 and len(planner) == len(ep.answer.planner_records())
    for s, r in zip(planner, ep.answer.planner_records(), strict=True):
        g = r.generation
        head = len(g.prompt_ids) + len(g.prefix_ids)
        assert (s.input_ids == g.prompt_ids + g.prefix_ids + g.output_ids
                and s.loss_mask[head:] == [1] * len(g.output_ids))
        assert sum(s.loss_mask) == len(g.output_ids)
    ep.answer.records = [r for r in ep.answer.records if r.role != "planner"]
    with pytest.raises(RolloutError):
        assemble(ep.answer, eos)


def test_subagent_sequences_optional(toy, toy_rl):
    w = toy_rl["worlds"][1]
    q = next(q for q in w.questions if q.task == "mcq")
    eps = _group(toy, w, q, n=8, subagents=False)
    assert all(len(e.sequences) == 1 and e.sequences[0].role == "planner" for e in eps)
    assert all(s.episode == e.id for e in eps for s in e.sequences)
    assert any(parse_tool_calls(e.answer.trace.turns[0].text) for e in eps)
    ep = next(e for e in eps if e.tool_calls)
    assert episode_transcript(ep.answer).count("<tool_response>") == len(ep.answer.trace.turns) - 1


def test_rollout_token_ids_match_the_recorded_golden(toy_policy_dir, tmp_path):
    """The graph's refactors never change what RL trains on: on a fixed seed, every trained sequence (ids, mask,
    images, sampled tokens) of three toy groups equals the digest recorded before them
    (``tests/golden_rollouts.py``; summary and frames evidence, one and several tool turns)."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from golden_rollouts import CASES, agent_for, digest

    from paravt_train.toy.world import make_worlds

    golden = json.loads((Path(__file__).parent / "data" / "rollout_golden.json").read_text())
    world = make_worlds(range(910_000, 910_001), tmp_path / "videos")[0]
    policy = None
    for case in CASES:
        agent = agent_for(toy_policy_dir, case["layout"], policy)
        policy = agent.policy
        assert digest(agent, world, case) == golden[case["name"]], case["name"]
