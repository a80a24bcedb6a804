"""The trajectory store: traces the agent served and the feedback users gave on them (SQLite).

Opt-in: ``Agent(..., store=TrajectoryStore("runs/traces.db"))`` writes every
trace; ``agent.feedback(trace_id, answer=..., reward=..., thumbs=...)`` attaches
feedback. SQLite in WAL mode with a busy timeout: safe under concurrent writers
(threads and processes), and a crash loses at most the write in flight.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path

from paravt_agent.errors import ParaVTError
from paravt_agent.trajectory import Trace

__all__ = ["TrajectoryStore"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS traces (
    id TEXT PRIMARY KEY, created REAL, video TEXT, question TEXT, answer TEXT, trace TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS feedback (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, trace_id TEXT NOT NULL REFERENCES traces(id),
    created REAL, answer TEXT, reward REAL, thumbs INTEGER, note TEXT
);
CREATE INDEX IF NOT EXISTS feedback_trace ON feedback(trace_id);
"""


class TrajectoryStore:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        with self._conn() as c:
            c.executescript(SCHEMA)

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA busy_timeout=30000")
            self._local.conn = conn
        return conn

    def add(self, trace: Trace) -> str:
        self._conn().execute(
            "INSERT OR REPLACE INTO traces VALUES (?, ?, ?, ?, ?, ?)",
            (trace.id, trace.created, trace.video, trace.question, trace.answer, trace.to_json()),
        )
        return trace.id

    def get(self, trace_id: str) -> Trace:
        row = self._conn().execute("SELECT trace FROM traces WHERE id = ?", (trace_id,)).fetchone()
        if row is None:
            raise ParaVTError(f"no trace {trace_id!r} in {self.path}")
        return Trace.from_json(row[0])

    def feedback(self, trace_id: str, answer: str | None = None, reward: float | None = None,
                 thumbs: bool | None = None, note: str | None = None) -> int:
        """Attach feedback: the correct answer, a reward, or thumbs up/down. Returns its sequence number."""
        if answer is None and reward is None and thumbs is None:
            raise ParaVTError("feedback needs an answer, a reward or thumbs up/down")
        self.get(trace_id)  # must exist
        cur = self._conn().execute(
            "INSERT INTO feedback (trace_id, created, answer, reward, thumbs, note) VALUES (?, ?, ?, ?, ?, ?)",
            (trace_id, time.time(), answer, reward, None if thumbs is None else int(thumbs), note),
        )
        return int(cur.lastrowid)

    def feedback_since(self, seq: int = 0) -> list[dict]:
        """Feedback rows after sequence number ``seq``, oldest first (for consumers that checkpoint ``seq``)."""
        rows = self._conn().execute(
            "SELECT seq, trace_id, created, answer, reward, thumbs, note FROM feedback WHERE seq > ? ORDER BY seq",
            (seq,),
        ).fetchall()
        keys = ("seq", "trace_id", "created", "answer", "reward", "thumbs", "note")
        return [dict(zip(keys, r, strict=True)) for r in rows]

    def count(self) -> int:
        return int(self._conn().execute("SELECT COUNT(*) FROM traces").fetchone()[0])

    def export(self) -> list[dict]:
        return [json.loads(r[0]) for r in self._conn().execute("SELECT trace FROM traces ORDER BY created")]
