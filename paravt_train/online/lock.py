"""Exactly one online learner per output directory and per trajectory store, for the learner's whole life.

Two learners on one output directory would each push their own candidates, write the same registry and repair each
other's pushes; two on one store would each train on every label. :class:`LearnerLock` is taken at the learner's
set-up (rank 0) and held until it ends — a process that dies (``kill -9`` included) lets go of it with its last file
descriptor or connection, so there is nothing stale to clean up:

* ``OUTPUT_DIR/learner.lock``: an exclusive ``flock`` (Linux's NFS v4 client and Lustre carry it across hosts
  sharing the disk); the file says who holds it (pid, host, since);
* the store: a SQLite store's file gets the same ``flock`` beside it (``STORE.learner.lock``); a PostgreSQL store
  ``pg_try_advisory_lock`` on a connection the learner keeps open (the lock is the session's: it ends with the
  connection), named ``paravt-learner pid=… host=…`` in ``pg_stat_activity`` so a refused learner can say who.

A second learner is refused at set-up (:class:`LearnerRunning`, a :class:`~paravt_agent.errors.ConfigError`),
naming the holder — whether or not the first is pushing at that moment. Operator commands (``paravt-train online
promote|rollback``) take no learner lock: they serialize with the learner's pushes by the push lock
(:func:`~paravt_train.sync.lease.push_lock`), and a running learner follows them.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import time
from pathlib import Path

from paravt_agent.errors import ConfigError

__all__ = ["PG_LOCK_KEY", "LearnerLock", "LearnerRunning"]

#: the PostgreSQL advisory lock key of "the online learner of this database" (64 bits of a hash of its name)
PG_LOCK_KEY = int.from_bytes(hashlib.sha256(b"paravt online learner").digest()[:8], "big", signed=True)


class LearnerRunning(ConfigError):
    """Another learner holds this output directory or store."""


def _me() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}


def _flock(path: Path, what: str):
    """An open file holding an exclusive flock on ``path`` with this process as its holder, or LearnerRunning."""
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+")  # noqa: SIM115 (held for the learner's life; closed on release or with the process)
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        try:
            holder = json.loads(f.read() or "{}")
        except ValueError:
            holder = {}
        f.close()
        since = holder.get("since")
        ago = f", since {time.time() - since:.0f}s ago" if isinstance(since, int | float) else ""
        raise LearnerRunning(
            f"another online learner holds {what} (pid {holder.get('pid', '?')} on {holder.get('host', '?')}{ago}; "
            f"lock {path}): one learner per output directory and store — stop it first, or give this one its own "
            "output_dir and store") from None
    f.seek(0)
    f.truncate()
    f.write(json.dumps(_me()))
    f.flush()
    return f


class LearnerLock:
    """The learner's hold on ``out_dir`` and on ``store`` (a :class:`~paravt_agent.store.TrajectoryStore`, or None):
    :meth:`acquire` at set-up, :meth:`release` when the learner ends (or with the process)."""

    def __init__(self, out_dir: str | Path, store=None):
        self.out_dir = Path(out_dir)
        self.store = store
        self._files: list = []
        self._pg = None

    def acquire(self) -> LearnerLock:
        try:
            self._files.append(_flock(self.out_dir / "learner.lock", f"the output directory {self.out_dir}"))
            path = getattr(self.store, "path", None)  # a SQLite store's file
            if path is not None:
                path = Path(path)
                self._files.append(_flock(path.with_name(path.name + ".learner.lock"), f"the store {path}"))
            elif getattr(self.store, "dsn", None):
                self._pg = self._pg_lock(self.store.dsn, self.store.url)
        except BaseException:
            self.release()
            raise
        return self

    @staticmethod
    def _pg_lock(dsn: str, url: str):
        import psycopg

        me = _me()
        name = f"paravt-learner pid={me['pid']} host={me['host']}"[:63]
        conn = psycopg.connect(dsn, autocommit=True, application_name=name)
        if conn.execute("SELECT pg_try_advisory_lock(%s)", (PG_LOCK_KEY,)).fetchone()[0]:
            return conn
        # a bigint advisory lock is (classid, objid) = (high, low) 32 bits, objsubid 1
        key = PG_LOCK_KEY & 0xFFFFFFFFFFFFFFFF
        row = conn.execute(
            "SELECT a.application_name, a.client_addr, a.backend_start FROM pg_locks l JOIN pg_stat_activity a "
            "ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 AND "
            "l.classid::bigint = %s AND l.objid::bigint = %s", (key >> 32, key & 0xFFFFFFFF)).fetchone()
        conn.close()
        who = (f"{row[0] or 'a session without a name'} from {row[1] or 'a local socket'}, connected "
               f"{row[2]:%Y-%m-%d %H:%M:%S}" if row else "a session that has just ended")
        raise LearnerRunning(f"another online learner holds the store {url} ({who}; advisory lock {PG_LOCK_KEY}): one "
                             "learner per store — stop it first")

    def release(self) -> None:
        for f in self._files:
            f.close()  # the flock ends with its file description
        self._files = []
        if self._pg is not None:
            self._pg.close()  # a session's advisory lock ends with it
            self._pg = None
