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
import secrets
import sqlite3
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from paravt_agent.errors import ConfigError, FeedbackError, ParaVTError, StoreError
from paravt_agent.store.feedback import check_answer, check_reward
from paravt_agent.store.principals import check_principal, key_digest
from paravt_agent.trajectory import Trace

__all__ = ["PostgresTrajectoryStore", "SQLiteTrajectoryStore", "TrajectoryStore", "open_store"]

FEEDBACK_KEYS = ("seq", "trace_id", "created", "answer", "reward", "thumbs", "note", "user_id", "principal")
#: columns added since the first schema (an older store gains them when it is opened)
_ADDED_COLUMNS = (("user_id", "TEXT"), ("key", "TEXT"), ("principal", "TEXT"))
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
                 thumbs: bool | None = None, note: str | None = None, user: str | None = None,
                 key: str | None = None, principal: str | None = None) -> int:
        """Attach feedback: the correct answer, a reward, or thumbs up/down, and who gave it: ``principal``, the
        voter it counts for (:mod:`~paravt_agent.store.principals`: an API key's owner, the web page; None: the
        ``user``, or the operator's own label), and ``user``, a sub-label within it (a request's ``user`` field, a
        web session, the SDK's ``user=``). Returns its sequence number.

        What may become training data is checked here (:mod:`paravt_agent.store.feedback`): an answer must be one the
        trace's question can have, and must not contradict an earlier answer for the same trace; otherwise a
        :class:`FeedbackError` says what to send. ``key`` makes the write idempotent: the same key again returns
        the first row's number (a client retrying after a lost connection writes nothing twice)."""
        key = key or uuid.uuid4().hex
        try:
            return self._feedback(trace_id, answer, reward, thumbs, note, user, key, principal)
        except StoreError as exc:  # the database went away: once more on a new connection (the key dedupes)
            if not exc.retryable:
                raise
            return self._feedback(trace_id, answer, reward, thumbs, note, user, key, principal)

    def _feedback(self, trace_id, answer, reward, thumbs, note, user, key, principal) -> int:
        if answer is None and reward is None and thumbs is None:
            raise FeedbackError("feedback needs an answer, a reward or thumbs up/down")
        reward = check_reward(reward)
        if thumbs is not None and not isinstance(thumbs, bool):
            raise FeedbackError(f"thumbs is true or false; got {thumbs!r}")
        if note is not None and (not isinstance(note, str) or len(note) > 10_000):
            raise FeedbackError("a note is text of at most 10,000 characters")
        trace = self.get(trace_id)  # must exist
        if answer is not None:
            answer = check_answer(trace, answer)
            earlier = {r[0] for r in self._execute(
                f"SELECT answer FROM feedback WHERE trace_id = {self._p} AND answer IS NOT NULL", (trace_id,))}
            if earlier and answer not in earlier:
                raise FeedbackError(f"trace {trace_id} already has the answer {sorted(earlier)[0]!r} from earlier "
                                    f"feedback; {answer!r} conflicts with it and is not stored")
        return self._insert_feedback((trace_id, time.time(), answer, reward, None if thumbs is None else int(thumbs),
                                      note, None if user is None else str(user)[:200], key,
                                      None if principal is None else str(principal)[:200]))

    def feedback_since(self, seq: int = 0) -> list[dict]:
        """Feedback rows after sequence number ``seq``, oldest first (for consumers that checkpoint ``seq``)."""
        rows = self._execute(
            f"SELECT {', '.join(FEEDBACK_KEYS)} FROM feedback WHERE seq > {self._p} ORDER BY seq", (int(seq),))
        return [dict(zip(FEEDBACK_KEYS, r, strict=True)) for r in rows]

    # the API keys the operator mapped to principals here (``paravt keys``; ``paravt api --keys store``)
    def add_key(self, principal: str) -> str:
        """A new API key for ``principal`` (:func:`~paravt_agent.store.principals.check_principal`). Only its SHA-256
        is stored: this is the one time the key is seen."""
        check_principal(principal)
        key = "pvt-" + secrets.token_urlsafe(24)
        self._execute(f"INSERT INTO api_keys (digest, principal, created) VALUES ({self._p}, {self._p}, {self._p})",
                      (key_digest(key), principal, time.time()))
        return key

    def principal_of_key(self, digest: str) -> str | None:
        """The principal a key's SHA-256 (:func:`~paravt_agent.store.principals.key_digest`) was made for."""
        rows = self._execute(f"SELECT principal FROM api_keys WHERE digest = {self._p}", (digest,))
        return rows[0][0] if rows else None

    def revoke_keys(self, principal: str) -> int:
        """Delete every key of ``principal``; how many there were."""
        n = int(self._execute(f"SELECT COUNT(*) FROM api_keys WHERE principal = {self._p}", (principal,))[0][0])
        self._execute(f"DELETE FROM api_keys WHERE principal = {self._p}", (principal,))
        return n

    def api_keys(self) -> list[dict]:
        """Every key: its principal, the start of its SHA-256 and when it was made (never the key)."""
        rows = self._execute("SELECT principal, digest, created FROM api_keys ORDER BY principal, created")
        return [{"principal": p, "digest": d[:12], "created": c} for p, d, c in rows]

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
    CREATE TABLE IF NOT EXISTS api_keys (digest TEXT PRIMARY KEY, principal TEXT NOT NULL, created REAL);
    """
    MIGRATE = "CREATE UNIQUE INDEX IF NOT EXISTS feedback_key ON feedback(key)"

    def __init__(self, target: str | Path):
        self.path = _sqlite_path(target)
        self.url = str(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        conn = self._conn()
        conn.executescript(self.SCHEMA)
        have = {r[1] for r in conn.execute("PRAGMA table_info(feedback)").fetchall()}
        for name, kind in _ADDED_COLUMNS:
            if name not in have:
                conn.execute(f"ALTER TABLE feedback ADD COLUMN {name} {kind}")
        conn.execute(self.MIGRATE)

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
        conn = self._conn()
        conn.execute("INSERT OR IGNORE INTO feedback (trace_id, created, answer, reward, thumbs, note, user_id, key, "
                     "principal) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
        return int(conn.execute("SELECT seq FROM feedback WHERE key = ?", (row[7],)).fetchone()[0])

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
    KEYS = ("CREATE TABLE IF NOT EXISTS api_keys (digest TEXT PRIMARY KEY, principal TEXT NOT NULL, "
            "created DOUBLE PRECISION)")
    MIGRATE = (*(f"ALTER TABLE feedback ADD COLUMN IF NOT EXISTS {name} {kind}" for name, kind in _ADDED_COLUMNS),
               "CREATE UNIQUE INDEX IF NOT EXISTS feedback_key ON feedback(key)")

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
            have = {r[0] for r in conn.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_schema = current_schema() AND "
                "table_name = 'feedback'").fetchall()}  # the catalog: no lock on feedback
            if (conn.execute("SELECT to_regclass('feedback_key')").fetchone()[0] is None
                    or any(name not in have for name, _ in _ADDED_COLUMNS)):  # a store an older release made
                for stmt in self.MIGRATE:
                    conn.execute(stmt)
            if conn.execute("SELECT to_regclass('api_keys')").fetchone()[0] is None:
                conn.execute(self.KEYS)

    def _conn(self):
        import psycopg

        conn = getattr(self._local, "conn", None)
        if conn is None or conn.closed:
            try:
                conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=int(self.connect_timeout))
            except psycopg.OperationalError as exc:
                raise StoreError(f"cannot connect to the trajectory store {self.url}: {exc}; retry once it is "
                                 "back") from exc
            self._local.conn = conn
        return conn

    def _gone(self, exc, what: str, retryable: bool = True) -> StoreError:
        """The database went away (restarted, the network dropped): this thread's connection is dropped (the next
        call reconnects) and the error says whether the call can simply be made again."""
        conn, self._local.conn = getattr(self._local, "conn", None), None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 (already broken)
                pass
        then = "retry it" if retryable else "check before retrying"
        return StoreError(f"the trajectory store {self.url} went away during {what} ({exc.__class__.__name__}: "
                          f"{str(exc).strip()[:200]}); {then}", retryable=retryable)

    def _execute(self, sql: str, params: tuple = ()) -> list[tuple]:
        import psycopg

        try:
            cur = self._conn().execute(sql, params)
            return cur.fetchall() if cur.description is not None else []
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            # reads and the trace upsert (keyed by trace id) are idempotent: safe to make again
            raise self._gone(exc, sql.split(None, 1)[0].lower()) from exc

    def _insert_feedback(self, row: tuple) -> int:
        import psycopg

        try:
            conn = self._conn()
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_FEEDBACK_LOCK,))
                cur = conn.execute(
                    "INSERT INTO feedback (trace_id, created, answer, reward, thumbs, note, user_id, key, principal) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (key) DO NOTHING RETURNING seq", row)
                got = cur.fetchone()
                if got is None:  # this key was written before (a retry): its row
                    got = conn.execute("SELECT seq FROM feedback WHERE key = %s", (row[7],)).fetchone()
                return int(got[0])
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            # idempotent by its key: the same call with the same key writes the row at most once
            raise self._gone(exc, "a feedback write (idempotent by its key)") from exc

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
