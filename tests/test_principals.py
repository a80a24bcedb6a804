"""Online learning whose voters are principals (issue 65): a label counts for who the server authenticated (an API
key's owner, the web page, the operator), never for a name the caller sends; the quorum, the per-voter caps and the
leave-out checks count principals; a rollback decision no small group can tip, to roll back or to keep."""

from __future__ import annotations

import itertools
import random
import subprocess
import sys
import time

import httpx
import pytest

from paravt_agent.agent import Agent
from paravt_agent.policy.scripted import ScriptedPolicy
from paravt_agent.serving.api import ApiSettings, create_app, principal_warning
from paravt_agent.store import TrajectoryStore
from paravt_agent.store.principals import OPERATOR, WEB, key_digest, principal_of
from paravt_agent.trajectory import Trace
from paravt_train.online.config import OnlineConfig, RollbackSettings
from paravt_train.online.learner import OnlineLearner
from paravt_train.online.rollback import _extreme, _Labels, rollback_decision, rollback_look
from paravt_train.online.state import OnlineState
from tests.test_api import Server


def _labels(**users) -> dict:
    """Live counts ``{principal: [sum, sum of squares, labels]}`` from ``principal=(right, labels)``."""
    return {u: [float(a), float(a), n] for u, (a, n) in users.items()}


def _traces(store: TrajectoryStore, video: str, n: int) -> list[Trace]:
    out = []
    for _ in range(n):
        t = Trace(video=video, question="What colour is shown at second 4?", options=["red", "blue", "green"],
                  answer="A", response="<answer>A</answer>")
        store.add(t)
        out.append(t)
    return out


def _learner(tmp_path, store, toy_policy_dir, toy_rl, **online) -> OnlineLearner:
    cfg = OnlineConfig(model=toy_policy_dir, output_dir=str(tmp_path / "o"), video_root=toy_rl["video_root"],
                       online=online)
    learner = OnlineLearner(cfg, store, progress=False, log=lambda *_: None)
    learner.registry.add("v0", 0, toy_policy_dir, "candidate")
    learner.registry.set_serving("v0", reason="start")
    return learner


def test_one_key_is_one_voter_whatever_user_names_it_sends(tmp_path, toy_policy_dir, toy_rl):
    """``paravt api --keys FILE`` over real HTTP: mallory's one key sends 12 labels under 12 ``user`` names; they are
    stored as hers (the names sub-labels) and the learner counts one voter — its per-voter window cap
    (``max_rows_per_user``) and per-version label cap apply to all 12 together, and she alone is no quorum. A key
    not in the file, or none, is refused; deleting a stolen key's line revokes it while the server runs."""
    store = TrajectoryStore(tmp_path / "t.db")
    learner = _learner(tmp_path, store, toy_policy_dir, toy_rl, max_rows_per_user=5,
                       rollback={"max_labels_per_user": 4})
    traces = _traces(store, toy_rl["worlds"][0].video, 15)
    keys = tmp_path / "keys.yaml"
    keys.write_text("alice: key-alice-0001\nbob:\n  - key-bob-0001\n  - sha256:" + key_digest("key-bob-0002")
                    + "\nmallory: key-mallory-01\n")
    srv = Server(create_app(Agent(policy=ScriptedPolicy(lambda role, msgs: ""), store=store),
                            ApiSettings(keys=str(keys))))
    try:
        def post(key, trace, user=None):
            body = {"trace_id": trace.id, "answer": "A", **({"user": user} if user else {})}
            return httpx.post(srv.url + "/v1/feedback", json=body,
                              headers={"Authorization": f"Bearer {key}"} if key else {})

        assert post(None, traces[0]).status_code == 401
        assert post("key-nobody-01", traces[0]).status_code == 401
        for i in range(12):
            assert post("key-mallory-01", traces[i], user=f"sock{i}").status_code == 200
        assert post("key-alice-0001", traces[12], user="alice-phone").status_code == 200
        assert post("key-bob-0002", traces[13]).status_code == 200  # the key the file holds only as its digest
        keys.write_text("alice: key-alice-0001\n")  # mallory's key was stolen: her line goes
        time.sleep(0.05)
        r = post("key-mallory-01", traces[14], user="sock99")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    finally:
        srv.close()
    rows = store.feedback_since(0)
    assert {r["principal"] for r in rows[:12]} == {"key:mallory"} and rows[3]["user_id"] == "key:mallory/sock3"
    assert [principal_of(r) for r in rows[12:]] == ["key:alice", "key:bob"]
    learner.trainer.setup()
    learner.poll()
    st = learner.state
    assert st.skipped_by == {"user over max_rows_per_user": 7}  # 12 names, one voter: 5 rows of hers, not 12
    assert len(st.users["key:mallory"]) == 5
    live = st.live["v0"]
    assert sorted(live) == ["key:alice", "key:bob", "key:mallory"] and live["key:mallory"][2] == 4
    assert [d["user"] for d in st.queue].count("key:mallory") == 5
    chk = rollback_decision(_labels(**{"key:mallory": (0, 4)}), _labels(a=(8, 10), b=(8, 10), c=(8, 10)),
                            RollbackSettings())
    assert not chk.tested and "1 principals" in chk.why  # one key posing as many users is no quorum


def test_without_keys_every_caller_is_one_principal(tmp_path, toy_rl, capsys):
    """A server without ``--keys`` (0.5.1's way, kept): one ``--api-key`` is one principal whoever holds it, and with
    no key every caller is ``api:anonymous`` whatever token it makes up (0.5.1 counted each made-up token as a
    voter); the server says so at start."""
    store = TrajectoryStore(tmp_path / "t.db")
    traces = _traces(store, toy_rl["worlds"][0].video, 4)
    agent = Agent(policy=ScriptedPolicy(lambda role, msgs: ""), store=store)
    shared = Server(create_app(agent, ApiSettings(api_key="s3cret-key")))
    open_ = Server(create_app(agent, ApiSettings()))
    try:
        for srv, key, trace, user in ((shared, "s3cret-key", traces[0], "ann"), (shared, "s3cret-key", traces[1], "bo"),
                                      (open_, "made-up-1", traces[2], None), (open_, "made-up-2", traces[3], "cy")):
            r = httpx.post(srv.url + "/v1/feedback", json={"trace_id": trace.id, "answer": "B", "user": user},
                           headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
    finally:
        shared.close()
        open_.close()
    got = [principal_of(r) for r in store.feedback_since(0)]
    shared_id = "api:" + key_digest("s3cret-key")[:12]
    assert got == [shared_id, shared_id, "api:anonymous", "api:anonymous"]
    warning = principal_warning(agent, ApiSettings(api_key="s3cret-key"))
    assert "one voter" in warning and shared_id in warning and "--keys" in warning
    assert principal_warning(agent, ApiSettings(keys=str(tmp_path / "k.yaml"))) is None
    assert principal_warning(Agent(policy=ScriptedPolicy(lambda role, msgs: "")), ApiSettings()) is None  # no store


def test_a_keys_file_says_what_is_wrong(tmp_path, capsys):
    """A keys file the server cannot use is refused at start with the line's fault. One that breaks while the server
    runs admits no key until it is fixed, and says so without quoting the file (its lines hold keys): before this
    review it kept the keys read before, so emptying the file of its last (stolen) key left that key working."""
    from paravt_agent.errors import ConfigError
    from paravt_agent.serving.keys import KeyRing

    path = tmp_path / "keys.yaml"
    for text, why in (("- just-a-list-item\n", "mapping"), ("al ice: key-alice-0001\n", "not a principal name"),
                      ("alice: short\n", "at least 8"), ("alice: sha256:abc123\n", "64 hex digits"),
                      ("alice: key-shared-01\nbob: key-shared-01\n", "both key:alice and key:bob")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=why):
            KeyRing(keys=str(path))
    with pytest.raises(ConfigError, match="needs --store"):
        KeyRing(keys="store")
    path.write_text("alice: key-alice-0001\n")
    ring = KeyRing(keys=str(path))
    assert ring.principal("key-alice-0001") == "key:alice" and ring.principal("key-bob-00001") is None
    path.write_text("alice:\tkey-alice-0001\n\tbob: [unclosed\n")
    assert ring.principal("key-alice-0001") is None
    out = capsys.readouterr().out
    assert "not valid YAML at line" in out and "no key is admitted until it is fixed" in out and "key-alice" not in out
    path.write_text("alice: key-alice-0001\nbob: key-bob-00001\n")  # fixed: in force again
    assert ring.principal("key-alice-0001") == "key:alice" and ring.principal("key-bob-00001") == "key:bob"
    path.write_text("")  # the last line deleted: no key at all
    assert ring.principal("key-alice-0001") is None and ring.principal("key-bob-00001") is None
    path.write_text("bob: key-bob-00001\n")
    assert ring.principal("key-bob-00001") == "key:bob"
    path.unlink()
    assert ring.principal("key-bob-00001") is None and "no key is admitted" in capsys.readouterr().out


@pytest.mark.parametrize("engine", ["sqlite", "postgresql"])
def test_keys_kept_in_the_store(engine, tmp_path, toy_rl, request, monkeypatch):
    """``paravt keys add NAME --store`` prints a key whose SHA-256 alone is stored; ``paravt api --keys store``
    takes it as ``key:NAME``; ``paravt keys revoke NAME`` stops it (within the cache's seconds). A PostgreSQL store an
    older release made (no principal column, the key index present) gains the column when opened."""
    import paravt_agent.serving.keys as keys_mod

    target = str(tmp_path / "t.db") if engine == "sqlite" else request.getfixturevalue("postgres_db")
    if engine == "postgresql":  # 0.5.1's schema, with a row
        import psycopg

        with psycopg.connect(target, autocommit=True) as conn:
            for stmt in ("CREATE TABLE traces (id TEXT PRIMARY KEY, created DOUBLE PRECISION, video TEXT, "
                         "question TEXT, answer TEXT, trace TEXT NOT NULL)",
                         "CREATE TABLE feedback (seq BIGSERIAL PRIMARY KEY, trace_id TEXT NOT NULL REFERENCES "
                         "traces(id), created DOUBLE PRECISION, answer TEXT, reward DOUBLE PRECISION, thumbs INTEGER, "
                         "note TEXT, user_id TEXT, key TEXT)",
                         "CREATE INDEX feedback_trace ON feedback(trace_id)",
                         "CREATE UNIQUE INDEX feedback_key ON feedback(key)"):
                conn.execute(stmt)
    cli = [sys.executable, "-m", "paravt_agent.cli", "keys"]
    made = subprocess.run([*cli, "add", "carol", "--store", target], capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    store = TrajectoryStore(target)
    assert store.api_keys()[0]["digest"] == key_digest(key)[:12] and key not in str(store.api_keys())
    listed = subprocess.run([*cli, "list", "--store", target], capture_output=True, text=True, timeout=120)
    assert listed.stdout.startswith(f"key:carol\tsha256:{key_digest(key)[:12]}") and key not in listed.stdout
    bad = subprocess.run([*cli, "add", "no spaces", "--store", target], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "not a principal name" in bad.stderr + bad.stdout
    traces = _traces(store, toy_rl["worlds"][0].video, 2)
    monkeypatch.setattr(keys_mod, "STORE_TTL", 0.2)
    srv = Server(create_app(Agent(policy=ScriptedPolicy(lambda role, msgs: ""), store=store),
                            ApiSettings(keys="store")))
    try:
        def post(trace):
            return httpx.post(srv.url + "/v1/feedback", json={"trace_id": trace.id, "answer": "A", "user": "x"},
                              headers={"Authorization": f"Bearer {key}"})

        assert post(traces[0]).status_code == 200
        gone = subprocess.run([*cli, "revoke", "carol", "--store", target], capture_output=True, text=True,
                              timeout=120)
        assert gone.returncode == 0 and "1 key of carol revoked" in gone.stdout
        time.sleep(0.3)
        assert post(traces[1]).status_code == 401
    finally:
        srv.close()
    assert [(r["principal"], r["user_id"]) for r in store.feedback_since(0)] == [("key:carol", "key:carol/x")]
    # tokens no one holds are asked of the store each time and never remembered (a flood grew the cache unbounded)
    ring = keys_mod.KeyRing(keys="store", store=store)
    assert [ring.principal(f"made-up-{i:04d}") for i in range(200)] == [None] * 200 and not ring._cache


def test_the_web_page_is_one_principal_and_can_be_kept_from_voting(tmp_path, toy_policy_dir, toy_rl):
    """Every browser session of the web page is one anonymous principal (a session is a name anyone gets by
    reloading); with ``rollback.web_votes`` off its labels still train but never vote."""
    gradio_app = pytest.importorskip("gradio_app")
    store = TrajectoryStore(tmp_path / "t.db")
    learners = {votes: _learner(tmp_path / str(votes), store, toy_policy_dir, toy_rl, rollback={"web_votes": votes})
                for votes in (True, False)}  # v0 serves before the answers are given
    traces = _traces(store, toy_rl["worlds"][0].video, 6)
    demo = gradio_app.Demo(None, str(store.path), 50, 0, None, "paravt")

    class Session:
        def __init__(self, h):
            self.session_hash = h

    for i, t in enumerate(traces[:4]):
        assert demo.feedback(t.id, "A", None, Session(f"tab{i}")).startswith("Thanks")
    store.feedback(traces[4].id, answer="A")  # the operator's own label
    rows = store.feedback_since(0)
    assert [principal_of(r) for r in rows] == [WEB] * 4 + [OPERATOR] and rows[2]["user_id"] == "gradio:tab2"
    for votes, learner in learners.items():
        learner.trainer.setup()
        learner.poll()
        assert sorted(learner.state.live["v0"]) == ([OPERATOR, WEB] if votes else [OPERATOR])
        assert [d["user"] for d in learner.state.queue] == [WEB] * 4 + [None]  # trained on either way


def test_a_checkpoint_counted_per_user_is_read_per_principal():
    """A learner state of 0.5.1 (version 2: live counts, windows and queued prompts per user string) is merged per
    principal. Every ``api:`` user of 0.5.1 is one voter, ``api:legacy``: a keyless 0.5.1 server made a digest of
    whatever token a caller sent (two made-up tokens below, ``abc`` and ``def``), so the digests name no one."""
    from paravt_agent.store.principals import LEGACY_API

    live = {"api:abc/u1": [3.0, 3.0, 4], "api:def/u2": [1.0, 1.0, 2], "gradio:s1": [1.0, 1.0, 1],
            "(operator)": [2.0, 2.0, 2]}
    queue = [{"id": f"q{i}", "seq": i, "user": u} for i, u in enumerate(("api:abc/u1", "api:def/u3", "sdk:al"))]
    st = OnlineState.from_dict({"version": 2, "live": {"v1": live}, "queue": queue,
                                "users": {"api:abc/u1": [5.0], "api:def/u2": [1.0, 9.0], "sdk:al": [2.0]}})
    assert st.live["v1"] == {LEGACY_API: [4.0, 4.0, 6], WEB: [1.0, 1.0, 1], OPERATOR: [2.0, 2.0, 2]}
    assert st.users == {LEGACY_API: [1.0, 5.0, 9.0], "sdk:al": [2.0]}
    assert [d["user"] for d in st.queue] == [LEGACY_API, LEGACY_API, "sdk:al"]
    assert principal_of({"principal": None, "user_id": "api:0123456789ab/bob"}) == LEGACY_API


# ------------------------------------------------------------------------------------------ the decision itself


def _rule_051(served: dict, before: dict, r: RollbackSettings) -> bool:
    """0.5.1's decision (significant with any ONE user left out; nothing against blocking), for contrast."""
    from statistics import NormalDist

    lab, c = _Labels(served, before, r.margin), NormalDist().inv_cdf(1 - r.alpha / r.looks)
    return lab.z() > c and all((z := lab.z((u,))) is not None and z > c for u in lab.voters)


def test_two_colluding_principals_cannot_force_a_rollback_nor_one_block_it():
    """Two principals labelling an equally good version's answers wrong tipped 0.5.1's rule (it left one user out,
    never two); one principal labelling a worse version's answers right kept it (nothing guarded that direction).
    Neither tips the principal rule (leave_out 2): both decisions are contested, and decided with the group set
    aside."""
    r = RollbackSettings()
    before = _labels(**{f"u{i}": (8, 10) for i in range(8)})
    forced = _labels(**{f"u{i}": (7, 10) for i in range(8)}, m1=(0, 10), m2=(0, 10))
    assert _rule_051(forced, before, r)  # 0.5.1: rolled back
    assert not rollback_decision(_labels(**{f"u{i}": (7, 10) for i in range(8)}), before, r).rollback
    chk = rollback_decision(forced, before, r)
    assert chk.tested and chk.z > chk.critical and chk.contested and not chk.rollback
    assert {"m1", "m2"} <= set(chk.set_aside) and "contested" in chk.why
    before = _labels(**{f"u{i}": (6, 10) for i in range(10)})
    worse = {f"u{i}": (4, 10) for i in range(10)}
    blocked = _labels(**worse, m1=(10, 10))
    assert _rule_051(_labels(**worse), before, r) and not _rule_051(blocked, before, r)  # 0.5.1: kept
    chk = rollback_decision(blocked, before, r)
    assert chk.rollback and chk.contested and chk.set_aside[0] == "m1" and chk.z < chk.critical
    # the operator's own labels are trusted: never set aside
    chk = rollback_decision({**_labels(**worse), OPERATOR: [10.0, 10.0, 10]}, before, r)
    assert chk.tested and OPERATOR not in chk.set_aside and OPERATOR not in chk.why


def test_a_decision_that_stands_stands_with_any_k_principals_removed():
    """Whenever the rule says a decision stands (not contested), removing any k principals' labels gives the same
    decision — checked against every subset; the search for the extremes (over the principals moving z most alone)
    finds what the search over every subset finds."""
    rng = random.Random(7)
    checked = 0
    for _ in range(120):
        served, before = {}, {}
        for i in range(rng.randint(4, 14)):
            for counts, p in ((served, rng.choice((0.5, 0.65))), (before, 0.7)):
                n = rng.randint(1, 10)
                a = sum(rng.random() < p for _ in range(n))
                counts[f"u{i}"] = [float(a), float(a), n]
        for _ in range(rng.randint(0, 2)):
            served[f"m{len(served)}"] = rng.choice(([0.0, 0.0, 10], [10.0, 10.0, 10]))
        for k in (1, 2, 3):
            r = RollbackSettings(leave_out=k, min_users=1, min_rows=1)
            chk = rollback_decision(served, before, r)
            lab = _Labels(served, before, r.margin)
            subsets = [g for size in range(k + 1) for g in itertools.combinations(lab.voters, size)]
            zs = [z for g in subsets if (z := lab.z(g)) is not None]
            assert min(zs) == pytest.approx(chk.z_low) and max(zs) == pytest.approx(chk.z_high)
            assert _extreme(lab, k, -1)[0] == pytest.approx(min(zs))
            if not chk.contested:
                assert all((z > chk.critical) == chk.rollback for z in zs)
                checked += 1
    assert checked > 100


def _simulate(rng, worse: float, blockers: int, r: RollbackSettings, rule=None, n: int = 100, p: float = 0.5):
    """One served version's n honest labels (40 principals, Zipf activity) against a version before it at p, a look
    after every 4 labels; blockers label 10 of its answers right each. True: rolled back."""
    users = [f"u{i}" for i in range(40)]
    weights = [1 / (i + 1) for i in range(40)]

    def add(counts, who, s):
        c = counts.setdefault(who, [0.0, 0.0, 0])
        if c[2] < r.max_labels_per_user:
            c[0], c[1], c[2] = c[0] + s, c[1] + s, c[2] + 1

    before: dict = {}
    for who in rng.choices(users, weights, k=n):
        add(before, who, float(rng.random() < p))
    stream = [(who, float(rng.random() < p - worse)) for who in rng.choices(users, weights, k=n)]
    for b in range(blockers):
        for _ in range(10):
            stream.insert(rng.randrange(len(stream) + 1), (f"m{b}", 1.0))
    cur: dict = {}
    looks = 0
    for i, (who, s) in enumerate(stream, 1):
        add(cur, who, s)
        if i % 4:
            continue
        if rule is None:
            looks, chk = rollback_look(cur, before, looks, r)
            if chk is not None and chk.rollback:
                return True
        elif sum(c[2] for c in cur.values()) >= (looks + 1) * r.min_rows and looks < r.looks:
            looks += 1
            if rule(cur, before, r):
                return True
    return False


def test_one_principal_blocks_a_rollback_no_more_than_the_loss_of_one_honest_voter():
    """A 0.15-worse version (accuracy 0.5, 100 labels): one principal labelling its answers right cut 0.5.1's
    rollback rate to under 40 % of the honest one (14–24 % over seeds); under the principal rule it keeps more than
    40 % of it (56–69 %: the blocker is set aside, and one honest voter with it). Seeded, 500 trials;
    perf/bench_online_decisions.py runs the full grid."""
    r = RollbackSettings()
    rates = {}
    for name, rule in (("0.5.1", _rule_051), ("principals", None)):
        rng = random.Random(3)
        honest = sum(_simulate(rng, 0.15, 0, r, rule) for _ in range(500))
        blocked = sum(_simulate(rng, 0.15, 1, r, rule) for _ in range(500))
        rates[name] = (honest, blocked)
    assert rates["0.5.1"][1] < 0.4 * rates["0.5.1"][0], rates
    assert rates["principals"][1] > 0.4 * rates["principals"][0], rates
