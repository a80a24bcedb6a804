"""The push journal, which is also the pause lease: what a pusher killed during a push leaves behind.

A push pauses generation on a server (``/pause_generation`` … ``/continue_generation``, :class:`~paravt_train.sync.
http.Paused`); a pusher killed in between (``kill -9``, a lost node) never sends the continue, and SGLang stays
paused: every user's request waits. Three things bound and repair that:

* **one push at a time** (:func:`push_lock`): every push from an output directory holds an exclusive ``flock`` on
  ``push.json.lock`` beside its journal (on the shared disk: NFS v4 and Lustre carry it to every host) while it
  runs; a second pusher (the operator's ``paravt-train online promote|rollback`` while the learner pushes) waits for
  the first to end, and no pusher ever removes a journal it did not write (each carries its own ``token``).
* **the lease** (while the pusher lives): :func:`journal_push` writes the journal file *before* the first pause
  and renews it while the push runs — every second a thread of the pushing process increments its ``renewals``
  counter (the file replaced atomically) — until the push has ended, finished or failed (a failed push has
  continued generation already); then it removes the file. An observer (the server's supervisor, ``paravt serve
  --sync-lease FILE``, :class:`~paravt_agent.serving.supervisor.LeaseWatch`; a restarting learner or operator
  command, :func:`settle_unfinished`) times how long the counter has stood still with *its own* monotonic clock:
  no clock is compared with another, so a writer whose clock is minutes off (or a disk that stamps its own time)
  neither loses a live pause nor keeps a dead one.
* **the journal** (at the next start): a journal file left behind is a push that never ended. The online learner
  (:meth:`~paravt_train.online.learner.OnlineLearner.run`, and while it runs, after an operator's push died) and the
  operator's next ``promote`` / ``rollback`` settle it (:func:`settle_unfinished`: under the push lock, its lease
  watched until it is known dead), continue generation on the servers it names, close a weight-update session left
  open, and put a version the registry knows back on them (the half-applied push is never taken for a version),
  then record the repair in ``online_events.jsonl``.

The journal is the sync's own (``WeightSync.journal``, given by whoever makes it: :func:`~paravt_train.sync.
make_weight_sync`'s ``journal``): the GRPO trainer and the online learner journal at ``OUTPUT_DIR/push.json``, and so
do an operator's ``paravt-train online promote|rollback`` on that directory; a sync made without one (a shadow
gate's server, a test) writes nothing. A journal written by 0.5.1 (no counter: it renewed the file's time) is read
and repaired the same way; its renewals are seen as changes of that time.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

from paravt_agent.errors import ConfigError
from paravt_agent.serving.supervisor import lease_token

__all__ = ["FORMAT", "PUSH_WAIT_SECONDS", "RENEW_SECONDS", "WATCH_SECONDS", "PushInProgress", "journal_push",
           "push_lock", "settle_unfinished", "unfinished_push"]

#: how often a live push renews its lease (increments the journal's counter)
RENEW_SECONDS = 1.0
#: how long a restarting learner or operator command watches a journal's counter before it takes the pusher for
#: dead (a live one renews several times meanwhile, whatever its clock says)
WATCH_SECONDS = 3 * RENEW_SECONDS
#: how long a push waits for another pusher's push on the same output directory to end
PUSH_WAIT_SECONDS = 900.0
#: the journal's shape (0.5.1's had no ``format``: renewed by its file time, without a counter or a token)
FORMAT = 2


class PushInProgress(ConfigError):
    """A live pusher holds the journal (its lease is being renewed, or the push lock held past the wait)."""


def _write(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def _read(path: Path) -> dict | None:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        record = {}
    return record if isinstance(record, dict) else {}


def _holder(journal: Path) -> str:
    rec = _read(journal)
    if not rec:
        return "another process"
    return f"the push of version {rec.get('version')} by pid {rec.get('pid')} on {rec.get('host')}"


_held: dict[str, list] = {}  # lock file -> [fd, depth] (this process: a push inside a repair takes it again)
_guard = threading.Lock()
_thread_locks: dict[str, threading.RLock] = {}


@contextlib.contextmanager
def push_lock(journal: str | Path, wait: float = PUSH_WAIT_SECONDS, log=print) -> Iterator[None]:
    """Hold the push lock of ``journal`` (an exclusive ``flock`` on ``JOURNAL.lock``, re-entrant in one thread):
    one push, or repair, at a time per output directory. Another process's push is waited for up to ``wait``
    seconds (said once), then :class:`PushInProgress` names it."""
    key = str(Path(journal).with_name(Path(journal).name + ".lock"))
    with _guard:
        rlock = _thread_locks.setdefault(key, threading.RLock())
    if not rlock.acquire(timeout=wait):
        raise PushInProgress(f"{journal}: another push of this process has held the push lock for {wait:g}s")
    try:
        with _guard:
            held = _held.get(key)
        if held is not None:  # this thread holds it already
            held[1] += 1
            try:
                yield
            finally:
                held[1] -= 1
            return
        Path(key).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(key, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            deadline, said = time.monotonic() + wait, False
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise PushInProgress(f"{journal}: {_holder(Path(journal))} has held the push lock for "
                                             f"more than {wait:g}s; wait for it to end, or stop it") from None
                    if not said:
                        log(f"waiting for {_holder(Path(journal))} to end (one push at a time per output directory)")
                        said = True
                    time.sleep(0.2)
            with _guard:
                _held[key] = [fd, 1]
            try:
                yield
            finally:
                with _guard:
                    _held.pop(key, None)
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
    finally:
        rlock.release()


@contextlib.contextmanager
def journal_push(path: str | Path | None, urls: Iterable[str], version: str | None, sync: str,
                 renew_every: float = RENEW_SECONDS, wait: float = PUSH_WAIT_SECONDS) -> Iterator[dict | None]:
    """Around one push: the push lock taken (another pusher's push waited for), the journal at ``path`` written
    before it starts, its lease renewed (the ``renewals`` counter) while it runs, removed when it ends (however: an
    exception has already continued generation) — only if it is still this push's. Nothing when ``path`` is None."""
    if path is None:
        yield None
        return
    path = Path(path)
    with push_lock(path, wait):
        record = {"format": FORMAT, "version": None if version is None else str(version), "sync": sync,
                  "urls": list(urls), "pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                  "token": uuid.uuid4().hex, "renewals": 0}
        _write(path, record)
        stop = threading.Event()

        def renew() -> None:
            while not stop.wait(renew_every):
                record["renewals"] += 1
                with contextlib.suppress(OSError):
                    _write(path, record)

        thread = threading.Thread(target=renew, name="paravt-push-lease", daemon=True)
        thread.start()
        try:
            yield record
        finally:
            stop.set()
            thread.join()
            if (_read(path) or {}).get("token") == record["token"]:  # never another pusher's journal
                path.unlink(missing_ok=True)


def unfinished_push(path: str | Path) -> dict | None:
    """The push a journal at ``path`` says never ended (None: no journal), with ``renewed``: its file's time (for
    what it says only: the writer's or the disk's clock, never compared with this one). An unreadable journal (the
    process died while writing it, before any pause) is reported with what is known."""
    path = Path(path)
    record = _read(path)
    if record is None:
        return None
    try:
        renewed = path.stat().st_mtime
    except FileNotFoundError:
        return None
    return {"version": None, "sync": None, "urls": [], **record, "renewed": renewed}


@contextlib.contextmanager
def settle_unfinished(path: str | Path, watch: float = WATCH_SECONDS, wait: float = PUSH_WAIT_SECONDS,
                      log=print) -> Iterator[dict | None]:
    """Under the push lock of ``path`` (a live pusher of this release holds it: waited for, up to ``wait``), the
    push its journal left unfinished, once known dead — or None: no journal, or the push ended while watched. The
    journal's lease is watched for ``watch`` seconds of this process's monotonic clock; a renewal meanwhile (a
    pusher that does not take the lock: 0.5.1's, or one on a host the lock does not reach) is
    :class:`PushInProgress`, naming it. The caller repairs what it gets inside the block (a push of its own there
    takes the lock again); when the block ends without an exception the journal is removed (if still that one),
    unless the caller set ``left["keep"]`` (a repair that could not reach every server: the journal stays, so the
    pause supervisor still sees a dead lease and the next pusher repairs again)."""
    path = Path(path)
    with push_lock(path, wait, log):
        left = _settle(path, watch)
        yield left
        if left is not None and not left.get("keep") and _same_journal(_read(path), left):
            path.unlink(missing_ok=True)


def _settle(path: Path, watch: float) -> dict | None:
    first = lease_token(path)
    if first is None:
        return None
    deadline = time.monotonic() + watch
    while time.monotonic() < deadline:
        time.sleep(min(0.25, watch / 8))
        now = lease_token(path)
        if now is None:
            return None  # it ended: nothing to repair
        if now != first:
            left = unfinished_push(path) or {}
            raise PushInProgress(
                f"{path}: a push of version {left.get('version')} by pid {left.get('pid')} on {left.get('host')} is "
                "renewing its lease: another learner or operator is pushing from this output directory; let it "
                "end, or stop it first")
    return unfinished_push(path)


def _same_journal(now: dict | None, left: dict) -> bool:
    if now is None:
        return False
    if "token" in left:
        return now.get("token") == left["token"]
    return {"version": None, "sync": None, "urls": [], **now, "renewed": left.get("renewed")} == left
