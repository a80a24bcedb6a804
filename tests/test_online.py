"""Online learning you can leave running (issue 48): feedback that cannot be trained on is refused or skipped
with a counted reason, one user cannot dominate, the labels are what teaches, and a gate keeps a poisoned
candidate off the server (without the gate the served model gets worse)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paravt_agent.agent import Agent
from paravt_agent.errors import FeedbackError, ParaVTError
from paravt_agent.policy.scripted import ScriptedPolicy
from paravt_agent.store import TrajectoryStore
from paravt_agent.trajectory import Trace
from paravt_train.online.config import GateSettings, OnlineConfig
from paravt_train.online.gate import decide
from paravt_train.online.learner import OnlineLearner
from tests.learnable import QUESTION, TRAIN, build

BIN = Path(sys.executable).parent


def _mcq(store: TrajectoryStore, options=("red", "blue", "green", "cyan"), **kw) -> Trace:
    t = Trace(video="v.mp4", question="What colour is shown at second 4?", options=list(options), duration=40.0,
              answer="A", response="<answer>A</answer>", **kw)
    store.add(t)
    return t


def test_malformed_feedback_is_refused_where_it_is_written(tmp_path):
    """Each malformed row the held-out probe wrote is refused at write time with a clear error (the SDK and the
    store; the API and Gradio answer the same messages): an option letter that does not exist, E on a 4-option
    question, whitespace, a 1.1 MB answer, 'B ' × 500k, a span on an MCQ trace, control characters, the integer 3,
    a trace that does not exist; a second answer that conflicts with the first."""
    store = TrajectoryStore(tmp_path / "t.db")
    t = _mcq(store)
    bad = {"Z": "not an option", "E": "not an option", "   ": "empty", "x" * 1_100_000: "characters long",
           "B " * 500_000: "characters long", "[3, 7]": "not a time span", "B\x07": "control characters",
           3: "an answer is text", "purple": "not one of the options"}
    for answer, why in bad.items():
        with pytest.raises(FeedbackError, match=why):
            store.feedback(t.id, answer=answer, user="mallory")
    with pytest.raises(ParaVTError, match="no trace"):
        store.feedback("missing", answer="A")
    assert store.feedback_since(0) == []
    seq = store.feedback(t.id, answer="(b)", user="alice")  # a letter written loosely is stored as the letter
    assert store.feedback_since(0)[0]["answer"] == "B" and store.feedback_since(0)[0]["user_id"] == "alice"
    assert store.feedback(t.id, answer="blue", user="bob") > seq  # the option's text: the same answer, accepted
    with pytest.raises(FeedbackError, match="conflicts"):
        store.feedback(t.id, answer="C", user="mallory")
    with pytest.raises(FeedbackError, match="finite number"):
        store.feedback(t.id, reward=float("nan"))
    # grounding: a span within the video, nothing else
    g = Trace(video="v.mp4", question="When is the segment of colour red shown? Answer [start, end] in seconds.",
              duration=40.0)
    store.add(g)
    for answer in ("B", "red", "[10, 90]"):
        with pytest.raises(FeedbackError):
            store.feedback(g.id, answer=answer)
    assert store.feedback(g.id, answer="from 10 to 14") and store.feedback_since(0)[-1]["answer"] == "[10, 14]"
    # the SDK says who gave it; the same checks apply
    agent = Agent(policy=ScriptedPolicy(lambda role, msgs: ""), store=store)
    with pytest.raises(FeedbackError):
        agent.feedback(t.id, answer="Z", user="carol")
    # the idempotency key: a client retrying the same write (a lost connection) stores one row
    k1 = store.feedback(g.id, thumbs=True, key="retry-1")
    assert store.feedback(g.id, thumbs=True, key="retry-1") == k1


def test_the_learner_skips_what_it_cannot_train_on_and_limits_each_user(tmp_path, toy_policy_dir, toy_rl):
    """Rows written around the checks (an older writer, raw SQL) are skipped by the learner with a counted reason;
    one user's rows are capped per window and in each update's batch."""
    store = TrajectoryStore(tmp_path / "t.db")
    w = toy_rl["worlds"][0]
    q = next(q for q in w.questions if q.task == "mcq")
    traces = []
    for _ in range(8):
        t = Trace(video=w.video, question=q.question, options=q.options)
        store.add(t)
        traces.append(t)
    raw = ("INSERT INTO feedback (trace_id, created, answer, reward, thumbs, note, user_id, key) "
           "VALUES (?,?,?,?,?,?,?,?)")
    rows = [(traces[0].id, "Z", "old"), (traces[1].id, "[1, 2]", "old"), ("gone", "A", "old"),
            (traces[2].id, q.answer, "alice"), (traces[2].id, "A" if q.answer != "A" else "B", "bob"),
            (traces[3].id, None, "alice")]
    rows += [(traces[4 + k % 4].id, q.answer, "mallory") for k in range(6)]
    conn = store._conn()
    conn.execute("PRAGMA foreign_keys=OFF")
    for i, (tid, answer, user) in enumerate(rows):
        conn.execute(raw, (tid, 1000.0 + i, answer, None, None if answer else 1, None, user, f"k{i}"))
    cfg = OnlineConfig(model=toy_policy_dir, output_dir=str(tmp_path / "o"), video_root=toy_rl["video_root"],
                     prompts_per_step=4, online={"max_rows_per_user": 4, "max_user_share": 0.5})
    learner = OnlineLearner(cfg, store.path, progress=False, log=lambda *_: None)
    learner.trainer.setup()
    learner.poll()
    st = learner.state
    assert st.skipped_by == {"invalid answer": 2, "trace not found": 1, "conflicts with earlier feedback": 1,
                                "no answer": 1, "user over max_rows_per_user": 2}
    users = [d["user"] for d in st.queue]
    assert users.count("mallory") == 4 and users.count("alice") == 1
    batch = learner.take_batch()
    assert [d["user"] for d in batch].count("mallory") == 2 and len(batch) == 3  # half of 4 at most; alice's too


def test_the_gate_is_a_paired_non_inferiority_test():
    g = GateSettings(enabled=True, eval_set="x")  # margin unset: the smallest 40 questions support
    served = [1.0] * 20 + [0.0] * 20
    assert decide(list(served), served, g, "in-process").promote  # the same answers
    better = [1.0] * 30 + [0.0] * 10
    assert decide(better, served, g, "in-process").promote
    worse = [1.0] * 8 + [0.0] * 32  # 12 of 20 right answers lost
    res = decide(worse, served, g, "in-process")
    assert not res.promote and res.diff == pytest.approx(-0.3) and res.lower < -res.margin and res.n == 40
    assert res.test == "exact (Tango-ordered)"
    f1 = [0.5 + 0.01 * i for i in range(40)]
    res = decide([x - 0.02 for x in f1], f1, g, "in-process")  # F1: the paired t-test; a small loss passes
    assert res.promote and res.test == "paired t (Hall)"


def test_a_candidates_runtime_failures_count_against_it():
    """A candidate that fails half the questions in the runtime (``None``) and ties the rest is refused: its failures
    score 0 (they were left out of the pairs, and it passed)."""
    g = GateSettings(enabled=True, eval_set="x")
    served = [1.0] * 14 + [0.0] * 6
    candidate = [None] * 10 + [1.0] * 4 + [0.0] * 6
    res = decide(candidate, served, g, "in-process")
    assert not res.promote and res.n == 20 and res.failed == 10 and res.diff == pytest.approx(-0.5)


def test_the_gate_refuses_to_start_below_the_margin_its_questions_can_detect():
    from paravt_train.online.gate import GateSizeError, detectable_margin, gate_margin, questions_needed

    g = GateSettings(enabled=True, eval_set="x", margin=0.05)
    with pytest.raises(GateSizeError, match=r"needs (\d+) questions") as err:
        gate_margin(100, g, binary=True)
    need = questions_needed(0.05, g.confidence, g.power, g.discordance)
    assert f"needs {need} questions" in str(err.value) and 500 < need < 2000
    assert gate_margin(need, g, binary=True) == 0.05  # enough questions: the operator's margin
    auto = g.model_copy(update={"margin": None})
    assert gate_margin(100, auto, binary=True) == pytest.approx(detectable_margin(100, 0.9, 0.85, 0.3))
    with pytest.raises(GateSizeError, match="at least 20"):
        gate_margin(6, auto, binary=True)


def test_the_gate_meets_its_stated_error_rates():
    """At the defaults on 100 binary questions, versions disagreeing on 30 % of them (the planned discordance): an
    equally good candidate is refused at most 20 % of the time, one 2 × margin worse promoted at most 10 %
    (seeded simulation; perf/bench_online_decisions.py runs the full grid)."""
    import random

    g = GateSettings(enabled=True, eval_set="x")
    rng = random.Random(0)

    def version(flip, worse=0.0):  # sure right, sure wrong, or a coin flip per question
        return [1.0 if k == 0 else 0.0 if k == 1 else float(rng.random() < 0.5 - worse) for k in flip]

    refused = promoted = 0
    trials = 300
    for _ in range(trials):
        q = rng.choices([0, 1, 2], weights=[0.3, 0.1, 0.6], k=100)
        served = version(q)
        margin = decide(served, served, g, "sim").margin
        refused += not decide(version(q), served, g, "sim").promote
        promoted += decide(version(q, 2 * margin / 0.6), served, g, "sim").promote
    assert refused / trials <= 0.2 and promoted / trials <= 0.1, (refused, promoted)


def test_losses_cannot_creep_past_the_starting_version():
    """Each candidate a little worse than the one before: against the served version alone this one passes; the
    comparison with the starting version stops it."""
    g = GateSettings(enabled=True, eval_set="x")
    start = [1.0] * 150 + [0.0] * 50
    served = [1.0] * 138 + [0.0] * 62  # passed its own gate against the start
    candidate = [1.0] * 126 + [0.0] * 74
    assert decide(served, start, g, "in-process").promote
    assert decide(candidate, served, g, "in-process").promote  # a small step from the served version
    res = decide(candidate, served, g, "in-process", start=start, start_id="v0")
    assert not res.promote and res.start["id"] == "v0" and res.start["lower"] < -res.margin < res.lower


def _worst_promotion_rate(n: int, margin: float, g: GateSettings) -> float:
    """The exact rate at which the gate promotes a candidate exactly ``margin`` worse than the served version on
    ``n`` binary questions (every ``(wins, losses)`` enumerated), the worst over the share of questions on which
    the two disagree (the nuisance: 1 %–100 %)."""
    import numpy as np

    w, loss = np.nonzero(np.add.outer(np.arange(n + 1), np.arange(n + 1)) <= n)
    promoted = np.array([decide(*_pair(n, int(a), int(b)), g, "sim", margin=margin).promote
                         for a, b in zip(w, loss, strict=True)])
    logf = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, n + 1)))])
    coef = logf[n] - logf[w] - logf[loss] - logf[n - w - loss]
    worst = 0.0
    for share in np.linspace(margin + 0.01, 1.0, 60):
        p_win = (share - margin) / 2
        p_loss, p_tie = p_win + margin, 1 - share
        logp = (coef + w * np.log(max(p_win, 1e-300)) + loss * np.log(p_loss)
                + (n - w - loss) * np.log(max(p_tie, 1e-300)))
        worst = max(worst, float(np.exp(logp)[promoted].sum()))
    return worst


def _pair(n: int, wins: int, losses: int) -> tuple[list, list]:
    """Candidate and served scores on ``n`` questions: the candidate alone right on ``wins``, alone wrong on
    ``losses``, both right on the rest."""
    cand = [1.0] * wins + [0.0] * losses + [1.0] * (n - wins - losses)
    served = [0.0] * wins + [1.0] * losses + [1.0] * (n - wins - losses)
    return cand, served


def test_a_candidate_one_margin_worse_is_promoted_at_most_1_minus_confidence_at_small_n():
    """The stated level, ``1 − confidence`` (10 %), for a candidate exactly one margin worse, at n = 20 and 30:
    binary scores computed exactly over every outcome, the worst over how often the versions disagree (before,
    Tango's normal approximation: 12.9 % at n = 30); F1/IoU-like scores that are zero-inflated and skewed (a
    worse candidate misses a few questions outright), simulated (before, the plain paired t-test: 11.7 % at
    n = 50)."""
    import numpy as np

    from paravt_train.online.gate import gate_margin

    g = GateSettings(enabled=True, eval_set="x")
    for n in (20, 30):
        rate = _worst_promotion_rate(n, gate_margin(n, g, True), g)
        assert rate <= 0.1 + 1e-9, (n, rate)

    rng = np.random.default_rng(0)
    n, trials = 50, 4000
    margin = gate_margin(n, g, binary=False)

    def score(size):  # a miss (0) one time in five, else a Beta(5, 1.5) overlap: mean 0.615, skewed
        return np.where(rng.random(size) < 0.2, 0.0, rng.beta(5, 1.5, size))

    promoted = 0
    for _ in range(trials):
        unsettled, shared = rng.random(n) < 0.1, score(n)  # the versions disagree on a tenth of the questions
        served = np.where(unsettled, score(n), shared)
        worse = np.where(rng.random(n) < margin / 0.615, 0.0, np.where(unsettled, score(n), shared))
        promoted += decide(list(worse), list(served), g, "sim").promote
    assert promoted / trials <= 0.1, promoted / trials


def test_each_gate_records_its_discordance_and_warns_past_the_planned_one():
    """Versions that disagree on half the pinned questions (the margin was sized for 30 %): the gate records the
    discordance it saw and the refusal rate of an equally good candidate that applies there (above the stated
    15 %), and warns with it; at 10 % it records the same and says nothing."""
    g = GateSettings(enabled=True, eval_set="x")
    cand, served = _pair(100, 25, 25)
    res = decide(cand, served, g, "sim", start=served)
    assert res.observed == pytest.approx(0.5) and res.planned == 0.3 and res.refusal_rate > 0.15
    assert f"refused about {res.refusal_rate:.0%} of the time here, not 15%" in res.warning
    assert "discordance 0.50" in res.warning and res.as_dict()["warning"] == res.warning
    cand, served = _pair(100, 5, 5)
    calm = decide(cand, served, g, "sim", start=served)
    assert calm.observed == pytest.approx(0.1) and calm.warning == "" and calm.refusal_rate < 0.15


def test_the_automatic_margin_sizes_itself_from_the_discordance_the_last_gates_observed(tmp_path):
    """Chains of equally good candidates whose versions disagree on 50 % of 50 pinned questions: with the margin
    sized at the planned 30 % a later candidate is refused about 30 % of the time; sized at the mean discordance
    the last gates observed, within the stated 15 % (+ noise). Through the learner's promotion: earlier gates that
    observed 0.5 widen the next gate's margin, recorded with the discordance it was sized at."""
    import dataclasses
    import random

    from paravt_train.data import PromptItem
    from paravt_train.online.gate import gate_margin, sized_discordance

    g = GateSettings(enabled=True, eval_set="x")
    assert sized_discordance([0.5] * 5, g) == 0.5 and sized_discordance([0.1, 0.2], g) == 0.3
    assert sized_discordance([0.5] * 5, g.model_copy(update={"margin": 0.3})) == 0.3  # the operator's: kept
    assert sized_discordance([0.5] * 5, g.model_copy(update={"discordance_window": 0})) == 0.3
    rng = random.Random(0)

    def version():  # every question a coin flip for every version: equal versions disagree on half of them
        return [float(rng.random() < 0.5) for _ in range(50)]

    refused = {"planned": 0, "observed": 0}
    seen: list[float] = []
    trials = 150
    for _ in range(trials):
        served, start, cand = version(), version(), version()
        refused["planned"] += not decide(cand, served, g, "sim", start=start).promote
        res = decide(cand, served, g, "sim", start=start, planned=sized_discordance(seen, g))
        refused["observed"] += not res.promote
        seen.append(res.observed)
    assert refused["planned"] / trials >= 0.22 and refused["observed"] / trials <= 0.2, refused

    p = _stub_promotion(tmp_path, {"gate": {"enabled": True, "eval_set": "pinned.parquet"}})
    p.port = dataclasses.replace(p.port, step=lambda: 9)
    prompts = [PromptItem(id=f"q{i}", video=f"v{i}.mp4", question="Which colour?", options=["A. red", "B. blue"],
                          answer="A", task="mcq") for i in range(40)]
    p._pool = lambda: (prompts, [])
    scores = {"v0": [1.0] * 20 + [0.0] * 20, "v9": [1.0] * 10 + [0.0] * 10 + [1.0] * 10 + [0.0] * 10}
    p._scores = lambda path, prompts_=None: scores[Path(path).name]
    reg = p.registry
    reg.add("v0", 0, reg.root / "v0", "candidate")
    reg.set_serving("v0", reason="start")
    for k in range(1, 6):  # earlier candidates whose gates saw the versions disagree on half the questions
        reg.add(f"v{k}", k, reg.root / f"v{k}", "refused", gate={"observed": 0.5})
    start_margin = p.size_gate()
    p.promote_candidate()
    gate = json.loads((tmp_path / "online_events.jsonl").read_text().splitlines()[-1])["gate"]
    wide = gate_margin(40, g.model_copy(update={"discordance": 0.5}), True)
    assert gate["planned"] == 0.5 and gate["margin"] == pytest.approx(wide) and wide > start_margin
    assert gate["observed"] == pytest.approx(0.5) and gate["warning"] == ""


def test_the_pinned_hash_covers_the_evaluation_protocol(tmp_path):
    """Scores stored under one evaluation protocol are not reused under another: the hash of the pinned set
    changes with the evaluation agent (its protocol, sampling, budgets) and the gate's evaluation settings, and a
    reference scored before is scored again (before, only the questions and n_frames counted)."""
    import dataclasses

    from paravt_agent.config import AgentConfig
    from paravt_train.data import PromptItem

    prompts = [PromptItem(id=f"q{i}", video=f"v{i}.mp4", question="Which colour?", options=["A. red", "B. blue"],
                          answer="A", task="mcq") for i in range(20)]

    def promotion(sub: str, agent=AgentConfig, **gate):
        p = _stub_promotion(tmp_path / sub, {"gate": {"enabled": True, "eval_set": "pinned.parquet", **gate}})
        p.port = dataclasses.replace(p.port, eval_agent_config=agent)
        p._pool = lambda: (prompts, [])
        return p

    base = promotion("a").pinned()[1]
    assert promotion("b").pinned()[1] == base  # the same set, scored the same way
    sampled = AgentConfig().planner_sampling.model_copy(update={"max_new_tokens": 256})
    changed = {
        "budget": promotion("c", lambda: AgentConfig(planner_sampling=sampled)),
        "turns": promotion("d", lambda: AgentConfig(max_turns=AgentConfig().max_turns + 1)),
        "frames": promotion("e", n_frames=8),
        "mode": promotion("f", mode="shadow", shadow_endpoint="http://127.0.0.1:1"),
    }
    for what, p in changed.items():
        assert p.pinned()[1] != base, what
    assert promotion("g", lambda: AgentConfig(max_concurrency=3)).pinned()[1] == base  # throughput only
    p = changed["budget"]
    p._scores = lambda path, prompts_=None: [1.0] * len(prompts_)
    p.registry.add("v0", 0, tmp_path / "v0", "candidate", gate={"scores": [0.0] * 20, "pinned": base})
    assert p.reference_scores(p.registry.get("v0")) == [1.0] * 20  # taken again under the new protocol

def _stub_promotion(tmp_path, online=None):
    """A Promotion over a real registry, without a trainer: a port whose weights calls do nothing."""
    from paravt_agent.config import AgentConfig
    from paravt_train.online.promotion import Promotion, TrainerPort
    from paravt_train.online.state import OnlineState
    from paravt_train.online.versions import VersionRegistry

    cfg = OnlineConfig(model="m", output_dir=str(tmp_path), online=online or {})
    port = TrainerPort(step=lambda: 0, rank=0, world=1, out=tmp_path, export=lambda p: p, load_weights=lambda p: None,
                       push=lambda: None, eval_agent_config=AgentConfig, log_metrics=lambda *_: None)
    return Promotion(port, VersionRegistry(tmp_path / "versions"), cfg, OnlineState(), log=lambda *_: None)


def test_missing_or_stale_served_scores_are_taken_again(tmp_path):
    """The served version has no stored scores (the gate turned on later, an operator's promote) or scores of
    another pinned set: they are taken again from its weights and stored with the set's hash — not an error."""
    from paravt_train.data import PromptItem

    gate = {"enabled": True, "eval_set": "pinned.parquet"}
    p = _stub_promotion(tmp_path, {"gate": gate})
    prompts = [PromptItem(id=f"q{i}", video=f"v{i}.mp4", question="Which colour?", options=["A. red", "B. blue"],
                          answer="A", task="mcq") for i in range(20)]
    p._pool = lambda: (prompts, [])
    scored = []
    p._scores = lambda path, prompts_=None: scored.append(str(path)) or [1.0] * len(prompts_)
    reg = p.registry
    reg.add("v0", 0, tmp_path / "v0", "candidate")  # no gate record
    reg.add("v1", 1, tmp_path / "v1", "candidate", gate={"scores": [0.0] * 20, "pinned": "another set"})
    h = p.pinned()[1]  # the set and how it is scored
    reg.add("v2", 2, tmp_path / "v2", "candidate", gate={"scores": [0.0] * 20, "pinned": h})
    assert p.reference_scores(reg.get("v0")) == [1.0] * 20
    assert p.reference_scores(reg.get("v1")) == [1.0] * 20
    assert p.reference_scores(reg.get("v2")) == [0.0] * 20  # current: kept
    assert scored == [str(tmp_path / "v0"), str(tmp_path / "v1")]
    assert reg.get("v0")["gate"]["pinned"] == h and reg.get("v1")["gate"]["scores"] == [1.0] * 20


def _labels(**users) -> dict:
    """Live counts ``{user: [sum, sum of squares, labels]}`` from ``user=(right, labels)`` (binary scores)."""
    return {u: [float(a), float(a), n] for u, (a, n) in users.items()}


def test_one_user_cannot_force_a_rollback():
    from paravt_train.online.config import RollbackSettings
    from paravt_train.online.promotion import rollback_decision

    r = RollbackSettings()
    before = _labels(a=(8, 10), b=(8, 10), c=(8, 10), d=(8, 10))  # 0.8
    honest = dict(a=(8, 10), b=(8, 10), c=(8, 10), d=(8, 10))
    # mallory labels every answer of the served version wrong: capped or not, the decision must not hang on her
    attacked = rollback_decision(_labels(**honest, mallory=(0, 40)), before, r)
    assert attacked.tested and attacked.z > attacked.critical and not attacked.rollback
    assert "mallory" in attacked.why
    assert not rollback_decision(_labels(mallory=(0, 60)), before, r).tested  # one user is no quorum
    worse = rollback_decision(_labels(a=(3, 10), b=(3, 10), c=(4, 10), d=(3, 10)), before, r)
    assert worse.rollback  # every user sees it


def test_rollbacks_are_rare_for_an_equally_good_version():
    """Checked after every 4 labels, the planned looks keep false rollbacks at most alpha (0.05)."""
    import random

    from paravt_train.online.config import RollbackSettings
    from paravt_train.online.promotion import rollback_look

    r = RollbackSettings()
    rng = random.Random(0)
    rolled = 0
    trials = 300
    for _ in range(trials):
        before: dict = {}
        for _ in range(200):
            c = before.setdefault(f"u{rng.randrange(20)}", [0.0, 0.0, 0])
            s = float(rng.random() < 0.6)
            if c[2] < r.max_labels_per_user:
                c[0], c[1], c[2] = c[0] + s, c[1] + s, c[2] + 1
        cur: dict = {}
        looks = 0
        for i in range(200):
            c = cur.setdefault(f"u{rng.randrange(20)}", [0.0, 0.0, 0])
            s = float(rng.random() < 0.6)
            if c[2] < r.max_labels_per_user:
                c[0], c[1], c[2] = c[0] + s, c[1] + s, c[2] + 1
            if i % 4 == 3:
                looks, chk = rollback_look(cur, before, looks, r)
                if chk is not None and chk.rollback:
                    rolled += 1
                    break
    assert rolled / trials <= 0.05, rolled


def test_after_a_rollback_the_next_version_is_compared_with_the_one_served_before_it(tmp_path):
    """v2 was rolled back to v1; v3 (live 0.65) is compared with v1 (0.80), not with the rolled-back v2 (0.60)."""
    import time as _time

    p = _stub_promotion(tmp_path, {"rollback": {"min_rows": 20, "looks": 1}})
    reg = p.registry
    for k in range(4):
        reg.add(f"v{k}", k, tmp_path / f"v{k}", "candidate")
    for vid, why in (("v0", "start"), ("v1", "promoted"), ("v2", "promoted"), ("v1", "rollback: v2 worse"),
                     ("v3", "promoted")):
        reg.set_serving(vid, reason=why)
        _time.sleep(0.01)
    assert reg.served_before("v3")["id"] == "v1" and reg.served_before("v1") is None
    live = p.state.live
    live["v1"] = _labels(a=(8, 10), b=(8, 10), c=(8, 10), d=(8, 10))
    live["v2"] = _labels(a=(6, 10), b=(6, 10), c=(6, 10), d=(6, 10))
    live["v3"] = _labels(a=(5, 10), b=(5, 10), c=(5, 10), d=(5, 10), e=(6, 10), f=(6, 10))
    back = []
    p.rollback_to = lambda version, why, judged=None: back.append((version["id"], why)) or version["id"]
    assert p.check_rollback() == "v1" and "below v1's 0.80" in back[0][1]
    assert p.check_rollback() is None  # its one look is used up


def test_a_version_that_cannot_be_rolled_back_says_so_once(tmp_path):
    """Promotions faster than labels: the version before the served one stopped serving with too few labels, so
    the served one cannot be tested; that is an event (once), not a silent no."""
    import json as _json
    import time as _time

    p = _stub_promotion(tmp_path, {"rollback": {"min_rows": 20}})
    for vid, why in (("v0", "start"), ("v1", "promoted")):
        p.registry.add(vid, 0, tmp_path / vid, "candidate")
        p.registry.set_serving(vid, reason=why)
        _time.sleep(0.01)
    p.state.live["v0"] = _labels(a=(3, 4))
    p.state.live["v1"] = _labels(a=(2, 10), b=(2, 10), c=(2, 10))
    assert p.check_rollback() is None and p.check_rollback() is None
    events = [_json.loads(x) for x in (tmp_path / "online_events.jsonl").read_text().splitlines()]
    said = [e for e in events if e["event"] == "rollback-untestable"]
    assert len(said) == 1 and said[0]["version"] == "v1" and "4 from 1" in said[0]["reason"]


def test_live_labels_count_after_the_per_user_limits_in_the_gates_units(tmp_path, toy_policy_dir, toy_rl):
    """A user's rows over ``max_rows_per_user`` are no labels either, one user's labels per version are capped, and
    a label scores the answer with the gate's metric (F1 for an open-ended answer, not ≥ 0.5 → 1)."""
    store = TrajectoryStore(tmp_path / "t.db")
    cfg = OnlineConfig(model=toy_policy_dir, output_dir=str(tmp_path / "o"), video_root=toy_rl["video_root"],
                     online={"max_rows_per_user": 12, "rollback": {"max_labels_per_user": 10}})
    learner = OnlineLearner(cfg, store.path, progress=False, log=lambda *_: None)
    learner.trainer.setup()
    learner.registry.add("v0", 0, toy_policy_dir, "candidate")
    learner.registry.set_serving("v0", reason="start")
    video = toy_rl["worlds"][0].video
    for i in range(20):
        t = Trace(video=video, question="What colour is the car?", response="<answer>blue car</answer>")
        store.add(t)
        store.feedback(t.id, answer="blue" if i else "blue car", user="mallory" if i else "alice")
        if i == 0:
            first = t
    store.feedback(first.id, answer="blue car", user="alice")  # the same label again: one answer, one label
    learner.poll()
    live = learner.state.live["v0"]
    assert live["mallory"][2] == 10 and live["alice"] == [1.0, 1.0, 1]
    assert live["mallory"][0] == pytest.approx(10 * 2 / 3)  # token F1 of "blue car" against "blue"


@pytest.fixture(scope="module")
def learnable(tmp_path_factory):
    d = tmp_path_factory.mktemp("online")
    blue = build(d, majority="blue", minority="red")
    red = build(d, majority="red", minority="blue", base=blue["base"])
    return {"dir": d, "blue": blue["sft"], "red": red["sft"]}


def _gate_set(learnable) -> str:
    """The gate's pinned set: the held-out videos' questions five times over (20 questions, the fewest the gate's
    tests accept; greedy answers repeat, so this set is as informative as 4 questions with a 4× weight)."""
    from paravt_train.data import write_parquet
    from tests.learnable import HELD, rl_rows

    path = learnable["dir"] / "gate20.parquet"
    if not path.is_file():
        rows = [{**row, "id": f"{row['id']}-{k}"} for k in range(5) for row in rl_rows(HELD)]
        write_parquet(rows, path)
    return str(path)


def _served(learnable, tmp_path, model, feedback: list[tuple[str, str]]) -> Path:
    """A store holding one answered trace per feedback row: ``(user, answer)``, the videos taken in turn."""
    d = learnable["dir"]
    store = TrajectoryStore(tmp_path / "traces.db")
    for i, (user, answer) in enumerate(feedback):
        t = Trace(video=str(d / f"v{TRAIN[i % len(TRAIN)]}.mp4"), question=QUESTION, answer="blue",
                  response="<answer>blue</answer>")
        store.add(t)
        store.feedback(t.id, answer=answer, user=user)
    return store.path


def _learn(learnable, tmp_path, start, feedback, steps, **online) -> OnlineLearner:
    d = learnable["dir"]
    # lr 6e-4 with the KL term: at 1e-3 without it the tiny policy can collapse (format lost) whatever the labels
    cfg = OnlineConfig(model=start, output_dir=str(tmp_path / "learner"), video_root=str(d), prompts_per_step=3,
                     group_size=8, max_new_tokens=24, temperature=1.0, lr=6e-4, save_every=100, concurrency=3, seed=0,
                     gating=False, resume=False, online=online)
    learner = OnlineLearner(cfg, _served(learnable, tmp_path, start, feedback), progress=False, log=lambda *_: None)
    assert learner.run(max_steps=steps, once=True) == steps
    return learner


def _accuracy(model_dir, learnable, answer="red") -> float:
    from tests.learnable import heldout

    scores = heldout(Agent(model=str(model_dir)), learnable["dir"], answer)
    return sum(scores) / len(scores)


def test_the_labels_are_what_teaches(learnable, tmp_path):
    """From a start that answers "blue" (the truth is "red"), the users' honest labels move the served answers to
    "red"; the same run with wrong labels ("blue") gains nothing — the format and the other reward terms are the
    same for both words, so only the labels can carry the answer."""
    start = learnable["blue"]
    assert _accuracy(start, learnable) <= 0.25
    honest = _learn(learnable, tmp_path / "honest", start, [(f"u{i % 3}", "red") for i in range(48)], 16)
    wrong = _learn(learnable, tmp_path / "wrong", start, [(f"u{i % 3}", "blue") for i in range(48)], 16)
    gain_honest = _accuracy(honest.registry.serving()["path"], learnable)
    gain_wrong = _accuracy(wrong.registry.serving()["path"], learnable)
    assert gain_honest >= 0.75 and gain_wrong <= 0.25, (gain_honest, gain_wrong)


def test_a_gate_keeps_poisoned_candidates_off_the_server(learnable, tmp_path):
    """The served policy answers "red" (right). Two adversarial users say "blue" beside an honest one. With the
    gate, the candidates trained on the poison are refused and the served version never scores below the start by
    more than the margin; without it the served model gets worse — the gate is what holds it."""
    start = learnable["red"]
    d = learnable["dir"]
    before = _accuracy(start, learnable)
    assert before >= 0.75
    stream = [("alice", "red") if i % 3 == 0 else (f"mallory{i % 3}", "blue") for i in range(48)]
    gate = {"enabled": True, "eval_set": _gate_set(learnable), "video_root": str(d)}  # margin: what 20 can hold
    gated = _learn(learnable, tmp_path / "gated", start, stream, 16, gate=gate, rollback={"enabled": False})
    open_ = _learn(learnable, tmp_path / "open", start, stream, 16)
    versions = gated.registry.versions()
    refused = [v for v in versions if v["status"] == "refused"]
    served = [v for v in versions if v["promoted_at"] is not None]
    assert refused, versions
    assert all(v["gate"]["candidate"] >= before - 0.1 for v in served if "candidate" in v["gate"])
    assert _accuracy(gated.registry.serving()["path"], learnable) >= before - 0.1
    assert _accuracy(open_.registry.serving()["path"], learnable) < before - 0.1
    # the operator's view, and their one-command rollback
    cfg_file = tmp_path / "open.yaml"
    cfg_file.write_text(json.dumps(open_.cfg.model_dump(mode="json")))
    out = subprocess.run([BIN / "paravt-train", "online", "versions", "--config", str(cfg_file)], capture_output=True,
                         text=True, check=True).stdout
    assert "v0" in out and "serving" in out
    res = subprocess.run([BIN / "paravt-train", "online", "rollback", "v0", "--config", str(cfg_file)],
                         capture_output=True, text=True)
    assert res.returncode == 0 and "v0 now serves" in res.stdout, res.stderr
    assert open_.registry.serving()["id"] == "v0"
    status = json.loads(subprocess.run([BIN / "paravt-train", "online", "status", "--config", str(cfg_file), "--json"],
                                       capture_output=True, text=True, check=True).stdout)
    assert status["serving"]["id"] == "v0" and status["step"] == 16


def test_automatic_rollback_on_live_feedback(learnable, tmp_path):
    """The served version's answers, labelled by the users' feedback, are worse than the previous version's:
    the previous version goes back, and the learner says why."""
    start = learnable["red"]
    learner = _learn(learnable, tmp_path / "live", start, [("alice", "red")] * 3, 1)
    reg = learner.registry
    assert reg.serving()["id"] == "v1"
    live = learner.state.live
    # the labels of each version's own answers, by user (four users, ten labels each)
    live["v0"] = _labels(a=(9, 10), b=(9, 10), c=(9, 10), d=(9, 10))
    live["v1"] = _labels(a=(2, 10), b=(3, 10), c=(2, 10), d=(3, 10))
    assert learner.promotion.check_rollback() == "v0"
    assert reg.serving()["id"] == "v0" and reg.get("v1")["status"] == "rolled-back"
    assert "live score of v1 0.25" in reg.serving()["reason"]
    assert json.loads((Path(learner.cfg.output_dir) / "online_events.jsonl").read_text().splitlines()[-1])[
        "event"] == "rolled-back"


def test_a_store_that_went_away_raises_the_typed_error(postgres_db, tmp_path):
    """PostgreSQL drops the connection (a restart): the call in flight raises StoreError saying it may be retried,
    never psycopg's raw error, and the next call reconnects."""
    import psycopg

    from paravt_agent.errors import StoreError

    store = TrajectoryStore(postgres_db)
    t = Trace(video="v.mp4", question="q", options=["a", "b"])
    store.add(t)
    pid = store._execute("SELECT pg_backend_pid()")[0][0]
    with psycopg.connect(postgres_db, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    with pytest.raises(StoreError) as err:
        store.get(t.id)
    assert err.value.retryable and "went away" in str(err.value)
    assert store.get(t.id).id == t.id  # reconnected
    # a feedback write that meets a dropped connection is retried once with its key: one row
    pid = store._execute("SELECT pg_backend_pid()")[0][0]
    with psycopg.connect(postgres_db, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    assert store.feedback(t.id, answer="A", key="once") and len(store.feedback_since(0)) == 1


def test_lora_online_versions_are_adapters(learnable, tmp_path, json_server):
    """With ``lora.enabled`` the learner trains adapters only; each version it keeps is the adapter (a small
    fraction of the model's bytes), the gate evaluates it merged into the base, a refused candidate reverts the
    adapter, and a push swaps the adapter in by name on the server (unload → load, no pause: SGLang drains the
    adapter's requests before it unloads, which a paused server would never let happen)."""
    d = learnable["dir"]
    srv = json_server(lambda path, body: (200, {"success": True, "workers": []} if path == "/workers"
                                          else {"success": True}))
    stream = [(f"u{i % 3}", "red") for i in range(6)]
    gate = {"enabled": True, "eval_set": _gate_set(learnable), "video_root": str(d), "margin": 0.5}
    cfg = OnlineConfig(model=learnable["blue"], output_dir=str(tmp_path / "learner"), video_root=str(d),
                     prompts_per_step=3, group_size=4, max_new_tokens=24, temperature=1.0, lr=6e-4, save_every=100,
                     concurrency=3, seed=0, gating=False, resume=False, lora={"enabled": True, "r": 4, "alpha": 8},
                     backend="sglang", endpoint=srv.url, sync={"via": "lora"}, online={"gate": gate})
    from paravt_train.online.versions import VersionRegistry, push_version

    # the learner itself rolls out in this process here (the recording server generates nothing): local backend
    disk = cfg.sync.model_copy(update={"via": "disk"})
    local = cfg.model_copy(update={"backend": "local", "endpoint": None, "sync": disk})
    learner = OnlineLearner(local, _served(learnable, tmp_path, local.model, stream), progress=False,
                            log=lambda *_: None)
    assert learner.run(max_steps=2, once=True) == 2
    tr = learner.trainer
    trainable = sum(p.numel() for p in tr.model.parameters() if p.requires_grad)
    assert 0 < trainable < 0.1 * sum(p.numel() for p in tr.model.parameters())
    reg = VersionRegistry(tmp_path / "learner" / "versions")
    versions = reg.versions()
    assert [v["id"] for v in versions] == ["v0", "v1", "v2"]
    model_bytes = sum(f.stat().st_size for f in Path(learnable["blue"]).glob("*.safetensors"))
    for v in versions:
        files = list(Path(v["path"]).iterdir())
        assert {f.name for f in files} == {"adapter_config.json", "adapter_model.safetensors"}
        assert sum(f.stat().st_size for f in files) < 0.1 * model_bytes
        assert "candidate" in v["gate"]
    push_version(cfg, versions[-1])  # the adapter onto a server, by name
    assert srv.paths[-3:] == ["/unload_lora_adapter", "/load_lora_adapter", "/update_weight_version"]
    assert "/pause_generation" not in srv.paths and srv.bodies[-1] == {
        "new_version": versions[-1]["weight_version"], "abort_all_requests": False}  # the version, nothing aborted
    load = srv.bodies[-2]
    # the server loads the name from one link, switched to each version before the swap
    link = Path(versions[-1]["path"]).resolve().parent / ".served-paravt"
    assert load["lora_name"] == "paravt" and load["lora_path"] == str(link)
    assert link.resolve() == Path(versions[-1]["path"]).resolve()


def _text_logprobs(ids: list[int], server=None, lora: str | None = None, model=None) -> list[float]:
    """Log-probabilities of a fixed token sequence: the server's (naming ``lora`` or no adapter) or a model's."""
    if server is not None:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                "logprob_start_len": 0, **({"lora_path": lora} if lora else {})}
        out = server.post("/generate", body)
        return [x[0] for x in out["meta_info"]["input_token_logprobs"][1:]]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def test_a_lora_learner_serves_and_rolls_out_its_adapters_on_sglang_itself(learnable, tmp_path, own_sglang):
    """SGLang 0.5.23 serving LoRA on CPU (``paravt serve --lora-rank``; the suite's CPU module makes the host-memory
    pinning of SGLang's LoRA layers a no-op): the online learner with ``weight_sync: lora`` puts its starting
    adapter on the server, rolls out through it by name, and swaps each promoted adapter in; the server then
    scores as the trainer's peft model does, and a request that names no adapter gets the base model."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from paravt_train.online.versions import VersionRegistry  # as the LoRA test above

    d = learnable["dir"]
    [srv] = own_sglang(learnable["blue"], lora_rank=4)
    cfg = OnlineConfig(model=learnable["blue"], output_dir=str(tmp_path / "learner"), video_root=str(d),
                     prompts_per_step=3, group_size=4, max_new_tokens=24, temperature=1.0, lr=5e-3, save_every=100,
                     concurrency=3, seed=0, gating=False, resume=False, lora={"enabled": True, "r": 4, "alpha": 8},
                     backend="sglang", endpoint=srv.url, sync={"via": "lora"})
    store = _served(learnable, tmp_path, cfg.model, [(f"u{i % 3}", "red") for i in range(9)])
    learner = OnlineLearner(cfg, store, progress=False, log=lambda *_: None)
    assert learner.run(max_steps=3, once=True) == 3
    recs = [json.loads(x) for x in (tmp_path / "learner" / "metrics.jsonl").read_text().splitlines()]
    # each step rolled out through the adapter the trainer held (promoted and pushed after every update): the
    # trainer's logprobs of the sampled tokens are the server's (through the base model they would not be)
    # (the vision placeholders are banned on SGLang too: before, one sampled now and then failed its episode)
    assert all(r["failed_episodes"] == 0 and r["logprob_mismatch"] < 1e-4 for r in recs), [
        (r["step"], r["failed_episodes"], r["logprob_mismatch"], r.get("failures")) for r in recs]
    serving = VersionRegistry(tmp_path / "learner" / "versions").serving()
    assert serving["id"] == "v3"
    base = AutoModelForImageTextToText.from_pretrained(learnable["blue"]).eval()
    ids = torch.randint(10, 300, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    ref_base = _text_logprobs(ids, model=base)
    ref_lora = _text_logprobs(ids, model=PeftModel.from_pretrained(base, serving["path"]).eval())
    assert max(abs(a - b) for a, b in zip(ref_lora, ref_base, strict=True)) > 1e-3  # the adapter learned something
    assert _text_logprobs(ids, srv, lora=cfg.sync.lora_name) == pytest.approx(ref_lora, abs=1e-4)
    assert _text_logprobs(ids, srv) == pytest.approx(ref_base, abs=1e-4)
    _push_an_adapter_while_requests_run(srv, cfg.sync.lora_name, learnable["blue"], VersionRegistry(
        tmp_path / "learner" / "versions").versions()[1]["path"], tmp_path, ids, base)


def _push_an_adapter_while_requests_run(srv, name: str, model: str, adapter: str, tmp_path, ids, base) -> None:
    """A swap while the adapter serves: the request in flight on it finishes on the old version (SGLang drains it
    before it unloads; a paused server never would, and the push waited out its timeout); a request that arrives
    during the swap waits for it and makes SGLang load the adapter again, from the link the sync switched to the
    new version first (from the old version's path, the sync's own load then failed as "already loaded"); the
    server then scores as the new version."""
    import asyncio
    import threading
    import time

    import httpx
    from peft import PeftModel

    from paravt_agent.policy.sglang_backend import SGLangPolicy
    from paravt_agent.types import Sampling
    from paravt_train.sync.lora import SGLangLoraSync

    done: dict[str, float] = {}
    long: dict = {}

    def in_flight():
        long.update(httpx.post(srv.url + "/generate", timeout=300, json={
            "input_ids": ids, "lora_path": name,
            "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 1.0}}).json())
        done["long"] = time.monotonic()

    def push():
        done["result"] = SGLangLoraSync(srv.url, tmp_path, name=name, timeout=120).serve(adapter)["success"]
        done["push"] = time.monotonic()

    first = threading.Thread(target=in_flight)
    first.start()
    deadline = time.monotonic() + 60
    while srv.get("/v1/loads").json()["loads"][0]["num_running_reqs"] == 0:
        assert time.monotonic() < deadline and first.is_alive(), long
        time.sleep(0.1)
    swap = threading.Thread(target=push)
    swap.start()
    time.sleep(1.0)
    assert first.is_alive() and swap.is_alive()  # the unload waits for the request in flight
    late = SGLangPolicy(model, srv.url, lora=name)
    gen = asyncio.run(late.generate([{"role": "user", "content": "hello"}], Sampling(max_new_tokens=4)))
    done["late"] = time.monotonic()
    first.join(300)
    swap.join(300)
    assert done["result"] is True and gen.completion_tokens > 0
    assert long["meta_info"]["finish_reason"]["type"] == "length" and len(long["output_ids"]) == 1500
    assert done["long"] <= done["push"]  # the request in flight finished before the new version went in
    assert done["late"] > done["long"]  # the late request waited for the drain
    ref = _text_logprobs(ids, model=PeftModel.from_pretrained(base, adapter).eval())
    assert _text_logprobs(ids, srv, lora=name) == pytest.approx(ref, abs=1e-4)


def test_a_learner_killed_during_a_promotion_restarts_on_a_promoted_version(learnable, tmp_path):
    """The push of a promotion dies half-way (the process is killed between recording the candidate and the
    server taking it): the restarted learner puts the version the registry says serves back on the server first,
    and trains no feedback twice."""
    d = learnable["dir"]
    cfg = OnlineConfig(model=learnable["red"], output_dir=str(tmp_path / "learner"), video_root=str(d),
                     prompts_per_step=3, group_size=4, max_new_tokens=24, temperature=1.0, lr=6e-4, save_every=1,
                     concurrency=3, seed=0, gating=False)
    store = _served(learnable, tmp_path, cfg.model, [(f"u{i % 3}", "red") for i in range(9)])

    class Killed(Exception):
        pass

    first = OnlineLearner(cfg, store, progress=False, log=lambda *_: None)
    first.trainer.setup()
    pushed = []

    def push(cfg_, version, log=print, journal=None):  # the server as the registry sees it: what was pushed last
        pushed.append(version["id"])

    import paravt_train.online.promotion as promotion

    real = promotion.push_version
    promotion.push_version = push
    real_push = first.trainer.push_weights

    def push_weights():  # the learner's own push of a candidate: killed at the second promotion
        if first.trainer.step == 2:
            raise Killed
        return real_push()

    first.trainer.push_weights = push_weights
    try:
        with pytest.raises(Killed):
            first.run(max_steps=3, once=True)
        assert first.registry.serving()["id"] == "v1" and first.registry.get("v2")["status"] == "candidate"
        second = OnlineLearner(cfg, store, progress=False, log=lambda *_: None)
        assert second.run(once=True) >= 1
    finally:
        promotion.push_version = real
    assert pushed[:2] == ["v0", "v1"]  # each start puts the serving version (v0, then v1 after the kill) back
    trained = second.state.trained
    assert sorted(trained) == sorted(set(trained)) and len(trained) == 9  # nothing twice, nothing lost
