"""The trajectory store: traces the agent served and the feedback users gave on them.

Opt-in: ``Agent(..., store=TrajectoryStore("runs/traces.db"))`` writes every
trace; ``agent.feedback(trace_id, answer=..., reward=..., thumbs=...)`` attaches
feedback. One interface, two engines, chosen by the target:

- **SQLite** (the embedded default): a path, or ``sqlite:///runs/traces.db``. WAL
  mode with a busy timeout: safe under concurrent writers (threads and processes
  on one machine), and a crash loses at most the write in flight.
- **PostgreSQL** (several serving processes or machines, one learner):
  ``postgresql://user:pass@host:5432/db`` (needs ``psycopg``, the ``postgres`` extra).
  Tables are created on first use.

Feedback rows carry a sequence number that consumers checkpoint
(:meth:`TrajectoryStore.feedback_since`). On PostgreSQL a ``BIGSERIAL`` alone would
let a reader that saw row 12 skip row 11 whose transaction commits a moment later;
feedback inserts therefore take a transaction-scoped advisory lock, so sequence
numbers become visible in order and a cursor never skips a row.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from paravt_agent.errors import ConfigError, ParaVTError
from paravt_agent.trajectory import Trace

__all__ = ["PostgresTrajectoryStore", "SQLiteTrajectoryStore", "TrajectoryStore", "open_store"]

FEEDBACK_KEYS = ("seq", "trace_id", "created", "answer", "reward", "thumbs", "note")
#: The advisory lock key that orders feedback inserts on PostgreSQL ("PVTF").
_FEEDBACK_LOCK = 0x50565446


def _is_postgres(target) -> bool:
    return isinstance(target, str) and target.split("://", 1)[0].lower() in ("postgresql", "postgres")


def _sqlite_path(target) -> Path:
    if isinstance(target, str) and "://" in target[:16]:
        scheme, rest = target.split("://", 1)
        if scheme.lower() != "sqlite":
            raise ConfigError(f"unknown trajectory store {target!r}: use a path, sqlite:///PATH or postgresql://...")
        # sqlite:///relative/path.db (three slashes) and sqlite:////abs/path.db (four), as SQLAlchemy spells them
        if not rest.startswith("/"):
            raise ConfigError(f"{target!r}: a SQLite URL is sqlite:///PATH (three slashes)")
        return Path(rest[1:])
    return Path(target)


class TrajectoryStore:
    """Traces and feedback. ``TrajectoryStore(target)`` opens the engine the target names (see the module)."""

    url: str

    def __new__(cls, target=None, *args, **kwargs):
        if cls is TrajectoryStore:
            cls = PostgresTrajectoryStore if _is_postgres(target) else SQLiteTrajectoryStore
        return super().__new__(cls)

    # what an engine provides
    def _execute(self, sql: str, params: tuple = ()) -> list[tuple]:
        raise NotImplementedError

    def _insert_feedback(self, row: tuple) -> int:
        raise NotImplementedError

    _upsert_sql: str
    _p: str  # the placeholder

    def close(self) -> None:
        """Close this thread's connection (others close with their threads or at exit)."""

    # the interface
    def add(self, trace: Trace) -> str:
        self._execute(self._upsert_sql,
                      (trace.id, trace.created, trace.video, trace.question, trace.answer, trace.to_json()))
        return trace.id

    def get(self, trace_id: str) -> Trace:
        rows = self._execute(f"SELECT trace FROM traces WHERE id = {self._p}", (trace_id,))
        if not rows:
            raise ParaVTError(f"no trace {trace_id!r} in {self.url}")
        return Trace.from_json(rows[0][0])

    def feedback(self, trace_id: str, answer: str | None = None, reward: float | None = None,
                 thumbs: bool | None = None, note: str | None = None) -> int:
        """Attach feedback: the correct answer, a reward, or thumbs up/down. Returns its sequence number."""
        if answer is None and reward is None and thumbs is None:
            raise ParaVTError("feedback needs an answer, a reward or thumbs up/down")
        if reward is not None:
            reward = float(reward)
        self.get(trace_id)  # must exist
        return self._insert_feedback(
            (trace_id, time.time(), answer, reward, None if thumbs is None else int(thumbs), note))

    def feedback_since(self, seq: int = 0) -> list[dict]:
        """Feedback rows after sequence number ``seq``, oldest first (for consumers that checkpoint ``seq``)."""
        rows = self._execute(
            f"SELECT {', '.join(FEEDBACK_KEYS)} FROM feedback WHERE seq > {self._p} ORDER BY seq", (int(seq),))
        return [dict(zip(FEEDBACK_KEYS, r, strict=True)) for r in rows]

    def count(self) -> int:
        return int(self._execute("SELECT COUNT(*) FROM traces")[0][0])

    def export(self) -> list[dict]:
        return [json.loads(r[0]) for r in self._execute("SELECT trace FROM traces ORDER BY created")]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class SQLiteTrajectoryStore(TrajectoryStore):
    """The embedded default: one SQLite file, one connection per thread."""

    _p = "?"
    _upsert_sql = "INSERT OR REPLACE INTO traces VALUES (?, ?, ?, ?, ?, ?)"
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

    def __init__(self, target: str | Path):
        self.path = _sqlite_path(target)
        self.url = str(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        self._conn().executescript(self.SCHEMA)

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA busy_timeout=30000")
            self._local.conn = conn
        return conn

    def _execute(self, sql: str, params: tuple = ()) -> list[tuple]:
        return self._conn().execute(sql, params).fetchall()

    def _insert_feedback(self, row: tuple) -> int:
        cur = self._conn().execute(
            "INSERT INTO feedback (trace_id, created, answer, reward, thumbs, note) VALUES (?, ?, ?, ?, ?, ?)", row)
        return int(cur.lastrowid)

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


class PostgresTrajectoryStore(TrajectoryStore):
    """PostgreSQL through psycopg 3: one autocommit connection per thread, reconnected when it drops."""

    _p = "%s"
    _upsert_sql = (
        "INSERT INTO traces VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (id) DO UPDATE SET created = EXCLUDED.created, "
        "video = EXCLUDED.video, question = EXCLUDED.question, answer = EXCLUDED.answer, trace = EXCLUDED.trace"
    )
    SCHEMA = (
        "CREATE TABLE IF NOT EXISTS traces (id TEXT PRIMARY KEY, created DOUBLE PRECISION, video TEXT, "
        "question TEXT, answer TEXT, trace TEXT NOT NULL)",
        "CREATE TABLE IF NOT EXISTS feedback (seq BIGSERIAL PRIMARY KEY, trace_id TEXT NOT NULL REFERENCES "
        "traces(id), created DOUBLE PRECISION, answer TEXT, reward DOUBLE PRECISION, thumbs INTEGER, note TEXT)",
        "CREATE INDEX IF NOT EXISTS feedback_trace ON feedback(trace_id)",
    )

    def __init__(self, target: str, connect_timeout: float = 10.0):
        try:
            import psycopg  # noqa: F401
        except ImportError as exc:
            raise ConfigError("a postgresql:// trajectory store needs psycopg: pip install 'paravt[postgres]'") from exc
        self.dsn = target
        self.url = _redact(target)
        self.connect_timeout = connect_timeout
        self._local = threading.local()
        conn = self._conn()
        with conn.transaction():
            # concurrent first opens would race on CREATE TABLE IF NOT EXISTS (a unique violation in pg_type)
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_FEEDBACK_LOCK + 1,))
            # CREATE INDEX IF NOT EXISTS takes a SHARE lock on feedback before it looks for the index, so it
            # would wait behind any open feedback insert: a store that exists is opened without any DDL
            if conn.execute("SELECT to_regclass('feedback_trace')").fetchone()[0] is None:
                for stmt in self.SCHEMA:
                    conn.execute(stmt)

    def _conn(self):
        import psycopg

        conn = getattr(self._local, "conn", None)
        if conn is None or conn.closed:
            try:
                conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=int(self.connect_timeout))
            except psycopg.OperationalError as exc:
                raise ParaVTError(f"cannot connect to the trajectory store {self.url}: {exc}") from exc
            self._local.conn = conn
        return conn

    def _execute(self, sql: str, params: tuple = ()) -> list[tuple]:
        cur = self._conn().execute(sql, params)
        return cur.fetchall() if cur.description is not None else []

    def _insert_feedback(self, row: tuple) -> int:
        conn = self._conn()
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_FEEDBACK_LOCK,))
            cur = conn.execute(
                "INSERT INTO feedback (trace_id, created, answer, reward, thumbs, note) "
                "VALUES (%s, %s, %s, %s, %s, %s) RETURNING seq", row)
            return int(cur.fetchone()[0])

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


def _redact(url: str) -> str:
    """The URL without its password (for messages and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def open_store(target: str | Path | TrajectoryStore | None) -> TrajectoryStore | None:
    """A store from a path or URL (``None`` stays ``None``; a store is returned as it is)."""
    if target is None or isinstance(target, TrajectoryStore):
        return target
    return TrajectoryStore(target)
