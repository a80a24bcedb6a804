"""Answers must not depend on how busy the machine is (issue 44).

- An answer built on failed work (a sub-agent that timed out, a model call that failed) is never a clean one:
  ``status`` "degraded", ``ok`` False, each failure in ``trace.errors`` with where and why.
- Time budgets count work, not queueing: a sub-agent waiting in the local batcher's queue behind other questions'
  calls is not timed out for it; work that is slow itself still runs out of budget, and then the answer says so.
- Evaluations rerun what the runtime spoiled and count what stays failed apart from wrong answers.
- The local backend's batching is invisible to a row: greedy tokens identical to the row alone, logprobs within
  1e-4, for random batches of real toy prompts of every role.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time

import pytest

from paravt_agent.agent import Agent
from paravt_agent.config import AgentConfig
from paravt_agent.policy.base import text_of
from paravt_agent.policy.local import LocalPolicy
from paravt_agent.policy.scripted import ScriptedPolicy
from paravt_agent.types import Sampling
from paravt_train.toy.build import toy_agent_config
from paravt_train.toy.world import make_worlds
from tests.conftest import assert_same_tokens


class SlowPolicy(LocalPolicy):
    """The local backend on a slow machine: every batch takes ``delay`` seconds more (the model's step)."""

    delay = 0.0

    def _run_rows(self, rows, cancelled=None):
        time.sleep(self.delay)
        return super()._run_rows(rows, cancelled)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """Four toy worlds of seeds no script of the project uses: two MCQ, one open, one grounding question each."""
    return make_worlds(range(930_000, 930_004), tmp_path_factory.mktemp("load") / "videos", False, mcq=2, oe=1, tvg=1)


def items_of(worlds, n=8):
    return [{"video": w.video, "question": q.question, "options": q.options, "n_frames": n}
            for w in worlds for q in w.questions]


def test_an_answer_from_timed_out_subagents_is_degraded_and_says_why(toy_policy_dir, worlds):
    """The issue's reproduction: every sub-agent times out (0.05 s of work), the planner still writes an answer
    from the error slots; that answer is not ok, and the trace lists each failed call with its node and cause."""
    w = worlds[0]
    q = next(q for q in w.questions if q.task == "tvg")
    cfg = toy_agent_config(mode="parallel").override(["subagent_timeout=0.05", "retries=0",
                                                      "planner_sampling.max_new_tokens=160"])
    ans = Agent(policy=LocalPolicy(toy_policy_dir), config=cfg).answer(w.video, q.question, q.options, n_frames=8)
    failed = [c for c in ans.trace.all_calls() if c.runtime_error]
    assert failed and ans.trace.turns[-1].text  # the planner still answered
    assert not ans.ok and ans.status == "degraded" and not ans.trace.scorable
    assert ans.trace.failed_calls == len(failed) and len(ans.trace.errors) == len(failed)
    for c, e in zip(failed, ans.trace.errors, strict=True):
        assert e.startswith(f"turn 1 call {c.index + 1} (crop_video(") and "the subagent worked 0.05s" in e
    assert "Status: DEGRADED" in ans.trace.render()


def test_paravt_answer_says_degraded(toy_policy_dir, worlds):
    w = worlds[0]
    q = next(q for q in w.questions if q.task == "tvg")
    res = subprocess.run([sys.executable, "-m", "paravt_agent.cli", "answer", w.video, q.question,
                          "--model", toy_policy_dir, "--set", "subagent_timeout=0.05", "--set", "retries=0",
                          "--n-frames", "8", "--set", "planner_sampling.max_new_tokens=160"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 3, res.stderr
    assert "degraded answer" in res.stderr and "Status: DEGRADED" in res.stdout
    # what to raise, said with the warning, and the same run's --json carrying the status and the failed calls
    assert "to change: " in res.stderr and "raise subagent_timeout to 1 or more" in res.stderr
    res = subprocess.run([sys.executable, "-m", "paravt_agent.cli", "answer", w.video, q.question,
                          "--model", toy_policy_dir, "--set", "subagent_timeout=0.05", "--set", "retries=0",
                          "--n-frames", "8", "--set", "planner_sampling.max_new_tokens=160", "--json"],
                         capture_output=True, text=True, timeout=300)
    out = json.loads(res.stdout)
    assert res.returncode == 3 and out["status"] == "degraded" and out["ok"] is False
    assert out["failed_calls"] and all(c.startswith("turn 1 call ") for c in out["failed_calls"])
    assert out["advice"] and "subagent_timeout" in out["advice"][0]


def test_a_busy_model_gives_the_same_answers_only_slower(toy_policy_dir, worlds):
    """16 questions at once on a model whose every batch takes 0.5 s longer, four rows a batch: each sub-agent
    waits in the queue far longer than its 3 s budget, yet none times out (the budget counts its own batch's
    work), and every answer equals the quiet run's."""
    items = items_of(worlds)
    assert len(items) == 16
    quiet = Agent(policy=LocalPolicy(toy_policy_dir, max_batch=16), config=toy_agent_config(mode="parallel"))
    calm = quiet.answer_many(items, concurrency=16, progress=False)
    slow = SlowPolicy(toy_policy_dir, max_batch=4)
    slow.delay = 0.5
    cfg = toy_agent_config(mode="parallel").model_copy(update={"subagent_timeout": 3.0, "retries": 0})
    busy = Agent(policy=slow, config=cfg).answer_many(items, concurrency=16, progress=False)
    assert [a.status for a in calm] == ["ok"] * 16 and [a.status for a in busy] == ["ok"] * 16
    waited = max(c.latency for a in busy for c in a.trace.all_calls())
    assert waited > 3.0  # a sub-agent spent longer than its budget from dispatch to summary: queued, not failed
    assert [a.text for a in busy] == [a.text for a in calm]


def test_work_past_the_budget_is_flagged_never_answered_clean(toy_policy_dir, worlds):
    """When the work itself is slower than the budget (a batch takes 1.5 s, the budget is 1 s), the sub-agents
    fail and every answer is degraded (or failed), never ok."""
    slow = SlowPolicy(toy_policy_dir, max_batch=16)
    slow.delay = 1.5
    cfg = toy_agent_config(mode="parallel").model_copy(update={"subagent_timeout": 1.0, "retries": 0})
    answers = Agent(policy=slow, config=cfg).answer_many(items_of(worlds[:1])[:2], concurrency=2, progress=False)
    assert all(a.status != "ok" and a.trace.failed_calls > 0 for a in answers)
    assert all("timed out" in e for a in answers for e in a.trace.runtime_call_errors)


def test_evaluations_rerun_spoiled_items_and_count_the_rest_apart(media):
    """``paravt-train eval``'s scorer: an item whose sub-agent failed once is asked again and scored on the rerun;
    one that keeps failing is recorded ``failed`` and left out of the scores, with the table's error rate."""
    from paravt_train.benchmarks import EvalItem
    from paravt_train.eval import evaluate_items, results_table

    attempts: dict[str, int] = {}
    lock = threading.Lock()
    call = '<tool_call>{"name": "crop_video", "arguments": {"start_time": 0, "end_time": 6}}</tool_call>'

    def script(role, msgs):
        if role == "subagent":
            with lock:
                key = "flaky" if any("flaky" in text_of(m["content"]) for m in msgs) else "broken"
                attempts[key] = attempts.get(key, 0) + 1
                first = attempts[key] == 1
            if key == "broken" or first:
                from paravt_agent.errors import PolicyError

                raise PolicyError("the endpoint fell over")
            return "red"
        if "<tool_response>" in text_of(msgs[-1]["content"]):
            return "<think>read it</think><answer>A</answer>"
        return "<think>look</think>\n" + call

    agent = Agent(policy=ScriptedPolicy(script), config=AgentConfig(retries=0))
    items = [EvalItem(benchmark="toy", uid="a", video=media["video"], question="Is it flaky?", task="mcq",
                      answer="A", options=["red", "blue"]),
             EvalItem(benchmark="toy", uid="b", video=media["video"], question="Is it broken?", task="mcq",
                      answer="A", options=["red", "blue"])]
    recs = {r["uid"]: r for r in agent.run(evaluate_items(agent, items, concurrency=1, progress=False))}
    assert recs["a"]["tries"] == 2 and not recs["a"]["failed"] and recs["a"]["status"] == "ok"
    assert recs["b"]["tries"] == 2 and recs["b"]["failed"] and recs["b"]["status"] == "degraded"
    row = next(line for line in results_table(list(recs.values())).splitlines() if "| toy | all |" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3] == "100.0" and cells[-1] == "50.0%"  # b is not a wrong answer: it is an error


def test_a_degraded_answer_is_shown_by_the_api(media):
    """``paravt api``: a degraded answer is a 200 whose ``paravt`` says so (status, failed calls, the errors), or
    a 502 ``degraded_answer`` when the operator asks for that."""
    import httpx

    from paravt_agent.errors import PolicyError
    from paravt_agent.serving.api import ApiSettings, create_app

    call = '<tool_call>{"name": "crop_video", "arguments": {"start_time": 0, "end_time": 6}}</tool_call>'

    def script(role, msgs):
        if role == "subagent":
            raise PolicyError("the endpoint fell over")
        if "<tool_response>" in text_of(msgs[-1]["content"]):
            return "<think>nothing came back</think><answer>A</answer>"
        return "<think>look</think>\n" + call

    body = {"model": "paravt", "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "colours.mp4"}}, {"type": "text", "text": "Which colour?"}]}]}
    for degraded, status in (("answer", 200), ("error", 502)):
        app = create_app(Agent(policy=ScriptedPolicy(script), config=AgentConfig(retries=0)),
                         ApiSettings(video_root=str(media["dir"]), degraded=degraded))

        async def ask(app=app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                return await c.post("/v1/chat/completions", json=body)

        import asyncio

        r = asyncio.run(ask())
        assert r.status_code == status, r.text
        ext = r.json()["paravt"]
        assert ext["status"] == "degraded" and not ext["ok"] and ext["failed_calls"] == 1
        assert "fell over" in ext["errors"][0]
        if status == 502:
            assert r.json()["error"]["code"] == "degraded_answer"


# --------------------------------------------------------------------------- batching is invisible to a row


class _Recording(LocalPolicy):
    """The shipped policy, keeping every call the agent made (its messages, sampling, prefix, continuation)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls: list[tuple] = []

    async def generate(self, messages, sampling, prefix="", continuation=None, role="planner"):
        gen = await super().generate(messages, sampling, prefix, continuation, role)
        self.calls.append((role, messages, sampling, prefix, continuation))
        return gen


class _CancelAfter(threading.Event):
    """A cancellation that arrives after the batch has made ``steps`` decoding steps."""

    def __init__(self, steps: int):
        super().__init__()
        self.polls = steps

    def is_set(self) -> bool:
        self.polls -= 1
        return self.polls < 0


@pytest.mark.dtype
def test_a_row_samples_the_same_tokens_whatever_else_is_in_its_batch(toy_policy_dir, worlds, device, dtype,
                                                                     numeric_bound, record_property):
    """Property: for random batches of real toy prompts — planner first turns at n = 4, 8, 16 (different lengths and
    image counts), planner turns that continue their first turn (prefix-cache hits), sub-agents' crops,
    text-only rows, rows that stop early beside long ones, a row cancelled mid-batch — every row's greedy tokens
    equal the row run alone (no caches) and its logprobs agree within 1e-4 (float32; ``numeric_bound`` has each
    dtype's); the seeded sampled rows too."""
    bound = numeric_bound("batch", toy_policy_dir)
    rec = _Recording(toy_policy_dir, max_batch=8, device=device, dtype=dtype)
    for mode, n in (("parallel", 4), ("parallel", 16), ("none", 8)):
        Agent(policy=rec, config=toy_agent_config(mode=mode)).answer_many(
            items_of(worlds[:2], n)[::2], concurrency=4, progress=False)
    calls = [c for c in rec.calls]
    calls += [("text", [{"role": "user", "content": "What colour comes after red?"}], Sampling(), "<think>\n", None),
              ("text", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "A colour?"}],
               Sampling(), "", None)]
    roles = {c[0] for c in calls}
    assert {"planner", "subagent", "text"} <= roles and any(c[4] is not None for c in calls)
    alone = LocalPolicy(toy_policy_dir, reuse=False, model_obj=rec.model, processor=rec.processor)
    budget = 40

    def request(c, temperature=0.0, seed=None):
        s = c[2].model_copy(update={"max_new_tokens": budget, "stop": [], "temperature": temperature, "seed": seed})
        return (c[1], s, c[3], c[4])

    rng = random.Random(44)
    picks = [rng.sample(range(len(calls)), rng.randint(2, 6)) for _ in range(10)]
    sampled = {i: (1.0, 1000 + i) for pick in picks[::3] for i in pick[:1]}  # a seeded sampled row in some batches
    reference = {i: alone.generate_batch([request(calls[i], *sampled.get(i, (0.0, None)))])[0]
                 for i in {i for p in picks for i in p}}
    hits = rec.prefix_cache.hits
    lengths = set()
    worst = held = 0.0
    for k, pick in enumerate(picks):
        reqs = [request(calls[i], *sampled.get(i, (0.0, None))) for i in pick]
        rows = [(rec.encode(m, p, cont), s, p) for m, s, p, cont in reqs]
        cancel = [_CancelAfter(rng.randint(2, 8)) if k % 4 == 3 and j == 0 else threading.Event()
                  for j in range(len(rows))]
        out = rec._run_rows(rows, cancel)
        for j, (i, g) in enumerate(zip(pick, out, strict=True)):
            if isinstance(g, Exception):
                assert k % 4 == 3 and j == 0 and "cancelled" in str(g)
                continue
            want = reference[i]
            lengths.add(len(g.output_ids))
            # float32: the same tokens, logprobs within 1e-4; bf16: the same up to a near-tie (conftest)
            d, h = assert_same_tokens(g.output_ids, g.logprobs, want.output_ids, want.logprobs, bound)
            worst, held = max(worst, d), max(held, h)
    bound.check(record_property, worst, held)
    assert rec.prefix_cache.hits > hits  # continued planner turns reused their stored prefix in some batches
    assert min(lengths) < budget <= max(lengths)  # rows that stopped early beside rows that ran to the budget


def test_the_default_timeouts_are_idle_timeouts_on_heartbeats():
    """The graph's nodes use LangGraph's TimeoutPolicy counting work (idle, refreshed only by the heartbeats a
    queued model call sends), not a wall clock from the node's start."""
    from langgraph.types import TimeoutPolicy

    from paravt_agent.graph import build_graph

    graph = build_graph(1, 30.0, 7.0)
    timeout = graph.builder.nodes["subagent"].timeout
    assert isinstance(timeout, TimeoutPolicy) and timeout.idle_timeout == 7.0 and timeout.run_timeout is None
    assert timeout.refresh_on == "heartbeat"
    assert json.dumps(graph.builder.nodes["planner"].timeout.idle_timeout) == "30.0"
