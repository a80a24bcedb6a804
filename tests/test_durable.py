"""Durable runs and interrupts: the agent graph's plain-data state under LangGraph checkpointers."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paravt_agent.agent import Agent
from paravt_agent.config import AgentConfig
from paravt_agent.policy.scripted import ScriptedPolicy
from paravt_agent.types import AnswerEvent, ReviewEvent, SubAgentEvent

HERE = Path(__file__).parent
pytest.importorskip("langgraph.checkpoint.sqlite", reason="langgraph-checkpoint-sqlite is not installed")


def _worker(media, tmp_path, name: str, hang_from: float | None = None) -> subprocess.Popen:
    args = [sys.executable, str(HERE / "durable_worker.py"), media["video"], str(tmp_path / "runs.db"),
            str(tmp_path / "frames"), str(tmp_path / f"{name}.log")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(HERE.parent)}
    return subprocess.Popen(args + ([str(hang_from)] if hang_from is not None else []), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finished_subagents(db: Path) -> int:
    """Sub-agent results the checkpointer holds as pending writes of the newest checkpoint (the fan-out step's:
    what a resumed run does not redo)."""
    if not db.exists():
        return 0
    try:
        with sqlite3.connect(db) as conn:
            return conn.execute("select count(*) from writes where channel = 'results' and checkpoint_id = "
                                "(select max(checkpoint_id) from checkpoints)").fetchone()[0]
    except sqlite3.OperationalError:  # the table is not there yet
        return 0


def _calls(log: Path) -> list[str]:
    return log.read_text().split("\n")[:-1] if log.exists() else []


def test_a_run_killed_mid_fan_out_resumes_and_runs_only_the_unfinished_subagents(media, tmp_path):
    """kill -9 after 2 of 4 sub-agents finished; the same call in a new process resumes the thread from its SQLite
    checkpoint: the 2 left run (not the first planner turn, not the finished two) and the answer is the one an
    uninterrupted run gives."""
    first = _worker(media, tmp_path, "first", hang_from=20)
    deadline = time.monotonic() + 120
    while _finished_subagents(tmp_path / "runs.db") < 2:
        assert first.poll() is None, first.communicate()
        assert time.monotonic() < deadline, "the first two sub-agents never finished"
        time.sleep(0.1)
    os.kill(first.pid, signal.SIGKILL)
    first.wait(30)
    assert sorted(_calls(tmp_path / "first.log")) == ["planner None", "subagent 10.0", "subagent 2.0"]

    second = _worker(media, tmp_path, "second")
    out, err = second.communicate(timeout=300)
    assert second.returncode == 0, err
    resumed = json.loads(out.strip().splitlines()[-1])
    assert sorted(_calls(tmp_path / "second.log")) == ["planner None", "subagent 20.0", "subagent 30.0"]
    # the one planner call of the second process is the final turn: it read all four summaries
    assert resumed["response"] == "<think>read 4 summaries</think><answer>B</answer>" and resumed["choice"] == "B"
    assert resumed["calls"] == [f"summary of {a}-{b}" for a, b in [(2, 6), (10, 14), (20, 24), (30, 34)]]

    sys.path.insert(0, str(HERE))
    from durable_worker import script

    direct = Agent(policy=ScriptedPolicy(script)).answer(media["video"], "Which colour?", ["red", "green"])
    assert resumed["response"] == direct.trace.response and resumed["calls"] == [
        c.summary for t in direct.trace.turns for c in t.calls]

    third = _worker(media, tmp_path, "third")  # a finished thread gives its answer back: no model call
    out, err = third.communicate(timeout=300)
    assert third.returncode == 0, err and json.loads(out.strip().splitlines()[-1]) == resumed
    assert _calls(tmp_path / "third.log") == []


def _review_script(role, msgs):
    from durable_worker import script

    return script(role, msgs)


def test_review_windows_pauses_before_the_subagents_and_resumes_with_edited_calls(media):
    """``review_windows``: the run stops after the planner with its planned windows (no sub-agent ran); resuming with
    an edited list runs exactly those windows; ``answer(review=...)`` does the same in one call."""
    sys.path.insert(0, str(HERE))
    pol = ScriptedPolicy(_review_script)
    agent = Agent(policy=pol, config=AgentConfig(review_windows=True))

    async def run():
        events = [e async for e in agent.astream(media["video"], "Which colour?", ["red", "green"])]
        paused = events[-1]
        assert isinstance(paused, ReviewEvent) and not any(isinstance(e, AnswerEvent) for e in events)
        assert [c.window for c in paused.calls] == [(2, 6), (10, 14), (20, 24), (30, 34)]
        assert [r for r, _ in pol.calls] == ["planner"]  # nothing ran past the planner
        edited = [{"start_time": 5, "end_time": 9}, {"name": "crop_video", "arguments": {"start": 12, "end": 15}}]
        return [e async for e in agent.astream_resume(paused.thread_id, edited)]

    events = agent.run(run())
    done = events[-1].answer
    assert [e.record.summary for e in events if isinstance(e, SubAgentEvent)] == ["summary of 5-9",
                                                                                 "summary of 12-15"] \
        or sorted(e.record.summary for e in events if isinstance(e, SubAgentEvent)) == ["summary of 12-15",
                                                                                       "summary of 5-9"]
    assert [c.summary for c in done.trace.turns[0].calls] == ["summary of 5-9", "summary of 12-15"]
    assert done.trace.response == "<think>read 2 summaries</think><answer>B</answer>" and done.choice == "B"
    assert [r for r, _ in pol.calls].count("subagent") == 2

    seen = []
    ans = agent.answer(media["video"], "Which colour?", ["red", "green"],
                       review=lambda ev: seen.append(ev) or [{"start_time": 30, "end_time": 34}])
    assert len(seen) == 1 and [c.summary for c in ans.trace.turns[0].calls] == ["summary of 30-34"]
    # a reviewer that returns None approves the windows as planned
    ans = agent.answer(media["video"], "Which colour?", ["red", "green"], review=lambda ev: None)
    assert ans.ok and [c.window for c in ans.trace.turns[0].calls] == [(2, 6), (10, 14), (20, 24), (30, 34)]
    with pytest.raises(Exception, match="review_windows is on"):
        agent.answer(media["video"], "Which colour?", ["red", "green"])
    # off by default: the same agent without it never pauses
    plain = Agent(policy=ScriptedPolicy(_review_script)).answer(media["video"], "Which colour?", ["red", "green"])
    assert len(plain.trace.turns[0].calls) == 4


def test_postgres_checkpointer_keeps_a_thread_across_agents(media, postgres_db):
    """The PostgreSQL saver (LangGraph's, by URL): a thread answered by one Agent is given back by another,
    over the same database, without a model call; a new thread runs."""
    pytest.importorskip("langgraph.checkpoint.postgres", reason="langgraph-checkpoint-postgres is not installed")
    sys.path.insert(0, str(HERE))
    from durable_worker import script

    first = ScriptedPolicy(script)
    ans = Agent(policy=first, checkpointer=postgres_db).answer(media["video"], "Which colour?", ["red", "green"],
                                                              thread_id="pg-1")
    assert ans.choice == "B" and [r for r, _ in first.calls].count("subagent") == 4
    second = ScriptedPolicy(script)
    agent = Agent(policy=second, checkpointer=postgres_db)
    again = agent.answer(media["video"], "Which colour?", ["red", "green"], thread_id="pg-1")
    assert second.calls == [] and again.trace.response == ans.trace.response and again.text == ans.text
    assert [c.summary for c in again.trace.turns[0].calls] == [c.summary for c in ans.trace.turns[0].calls]
    fresh = agent.answer(media["video"], "Which colour?", ["red", "green"], thread_id="pg-2")
    assert fresh.text == ans.text and [r for r, _ in second.calls].count("planner") == 2
