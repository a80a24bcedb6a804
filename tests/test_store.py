"""The trajectory store on both engines: SQLite (embedded) and a real PostgreSQL server."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from paravt_agent.errors import ConfigError, ParaVTError
from paravt_agent.store import PostgresTrajectoryStore, SQLiteTrajectoryStore, TrajectoryStore, open_store
from paravt_agent.trajectory import Trace


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/traces.db"
    return request.getfixturevalue("postgres_db")


def test_one_interface_on_both_engines(store_url):
    store = TrajectoryStore(store_url)
    assert isinstance(store, PostgresTrajectoryStore if store_url.startswith("postgresql") else SQLiteTrajectoryStore)
    assert open_store(store) is store and open_store(None) is None
    t = Trace(video="v.mp4", question="What colour?", options=["red", "blue"], answer="A")
    store.add(t)
    t.answer = "B"
    store.add(t)  # the same id again replaces it
    assert store.count() == 1 and store.get(t.id).answer == "B" and store.get(t.id).options == ["red", "blue"]
    with pytest.raises(ParaVTError, match="no trace"):
        store.get("nope")
    with pytest.raises(ParaVTError, match="no trace"):
        store.feedback("nope", answer="A")
    with pytest.raises(ParaVTError, match="needs an answer"):
        store.feedback(t.id)
    s1 = store.feedback(t.id, answer="A", note="n")
    s2 = store.feedback(t.id, reward=0.5)
    s3 = store.feedback(t.id, thumbs=False)
    assert s1 < s2 < s3
    rows = store.feedback_since(0)
    assert [(r["answer"], r["reward"], r["thumbs"], r["note"]) for r in rows] == [
        ("A", None, None, "n"), (None, 0.5, None, None), (None, None, 0, None)]
    assert [r["seq"] for r in store.feedback_since(s1)] == [s2, s3]
    assert [e["id"] for e in store.export()] == [t.id]
    # a second opening (another process would do the same) sees the same rows
    assert TrajectoryStore(store_url).count() == 1


def test_store_targets_are_checked(tmp_path):
    assert TrajectoryStore(tmp_path / "a.db").path == tmp_path / "a.db"
    assert TrajectoryStore(f"sqlite:///{tmp_path}/b.db").path == tmp_path / "b.db"
    with pytest.raises(ConfigError, match="unknown trajectory store"):
        TrajectoryStore("mysql://x/y")
    with pytest.raises(ConfigError, match="three slashes"):
        TrajectoryStore("sqlite://relative.db")
    with pytest.raises(ParaVTError, match=r"cannot connect .*:\*\*\*@"):  # the password never shows
        TrajectoryStore("postgresql://u:secret@127.0.0.1:1/db")


WRITER = r"""
import sys
from paravt_agent.store import TrajectoryStore
from paravt_agent.trajectory import Trace
url, worker, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
store = TrajectoryStore(url)
for i in range(n):
    t = Trace(id=f"w{worker}-{i}", video=f"v{worker}.mp4", question=f"q{i}", answer="A")
    store.add(t)
    store.feedback(t.id, answer="B" if i % 2 else None, reward=float(i % 3), thumbs=bool(i % 2))
"""


def cursor_reader(store, seen: list[int], done: threading.Event) -> None:
    """A consumer checkpointing its cursor while writers run (the online learner's pattern), until ``done``."""
    cursor = 0
    while True:
        finished = done.is_set()
        for row in store.feedback_since(cursor):
            seen.append(row["seq"])
            cursor = row["seq"]
        if finished:
            return
        time.sleep(0.01)


def test_postgres_concurrent_writers_lose_nothing_and_a_cursor_skips_nothing(postgres_db):
    store = TrajectoryStore(postgres_db)  # creates the tables before the writers race
    n, workers = 500, 4
    seen: list[int] = []
    done = threading.Event()
    th = threading.Thread(target=cursor_reader, args=(store, seen, done))
    th.start()
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, postgres_db, str(w), str(n)], stderr=subprocess.PIPE,
                              text=True) for w in range(workers)]
    try:
        for p in procs:
            assert p.wait(timeout=300) == 0, p.stderr.read()
    finally:
        done.set()
        th.join()
    assert store.count() == n * workers
    rows = store.feedback_since(0)
    assert len(rows) == n * workers
    assert {r["trace_id"] for r in rows} == {f"w{w}-{i}" for w in range(workers) for i in range(n)}
    # every row seen exactly once, in order, although four processes inserted them concurrently
    assert seen == sorted(r["seq"] for r in rows)


HANGING_WRITER = r"""
import sys, time
import psycopg
from paravt_agent.store import TrajectoryStore
from paravt_agent.trajectory import Trace
store = TrajectoryStore(sys.argv[1])
store.add(Trace(id="doomed", video="v.mp4", question="q"))
real = psycopg.Connection.execute
def execute(self, query, *a, **kw):  # the store's own feedback transaction, stopped before its commit
    cur = real(self, query, *a, **kw)
    if str(query).startswith("INSERT INTO feedback"):
        print("inside", flush=True)
        time.sleep(600)
    return cur
psycopg.Connection.execute = execute
store.feedback("doomed", answer="A")
"""


def test_postgres_writer_killed_mid_transaction_loses_and_repeats_nothing(postgres_db):
    """kill -9 of a writer holding the feedback lock inside its transaction: its row never appears, the other
    writers go on once the server drops the dead connection, and a cursor reading all along sees every
    committed row once, in order."""
    import signal

    store = TrajectoryStore(postgres_db)
    seen: list[int] = []
    done = threading.Event()
    th = threading.Thread(target=cursor_reader, args=(store, seen, done))
    th.start()
    hang = subprocess.Popen([sys.executable, "-c", HANGING_WRITER, postgres_db], stdout=subprocess.PIPE, text=True)
    try:
        assert hang.stdout.readline().strip() == "inside"
        writers = [subprocess.Popen([sys.executable, "-c", WRITER, postgres_db, str(w), "100"], stderr=subprocess.PIPE,
                                    text=True) for w in range(2)]
        deadline = time.time() + 120
        while store.count() < 3:  # each writer has stored its first trace (opening the store waits for nothing) ...
            assert time.time() < deadline, "a writer could not store its first trace while another held the lock"
            time.sleep(0.05)
        time.sleep(1.0)
        blocked = len(store.feedback_since(0))  # ... and waits for the feedback lock the hanging one holds
        hang.send_signal(signal.SIGKILL)
        hang.wait(timeout=30)
        for p in writers:
            assert p.wait(timeout=300) == 0, p.stderr.read()
    finally:
        hang.kill()
        done.set()
        th.join()
    rows = store.feedback_since(0)
    assert blocked == 0 and len(rows) == 200 and "doomed" not in {r["trace_id"] for r in rows}
    assert seen == sorted(r["seq"] for r in rows)  # every committed row once, in order, none skipped
    assert store.count() == 201  # the killed writer's trace was committed before its transaction began


def test_online_learner_reads_feedback_from_postgres(postgres_db, toy_policy_dir, toy_rl, tmp_path):
    from paravt_train.online.learner import OnlineLearner
    from paravt_train.rl.config import GRPOConfig

    store = TrajectoryStore(postgres_db)
    w = toy_rl["worlds"][0]
    q = w.questions[0]
    ids = []
    for _ in range(3):
        t = Trace(video=w.video, question=q.question, options=q.options)
        store.add(t)
        ids.append(t.id)
    store.feedback(ids[0], answer=q.answer)
    store.feedback(ids[1], answer=q.answer)
    store.feedback(ids[2], thumbs=True)  # no reference answer: skipped
    cfg = GRPOConfig(model=toy_policy_dir, output_dir=str(tmp_path / "online"), video_root=toy_rl["video_root"])
    learner = OnlineLearner(cfg, postgres_db, progress=False, log=lambda *_: None)
    learner.trainer.setup()
    assert learner.poll() == 2
    st = learner.state
    assert len(st.queue) == 2 and st.skipped == 1 and st.cursor == store.feedback_since(0)[-1]["seq"]
    assert learner.poll() == 0  # nothing new
